"""Checking a plan against its model: :meth:`PipelinePlan.verify` and ``partition``'s check.

[Note: plan verification]
The plan is run stage by stage on one set of inputs, as a pipeline would run it (each stage on
the values ``stage_arg_names`` names), and the unsplit model on the same inputs; both under
``torch.no_grad()``, from the same RNG state (dropout draws the same masks) and the same buffer
values, once in train mode and once in eval mode (model and stages alike: the stages run each
mode's graph, [Note: stage modes] in ``capture._modal``), with the parameters in the dtype the plan
was captured with (:attr:`~pipedialect.PipelinePlan.param_dtype`). Forward hooks on the split-point
modules record each split point's real output in both runs. After stage ``k`` the plan's
split-point output is compared with the model's: on the fx path the split point is one call, so
its hook fires in the plan run too; on the torch.export path its code is inlined, so every
tensor stage ``k`` sends that the split point's code computed must equal a tensor of the model's
output there. Then the plan's output is compared with the model's. The first difference raises
:class:`PlanMismatchError` naming the stage and the value's path; a stage that raises is
reported the same way.

Comparison: the same container types, dict keys in the same order, Python values equal, ints
and bools exact, tensors of the same shape, dtype and device, equal for non-float dtypes and
``torch.allclose`` with :data:`TOLERANCES` for float dtypes (tight: both runs execute the
same kernels; the export path's aten ops are the ones eager mode calls). On the meta device only
structure, shapes and dtypes are compared, and the model runs on fake tensors
(:class:`~torch._subclasses.fake_tensor.FakeTensorMode` over the meta inputs and weights), so
nothing reads a value: code that would look at one eagerly takes the branch it takes under
tracing instead (transformers' sdpa mask skips its all-ones test for a fake ``padding_mask``:
the test is ``.item()``, which a meta tensor cannot answer), and code that reads a value
regardless is refused by name (:class:`PartitionError`), since a meta tensor has none.

Nothing is left on the model: hooks are removed, buffers (BatchNorm's running statistics, a
buffer forward replaces) get their objects and values back after each run, the RNG state
is restored, every module's train/eval flag and the parameters' dtype are put back.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from ..errors import PartitionError, PipeDialectError, PlanMismatchError
from ..runtime.module_state import apply_modes
from . import _state
from .capture import _modal

__all__: list[str] = []


class CheckedPlan(Protocol):
    """What the check reads of a :class:`~pipedialect.plan.partition.PipelinePlan`.

    Written out here so that this module, which ``partition`` imports, does not import it back
    (tests/project/test_layout.py counts ``TYPE_CHECKING`` imports too).
    """

    @property
    def model(self) -> nn.Module | None: ...
    @property
    def stages(self) -> tuple[fx.GraphModule, ...]: ...
    @property
    def stage_names(self) -> tuple[str, ...]: ...
    @property
    def input_names(self) -> tuple[str, ...]: ...
    @property
    def stage_arg_names(self) -> tuple[tuple[str, ...], ...]: ...
    @property
    def split_points(self) -> tuple[str, ...]: ...
    @property
    def concrete_args(self) -> Mapping[str, Any]: ...
    @property
    def param_dtype(self) -> torch.dtype | None: ...
    @property
    def autocast(self) -> torch.dtype | None: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def module_modes(self) -> Mapping[str, tuple[bool, bool]]: ...
    @property
    def stage_modes(self) -> tuple[Mapping[str, tuple[bool, bool]], ...]: ...
    @property
    def _seen(self) -> dict[str, dict[str, Any]]: ...
    def sends(self, stage_id: int) -> tuple[str, ...]: ...
    def _output_origins(self) -> dict[str, str]: ...


logger = logging.getLogger(__name__)

#: ``(rtol, atol)`` by dtype for comparing float tensors; other float dtypes use float32's.
TOLERANCES: Mapping[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}


def verify(plan: CheckedPlan, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Run ``plan`` and its model on the inputs; raise at the first difference ([Note: plan
    verification])."""
    model = plan.model
    if model is None:
        raise PartitionError(
            "this plan holds no model to check it against; build it with partition()"
        )
    values = _bind(plan, model, args, kwargs)
    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if on_meta:
        # A meta model is checked for structure only; CPU inputs would not meet its weights.
        values = pytree.tree_map(
            lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, values
        )
    points = [model.get_submodule(path) for path in plan.split_points]
    # The graphs name a module as named_modules() first does (an alias's first name).
    first_names = {id(m): name for name, m in model.named_modules()}
    inputs = [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]
    targets = [first_names[id(m)] for m in points]
    autocast: Any = contextlib.nullcontext()
    if plan.autocast is not None:  # the model runs as the stages do ([Note: stages under
        device = next((t.device.type for t in inputs), "cpu")  # autocast] in ``_export``)
        autocast = torch.autocast(device, dtype=plan.autocast)
    with _state.parameters_as(model, plan.param_dtype), autocast:
        for training in (True, False):
            with _Modes(plan, model, training):
                try:
                    _verify_mode(plan, model, values, points, targets, inputs, on_meta)
                except PlanMismatchError as exc:
                    if training:
                        raise
                    raise PlanMismatchError(
                        f"{exc} (in eval mode)", stage=exc.stage, path=exc.path
                    ) from exc
        if not on_meta:
            with _Modes(plan, model, True):
                _verify_gradients(plan, model, values, inputs)
    logger.info("verified %r against %s", plan, type(model).__name__)


def _verify_mode(
    plan: CheckedPlan,
    model: nn.Module,
    values: Mapping[str, Any],
    points: Sequence[nn.Module],
    targets: Sequence[str],
    inputs: Sequence[torch.Tensor],
    on_meta: bool,
) -> None:
    # The modules whose outputs the boundary values are, to find where in them ([Note:
    # boundary values] in ``partition``); watched in train mode only (eval sends the same).
    origins = plan._output_origins() if model.training else {}
    watched = sorted(set(origins.values()))
    with _Preserved(model, inputs) as rewind, torch.no_grad():
        with _Recorder(points) as seen, _Recorder(_modules(model, watched)) as produced:
            try:
                with _fake_values() if on_meta else contextlib.nullcontext():
                    expected = model(**values, **plan.concrete_args)
            except PipeDialectError:
                raise
            except Exception as exc:
                dtype = plan.param_dtype
                reads = isinstance(exc, DataDependentOutputException | DynamicOutputShapeException)
                raise PartitionError(
                    f"the model itself raised {type(exc).__name__} on the inputs the plan was "
                    f"to be checked on ({'train' if model.training else 'eval'} mode"
                    + (f", {dtype} parameters" if dtype is not None else "")
                    + f"): {exc}"
                    + (
                        "; its forward reads a tensor's value, which a model on the meta device "
                        "does not have: check the plan on a model with weights "
                        "(plan.verify(...) after loading them) and pass verify=False here"
                        if reads
                        else ""
                    )
                ) from exc
        rewind()
        checker = _Checker(plan, targets, seen.outputs, seen.inputs)
        if model.training:
            checker.observe(origins, dict(zip(watched, produced.outputs, strict=True)))
        checker.run(values, points, expected)


def _verify_gradients(
    plan: CheckedPlan,
    model: nn.Module,
    values: Mapping[str, Any],
    inputs: Sequence[torch.Tensor],
) -> None:
    """Differentiate one weighted sum of the outputs of the model and of the plan with respect
    to every trainable parameter, and raise at the first gradient that differs ([Note: plan
    gradients]).

    [Note: plan gradients]
    A stage graph can compute the model's forward and still differentiate it otherwise: a
    custom ``torch.autograd.Function`` captured as its forward's ops loses its ``backward``,
    a hook that changes gradients may not be part of the graph. So, in train mode, after the
    forward check, both are run with gradients from the same buffers and RNG state, the same
    scalar (each float output that needs a gradient times fixed weights, summed) is
    differentiated with ``torch.autograd.grad`` (which leaves every ``.grad`` as it was), and
    each parameter's gradient is compared, with ten times the forward's tolerances (relative to
    the gradient's largest entry: a backward adds up many terms). A model whose outputs need no
    gradient (everything frozen) has nothing to check.
    """
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    if not params:
        return
    name_of = {id(p): n for n, p in model.named_parameters()}
    stage_of: dict[int, int] = {}
    for k, stage in enumerate(plan.stages):
        for p in stage.parameters():
            stage_of.setdefault(id(p), k)
    with _Preserved(model, inputs) as rewind, torch.enable_grad():
        try:
            expected_out = model(**values, **plan.concrete_args)
        except Exception as exc:
            raise PartitionError(
                f"the model itself raised {type(exc).__name__} running its forward with "
                f"gradients on the inputs the plan was to be checked on: {exc}"
            ) from exc
        outputs = [t for t in _tensors_in(expected_out) if _differentiable(t)]
        if not outputs:
            return
        gen = torch.Generator().manual_seed(0)
        weights = [
            torch.rand(t.shape, generator=gen, dtype=torch.float32).to(t.device) for t in outputs
        ]
        expected = _grads(_weighted(outputs, weights), params)
        rewind()
        env: dict[str, Any] = dict(values)
        out: Any = None
        for k, stage in enumerate(plan.stages):
            names = plan.stage_arg_names[k]
            out = stage(*(env[n] for n in names))
            name = plan.stage_names[k]
            env[name] = out
            if isinstance(out, tuple):
                env.update((f"{name}.{i}", item) for i, item in enumerate(out))
        got_outputs = [t for t in _tensors_in(out) if _differentiable(t)]
        if [t.shape for t in got_outputs] != [t.shape for t in outputs]:
            last = plan.num_stages - 1
            raise PlanMismatchError(
                f"[Stage {last}] the plan's outputs that need a gradient "
                f"({[list(t.shape) for t in got_outputs]}) are not the model's "
                f"({[list(t.shape) for t in outputs]}): a stage lost or added a backward path",
                stage=last,
            )
        got = _grads(_weighted(got_outputs, weights), params)
    for param, want, have in zip(params, expected, got, strict=True):
        name = name_of.get(id(param), "?")
        k = stage_of.get(id(param), plan.num_stages - 1)
        what = None
        if (want is None) != (have is None):
            what = "gets a gradient in " + ("the plan only" if want is None else "the model only")
        elif want is not None and have is not None:
            rtol, atol = TOLERANCES.get(want.dtype, TOLERANCES[torch.float32])
            scale = float(want.detach().abs().max()) if want.numel() else 0.0
            if not torch.allclose(have, want, rtol=10 * rtol, atol=10 * (atol + rtol * scale)):
                gap = float((have - want).abs().nan_to_num(nan=float("inf")).max())
                what = f"has a gradient that differs by up to {gap:.3g} (largest entry {scale:.3g})"
        if what is not None:
            raise PlanMismatchError(
                f"[Stage {k}] parameter {name!r} {what}: the stage computes the model's forward "
                "but not its backward. A custom torch.autograd.Function whose backward the "
                "capture did not keep, or a hook that changes gradients, does this: keep such "
                "a module whole with leaf_modules=[...] (torch.fx capture)",
                stage=k,
                path=name,
            )


def _differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


def _weighted(outputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> torch.Tensor:
    total = (outputs[0].float() * weights[0]).sum()
    for t, w in zip(outputs[1:], weights[1:], strict=True):
        total = total + (t.float() * w).sum()
    return total


def _grads(total: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    return torch.autograd.grad(total, params, allow_unused=True)


def _modules(model: nn.Module, paths: Sequence[str]) -> list[nn.Module]:
    return [model.get_submodule(path) for path in paths]


def _fake_values() -> FakeTensorMode:
    """Runs the meta model on fake tensors: its code sees a traced value and reads none
    ([Note: plan verification])."""
    return FakeTensorMode(allow_non_fake_inputs=True)


class _Modes:
    """Puts the model and the stages in one mode for a check, each module with the flag the
    plan recorded for it in that mode ([Note: per-module modes] in ``runtime.module_state``),
    and every module's flag back afterwards."""

    def __init__(self, plan: CheckedPlan, model: nn.Module, training: bool) -> None:
        self._roots: list[nn.Module] = [model, *plan.stages]
        tables = plan.stage_modes or tuple({} for _ in plan.stages)
        self._tables = [plan.module_modes, *tables]
        self._training = training
        self._flags: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        seen: set[int] = set()
        for root in self._roots:
            for module in root.modules():
                if id(module) not in seen:
                    seen.add(id(module))
                    self._flags.append((module, module.training))
        for root, table in zip(self._roots, self._tables, strict=True):
            apply_modes(root, table, self._training)

    def __exit__(self, *exc: object) -> None:
        for module, flag in self._flags:
            module.training = flag


def _bind(
    plan: CheckedPlan, model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The plan's inputs by name, in ``plan.input_names`` order."""
    names = plan.input_names
    if len(args) > len(names):
        raise PartitionError(
            f"verify takes the plan's inputs {list(names)}; got {len(args)} positional values"
        )
    values = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        if name not in names:
            raise PartitionError(
                f"verify got {name!r}, which is not an input of the plan (its inputs: "
                f"{list(names)})"
            )
        if name in values:
            raise PartitionError(f"verify got the input {name!r} both by position and by name")
        values[name] = value
    parameters = inspect.signature(model.forward).parameters
    for name in names:
        if name not in values:
            parameter = parameters.get(name)
            if parameter is None or parameter.default is inspect.Parameter.empty:
                raise PartitionError(f"verify needs a value for the plan input {name!r}")
            values[name] = parameter.default
    return {name: values[name] for name in names}


class _Recorder:
    """Forward hooks that record what each split-point module is called with and returns, in
    call order."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._modules = modules
        self.outputs: list[list[Any]] = [[] for _ in modules]
        #: The tensors each call received (the export path may send one of them onwards).
        self.inputs: list[list[list[torch.Tensor]]] = [[] for _ in modules]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> _Recorder:
        for i, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(self._hook(i), with_kwargs=True))
        return self

    def _hook(self, i: int) -> Callable[[nn.Module, Any, Any, Any], None]:
        def record(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            # Copies: the code after the split point may update the tensors in place.
            received = pytree.tree_leaves((args, kwargs))
            self.inputs[i].append(
                [t.detach().clone() for t in received if isinstance(t, torch.Tensor)]
            )
            self.outputs[i].append(_copied(output))

        return record

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


class _Preserved(contextlib.AbstractContextManager[Callable[[], None]]):
    """Restores the model's buffers and the RNG state; ``rewind()`` does so between runs."""

    def __init__(self, model: nn.Module, inputs: Sequence[torch.Tensor]) -> None:
        self._modules = list(model.modules())
        tensors = [*inputs, *model.parameters(), *model.buffers()]
        self._cuda = sorted({_cuda_index(t.device) for t in tensors if t.device.type == "cuda"})
        self._rng: contextlib.ExitStack | None = None

    def __enter__(self) -> Callable[[], None]:
        self._buffers = [dict(m._buffers) for m in self._modules]
        self._values = {
            id(b): b.detach().clone()
            for table in self._buffers
            for b in table.values()
            if b is not None
        }
        self._rng = contextlib.ExitStack()
        self._rng.enter_context(torch.random.fork_rng(devices=self._cuda))
        self._cpu_state = torch.get_rng_state()
        self._cuda_states = [torch.cuda.get_rng_state(d) for d in self._cuda]
        return self.rewind

    def rewind(self) -> None:
        """Put buffers and RNG back as they were when the check began."""
        for module, table in zip(self._modules, self._buffers, strict=True):
            module._buffers.clear()
            module._buffers.update(table)
        for table in self._buffers:
            for buffer in table.values():
                if buffer is not None:
                    buffer.data.copy_(self._values[id(buffer)])
        torch.set_rng_state(self._cpu_state)
        for device, state in zip(self._cuda, self._cuda_states, strict=True):
            torch.cuda.set_rng_state(state, device)

    def __exit__(self, *exc: object) -> None:
        try:
            self.rewind()
        finally:
            if self._rng is not None:
                self._rng.close()


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _Checker:
    """Runs the plan stage by stage and compares each split point with the model's."""

    def __init__(
        self,
        plan: CheckedPlan,
        targets: Sequence[str],
        expected: Sequence[Sequence[Any]],
        received: Sequence[Sequence[Sequence[torch.Tensor]]],
    ) -> None:
        self._plan = plan
        self._targets = targets
        self._expected = expected
        self._received = received
        self._origins: Mapping[str, str] | None = None
        self._produced: Mapping[str, Sequence[Any]] = {}

    def observe(self, origins: Mapping[str, str], produced: Mapping[str, Sequence[Any]]) -> None:
        """Record on the plan what each boundary value is as :meth:`run` computes it, and where
        in its origin module's output (``origins``: value -> module; ``produced``: module ->
        the outputs of its calls in the model's run)."""
        self._origins = origins
        self._produced = produced

    def _record(self, name: str, value: Any) -> None:
        if self._origins is None:
            return
        seen: dict[str, Any] = {}
        if isinstance(value, torch.Tensor):
            seen.update(
                shape=tuple(value.shape),
                dtype=value.dtype,
                nbytes=value.numel() * value.element_size(),
            )
        else:
            tensors = _tensors_in(value)
            seen["other"] = (
                repr(value)
                if not tensors and (value is None or isinstance(value, (bool, int, float)))
                else f"a {type(value).__name__} of {len(tensors)} tensor(s)"
            )
            seen["nbytes"] = sum(t.numel() * t.element_size() for t in tensors)
        module = self._origins.get(name)
        calls = self._produced.get(module, []) if module is not None else []
        if len(calls) == 1 and isinstance(value, torch.Tensor):
            leaves, _ = pytree.tree_flatten_with_path(calls[0])
            paths = tuple(
                pytree.keystr(path)
                for path, leaf in leaves
                if isinstance(leaf, torch.Tensor) and _difference(leaf, value, "") is None
            )
            if paths:
                seen["output"] = paths
        self._plan._seen[name] = seen

    def run(self, values: Mapping[str, Any], points: Sequence[nn.Module], expected: Any) -> None:
        """Raise :class:`PlanMismatchError` at the first stage whose output differs."""
        plan = self._plan
        env: dict[str, Any] = dict(values)
        last = plan.num_stages - 1
        out: Any = None
        with _Recorder(points) as seen:
            for k, stage in enumerate(plan.stages):
                out = self._run_stage(k, stage, env)
                if k == last:
                    break
                name = plan.stage_names[k]
                nodes = _returned(stage)
                if nodes is None:
                    env[name] = out
                    nodes, sent = [_output(stage).args[0]], [out]
                else:
                    sent = list(out)
                    env.update((f"{name}.{i}", item) for i, item in enumerate(sent))
                for value_name in plan.sends(k):
                    if value_name in env:
                        self._record(value_name, env[value_name])
                self._check_split_point(k, seen.outputs[k], nodes, sent)
        difference = _difference(expected, out, "")
        if difference is not None:
            raise PlanMismatchError(
                f"[Stage {last}] the plan's output differs from the model's{difference}",
                stage=last,
            )

    def _run_stage(self, k: int, stage: fx.GraphModule, env: Mapping[str, Any]) -> Any:
        names = self._plan.stage_arg_names[k]
        missing = [n for n in names if n not in env]
        if missing:
            raise PlanMismatchError(
                f"[Stage {k}] takes {missing}, which no earlier stage produced", stage=k
            )
        try:
            return stage(*(env[n] for n in names))
        except PipeDialectError:
            raise
        except Exception as exc:
            raise PlanMismatchError(
                f"[Stage {k}] raised {type(exc).__name__} on the inputs the plan was checked on, "
                f"where the model ran: {exc}",
                stage=k,
            ) from exc

    def _check_split_point(
        self, k: int, got: Sequence[Any], nodes: Sequence[Any], sent: Sequence[Any]
    ) -> None:
        path = self._plan.split_points[k]
        expected = self._expected[k]
        if len(expected) != 1:
            raise PlanMismatchError(
                f"[Stage {k}] split point {path!r} ran {len(expected)} times in the model's "
                "forward on these inputs; the plan was built for one call",
                stage=k,
                path=path,
            )
        if got:  # the fx path: the split point is one call in the stage
            difference = _difference(expected[0], got[-1], "")
            if difference is not None:
                raise PlanMismatchError(
                    f"[Stage {k}] the output of split point {path!r} differs from the model's"
                    f"{difference}",
                    stage=k,
                    path=path,
                )
            return
        # The export path: every tensor this stage sends that the split point's code computed
        # is one of the tensors the split point returns in the model, or one it was called with
        # (a no-op such as ``x.float()`` on a float32 ``x`` inside it is ``x`` itself, and
        # export may name later uses of ``x`` after it).
        real = _tensors_in(expected[0])
        real += self._received[k][0]
        for node, value in zip(nodes, sent, strict=True):
            if not isinstance(node, fx.Node) or not isinstance(value, torch.Tensor):
                continue
            stack = node.meta.get("nn_module_stack") or {}
            if all(entry[0] != self._targets[k] for entry in stack.values()):
                continue
            if all(_difference(t, value, "") is not None for t in real):
                raise PlanMismatchError(
                    f"[Stage {k}] sends {node.name!r} (shape {list(value.shape)}), which split "
                    f"point {path!r} computed, but it equals none of the tensors {path!r} returns "
                    "or receives in the model",
                    stage=k,
                    path=path,
                )


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it detached and copied, dataclasses included."""

    def leaf(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return item.detach().clone()
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            copied = copy.copy(item)
            for f in dataclasses.fields(item):
                object.__setattr__(copied, f.name, _copied(getattr(item, f.name)))
            return copied
        return item

    return pytree.tree_map(leaf, value)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``: its pytree leaves, looking into dataclasses too."""
    found: list[torch.Tensor] = []
    for item in pytree.tree_leaves(value):
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            for f in dataclasses.fields(item):
                found.extend(_tensors_in(getattr(item, f.name)))
    return found


def _output(stage: fx.GraphModule) -> fx.Node:
    return _modal.mode_graph(stage, stage.training).output_node()


def _returned(stage: fx.GraphModule) -> list[Any] | None:
    """The values a stage returns as a tuple of sent values; ``None`` when it sends one."""
    returned = _output(stage).args[0]
    return list(returned) if isinstance(returned, tuple) else None


def _difference(expected: Any, actual: Any, path: str) -> str | None:
    """`` at <path>: <how>`` for the first difference between the two values, else ``None``."""
    where = f" at {path}" if path else ""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return f"{where}: the model gives {_kind(expected)}, the plan {_kind(actual)}"
        return _tensor_difference(expected, actual, where)
    if type(expected) is not type(actual):
        return f"{where}: the model gives {_kind(expected)}, the plan {_kind(actual)}"
    if isinstance(expected, Mapping):
        if list(expected) != list(actual):
            return f"{where}: the model's keys are {list(expected)}, the plan's {list(actual)}"
        for key in expected:
            found = _difference(expected[key], actual[key], f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(expected, (tuple, list)):
        if len(expected) != len(actual):
            return f"{where}: the model gives {len(expected)} items, the plan {len(actual)}"
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            found = _difference(a, b, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for f in dataclasses.fields(expected):
            found = _difference(
                getattr(expected, f.name), getattr(actual, f.name), f"{path}.{f.name}"
            )
            if found is not None:
                return found
        return None
    if isinstance(expected, float) and expected != expected and actual != actual:
        return None  # both NaN
    try:
        same = bool(expected == actual)
    except Exception:
        same = expected is actual
    return None if same else f"{where}: the model gives {expected!r}, the plan {actual!r}"


def _tensor_difference(expected: torch.Tensor, actual: torch.Tensor, where: str) -> str | None:
    for attribute in ("shape", "dtype", "device"):
        a, b = getattr(expected, attribute), getattr(actual, attribute)
        if a != b:
            shown = (list(a), list(b)) if attribute == "shape" else (a, b)
            return f"{where}: the model's tensor has {attribute} {shown[0]}, the plan's {shown[1]}"
    if expected.device.type == "meta":
        return None
    if expected.is_floating_point() or expected.is_complex():
        rtol, atol = TOLERANCES.get(expected.dtype, TOLERANCES[torch.float32])
        if torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True):
            return None
        gap = (actual - expected).abs().nan_to_num(nan=float("inf")).max().item()
        return f"{where}: tensors differ by up to {gap:.3g} (rtol {rtol:g}, atol {atol:g})"
    if torch.equal(actual, expected):
        return None
    count = int((actual != expected).sum())
    return f"{where}: {count} of {expected.numel()} elements differ"


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return f"a {type(value).__qualname__}"
