"""torch.export capture behind ``partition(..., example_inputs=...)``.

[Note: export capture]
torch.fx traces symbolically: a value that reaches Python control flow (``if mask.ndim < 4``,
``if batch_size != ids.shape[0]``) stops it, and so does a ``functools.wraps`` decorator on
the root forward whose inner function takes ``**kwargs``. transformers 5 models are written
that way throughout (their masks are built by free functions, which ``leaf_modules`` cannot
reach), and transformers 5 no longer ships its own fx tracer. ``torch.export`` in non-strict
mode runs the forward as ordinary Python on fake tensors: shape control flow is decided on the
example inputs, decorators and context variables just run, and data-dependent control flow is
an error rather than a silent guess. transformers tests its models against it.

The exported program is turned into the same flat ``fx.Graph`` the fx capture produces, so the
splitter, liveness and tie analysis are shared ([Note: own splitter] in ``capture._split``):

- every use of a parameter or buffer becomes a ``get_attr`` of the original model, named as
  the module that uses it holds it (a weight tied between ``transformer.wte`` and ``lm_head``
  is ``transformer.wte.weight`` in the embedding's stage and ``lm_head.weight`` in the head's),
  so stages share the model's Parameter objects and a tie is found by identity;
- tensor constants and subgraph modules are set on the model under fresh names until the
  stages hold them, like the constants fx's tracer adds;
- the example inputs become placeholders named after forward's parameters, in signature order;
  the fixed arguments (``concrete_args``) disappear;
- the asserts export adds on input metadata are dropped (they pin the capture's device); in
  their place the first stage checks each input's shape and dtype against the example, since
  the graph is specialised to them;
- in-place updates of buffers (BatchNorm's running statistics, ``self.buf = ...``) stay
  in-place ops on the model's buffers, as export's training IR records them; a buffer
  assignment, which export applies as a ``copy_`` at the end of the graph, is moved back to
  where its value is computed, so that it happens in the stage that computes it;
- the output keeps the model's structure when it is made of tuples, lists, dicts and None.

[Note: stages under autocast]
Mixed precision as ``torch.autocast`` (and so accelerate and Hugging Face's ``Trainer``) means
it keeps fp32 parameters and runs eligible ops in bf16. Two things make a stage compute what the
unsplit model computes under autocast. The forward is exported under the same autocast, so the
dtypes the model's Python reads are autocast's (``x.type_as(h)`` with ``h`` the bf16 output of
a matmul is a cast to bf16, as in the eager model: Gemma2's norms do this), while the ops are
recorded as called, before autocast's casts. And :func:`autocast_stage` makes each stage run its
whole body (both modes' graphs) inside ``torch.autocast(<its inputs' device>, dtype)``, outlined
into one region as the recomputed ones are, so autocast casts at run time, per op, as in the
unsplit model. The logits of Llama, Qwen2, Mistral and Gemma2 then equal the unsplit model's
under autocast bit for bit (an fp32 capture run under autocast is off by a bf16 ulp on Gemma2).
A recomputed region inside keeps the autocast state (the checkpoint restores it when
recomputing).

[Note: recomputed regions]
The exported graph has no module calls to route through a checkpoint (``capture._recompute`` [Note:
recomputed calls]), but every node records the modules whose forward ran it. So after the cut,
:func:`checkpoint_regions` outlines, in each stage graph, the run of nodes a recomputed module
computed into a small ``GraphModule`` (the stage's attribute ``recomputed_<n>``, holding no
parameter: the parameters it reads stay ``get_attr`` nodes of the stage, passed in as
arguments) and calls it through non-reentrant ``torch.utils.checkpoint`` with the RNG state
preserved. The stage's parameter names and ties do not change, and the same numbers come out;
only the region's activations are dropped after the forward and recomputed in backward. A
region that writes a buffer in place would write it twice, and is refused by name.

A split point's computation is the run of nodes whose ``nn_module_stack`` names its module;
the stage boundary follows the last of them.

What export fixes at capture time: tensor shapes (micro-batches must have the example inputs'
shapes), dtypes, and the train/eval mode. The mode is handled by capturing twice ([Note: stage
modes] in ``capture._modal``); devices export also writes into the graph, and those are made to
follow the stage's tensors again, so a plan captured on the CPU runs on a GPU.

[Note: export precision]
Dtypes cannot be made to follow: ``x.to(h.dtype)`` becomes ``to(x, torch.float32)`` when ``h``
was fp32, exactly as ``x.float()`` does, and the two must differ under bf16. So the plan is
captured in the precision it trains in: ``partition(..., example_inputs=..., dtype=
torch.bfloat16)`` gives the model's floating-point parameters that dtype while it is captured
and checked (buffers keep theirs, as DeepSpeed's ``_cast_module_mixed_precision`` does and the
engines do), and records it as :attr:`~pipedialect.PipelinePlan.param_dtype`. The shared
``pipe_engine`` refuses a plan whose ``param_dtype`` differs from the dtype the config makes the
engine train (``"bf16": {"enabled": true}``: bf16; otherwise the parameters' own) and names
the ``dtype=`` that fits (:func:`pipedialect.plan.partition.check_capture_dtype`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import fx, nn
from torch.export.graph_signature import (
    ConstantArgument,
    InputKind,
    OutputKind,
    TensorArgument,
)

from ..cost.module_paths import check_execution_order, check_single_call
from ..errors import CaptureError, RecomputeError, SplitPointError, StructureChangedError
from . import _state
from .capture._capture import Captured
from .capture._tracer import remove_attrs

__all__: list[str] = []

logger = logging.getLogger(__name__)

# Checks export adds on tensor metadata; none has users.
_DROPPED = frozenset(
    {
        torch.ops.aten._assert_tensor_metadata.default,
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten.sym_constrain_range_for_size.default,
    }
)

_OUTPUT_CONTAINERS = (tuple, list, dict)


def capture(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    fixed: Mapping[str, Any],
    after_forward: Callable[..., None] | None = None,
) -> Captured:
    """Capture ``model`` with torch.export on ``example_inputs``; ``fixed`` are constant args.

    ``after_forward`` is a forward hook on the model while export runs its forward.
    """
    kwargs = _call_kwargs(model, _unaliased(example_inputs), fixed)
    handle = None if after_forward is None else model.register_forward_hook(after_forward)
    shared = _state.shared_buffer_slots(model)
    assigned: set[str] = set()

    def assign(module: nn.Module, name: str, value: Any) -> bool:
        # [Note: buffer assignment] in ``_state``: export records the copy on its fake buffer.
        if not isinstance(value, torch.Tensor):
            return False
        holders = shared.get((id(module), name))
        if holders is not None:
            _state.refuse_shared_assignment(holders)
        buffer = module._buffers[name]
        assert buffer is not None  # assignments_in_place only asks for registered buffers
        path = next((p for p, m in model.named_modules() if m is module), None)
        if path is None:
            return False
        full = f"{path}.{name}" if path else name
        _state.check_assignable(value, buffer, full)
        buffer.copy_(value)
        assigned.add(full)
        return True

    applied: list[type] = []
    try:
        with _state.assignments_in_place(assign), _applied_functions(applied):
            program = torch.export.export(model, (), kwargs, strict=False)
    except CaptureError:
        raise
    except Exception as exc:
        message = _export_message(model, exc)
        if "meta" in str(exc) and "device" in str(exc):
            message += (
                " A model on the meta device is exported on example inputs on the meta device "
                "too (x.to('meta')); the plan is then checked on structure, shapes and dtypes."
            )
        raise CaptureError(message) from exc
    finally:
        if handle is not None:
            handle.remove()
    refuse_functions(applied)
    _, in_spec = pytree.tree_flatten(((), kwargs))
    if program.call_spec.in_spec != in_spec:
        raise CaptureError(
            f"torch.export reordered the inputs of {type(model).__name__}.forward "
            f"({program.call_spec.in_spec}); pass example_inputs and concrete_args by name"
        )
    added: list[str] = []
    try:
        graph = _to_fx_graph(model, program, list(kwargs), added)
    except CaptureError:
        remove_attrs(model, added)
        raise
    _hoist_buffer_assignments(graph, model)
    _state.isolate_earlier_reads(graph, _assignment_copies(graph, model, assigned))
    logger.debug("torch.export captured %s: %d nodes", type(model).__name__, len(graph.nodes))
    return Captured(graph, added)


@contextlib.contextmanager
def _applied_functions(applied: list[type]) -> Iterator[None]:
    """Record in ``applied`` every autograd Function defined outside torch that forward
    applies while the block runs ([Note: custom autograd Functions] in ``capture._functions``)."""
    function = torch.autograd.function.Function
    original = function.__dict__["apply"]

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.split(".")[0] != "torch" and cls not in applied:
            applied.append(cls)
        return original.__get__(None, cls)(*args, **kwargs)

    function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        function.apply = original  # type: ignore[method-assign]


def refuse_functions(applied: Sequence[type]) -> None:
    """Refuse custom autograd Functions: torch.export keeps their forward's operations and
    drops their ``backward`` ([Note: custom autograd Functions] in ``capture._functions``)."""
    if not applied:
        return
    shown = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in applied)
    raise CaptureError(
        f"forward applies the custom torch.autograd.Function {shown}: torch.export records "
        "what its forward computes and drops its backward, so the stages would compute other "
        "gradients than the model. Partition without example_inputs: the torch.fx capture "
        "keeps each such apply as one call in the stage graph, backward included (call "
        "plan.verify(...) yourself to check the plan, gradients included)"
    )


def named(model: nn.Module, example_inputs: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
    """``example_inputs`` by parameter name: a tuple or list is matched to forward's
    parameters in order, as ``torch.export.export(model, args)`` would."""
    if isinstance(example_inputs, Mapping):
        return dict(example_inputs)
    name = type(model).__name__
    if not isinstance(example_inputs, (tuple, list)):
        shown = type(example_inputs).__name__
        raise CaptureError(
            f"example_inputs is a {shown}; give {{parameter name: tensor}} or a tuple of "
            f"tensors in {name}.forward's parameter order (one tensor x: (x,))"
        )
    positional = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(example_inputs) > len(positional):
        raise CaptureError(
            f"example_inputs holds {len(example_inputs)} values, but {name}.forward takes "
            f"{len(positional)} positional parameters ({positional}); name the others in a "
            "dict {parameter name: tensor}"
        )
    return dict(zip(positional, example_inputs, strict=False))


def _call_kwargs(
    model: nn.Module, example_inputs: Mapping[str, Any], fixed: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments of the capture call: inputs and fixed values, signature order."""
    name = type(model).__name__
    params = inspect.signature(model.forward).parameters
    named = [
        p.name
        for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not example_inputs:
        raise CaptureError(
            f"example_inputs is empty: name at least one input of {name}.forward "
            f"(its parameters: {named})"
        )
    for key, value in example_inputs.items():
        if key not in named:
            raise CaptureError(
                f"example_inputs names {key!r}, which is not a parameter of {name}.forward "
                f"(its parameters: {named})"
            )
        if not isinstance(value, torch.Tensor):
            raise CaptureError(
                f"example input {key!r} is a {type(value).__name__}, not a tensor; a plan input "
                f"is one tensor. Fix a non-tensor argument with concrete_args={{{key!r}: ...}}"
            )
    for key, value in fixed.items():
        if key in example_inputs:
            raise CaptureError(
                f"{key!r} is both an example input and a concrete argument; name it in one of them"
            )
        if key not in named and not takes_kwargs:
            raise CaptureError(
                f"concrete_args names {key!r}, which {name}.forward does not take "
                f"(its parameters: {named})"
            )
        leaves = pytree.tree_leaves(value)
        if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise CaptureError(
                f"concrete argument {key!r} holds a tensor; with example_inputs, tensors are "
                f"inputs: move {key!r} to example_inputs"
            )
    given = {**example_inputs, **fixed}
    ordered = {k: given[k] for k in named if k in given}
    ordered.update((k, v) for k, v in fixed.items() if k not in ordered)
    return ordered


def _unaliased(example_inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Copy example inputs that share memory with an earlier one.

    torch.export gives inputs that alias one placeholder, so the graph could not tell them apart
    on later micro-batches (``decoder_input_ids=input_ids`` would read ``input_ids`` forever).
    """
    seen: set[int] = set()
    unaliased: dict[str, Any] = {}
    for key, value in example_inputs.items():
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            ptr = value.untyped_storage().data_ptr()
            if ptr in seen:
                value = value.clone()
            seen.add(ptr)
        unaliased[key] = value
    return unaliased


def _export_message(model: nn.Module, exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return (
        f"torch.export could not capture {type(model).__name__}.forward: "
        f"{type(exc).__name__}: {first}. "
        "Fix flags and optional arguments with concrete_args (for transformers models: "
        "{'return_dict': False, 'use_cache': False}), give every tensor the forward needs in "
        "example_inputs, and choose an attention implementation without data-dependent "
        "control flow (attn_implementation='eager' in the config)."
    )


def _to_fx_graph(
    model: nn.Module, program: torch.export.ExportedProgram, names: Sequence[str], added: list[str]
) -> fx.Graph:
    """Rebuild the exported graph on the original model's attributes ([Note: export capture])."""
    signature = program.graph_signature
    old_nodes = list(program.graph.nodes)
    placeholders = [n for n in old_nodes if n.op == "placeholder"]
    aliases = _parameter_aliases(model)
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    # State placeholder -> name of the tensor in the model (parameters, buffers) or a fresh one.
    state: dict[fx.Node, str] = {}
    user_inputs = iter(names)
    inputs: list[tuple[str, fx.Node]] = []
    for node, spec in zip(placeholders, signature.input_specs, strict=True):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            state[node] = str(spec.target)
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            state[node] = _attach(model, program.constants[str(spec.target)], added)
        elif spec.kind is InputKind.USER_INPUT:
            name = next(user_inputs)
            if isinstance(spec.arg, TensorArgument):
                inputs.append((name, node))
            elif node.users:
                raise CaptureError(f"the fixed argument {name!r} is used as a graph value")
        else:
            raise CaptureError(
                f"torch.export captured {type(model).__name__}.forward with a {spec.kind.name} "
                f"input ({spec.target!r}), which pipeline stages cannot hold"
            )
    for name, node in inputs:
        ph = graph.placeholder(name)
        ph.meta = dict(node.meta)
        env[node] = ph
    for name, node in inputs:
        example = node.meta["val"]
        graph.call_function(check_input, (env[node], name, tuple(example.shape), example.dtype))

    attrs: dict[str, fx.Node] = {}

    def get_attr(target: str, source: fx.Node | None = None) -> fx.Node:
        if target not in attrs:
            attrs[target] = graph.get_attr(target)
            if source is not None and "val" in source.meta:
                attrs[target].meta["val"] = source.meta["val"]
        return attrs[target]

    for node in old_nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            continue
        if node.op == "get_attr":  # a subgraph of a higher-order op
            env[node] = get_attr(_attach(model, getattr(program.graph_module, node.target), added))
            continue
        # A parameter is fetched under the name the module using it here gives it.
        local = {
            src: get_attr(_name_in_module(state[src], aliases, _module_paths(node)), src)
            for src in node.all_input_nodes
            if src in state
        }

        def arg(n: fx.Node, local: Mapping[fx.Node, fx.Node] = local) -> Any:
            return local[n] if n in local else env[n]

        env[node] = graph.node_copy(node, arg)
    output = next(n for n in old_nodes if n.op == "output")
    graph.output(_output_structure(model, program, output, env))
    baked = {node.meta["val"].device for _, node in inputs}
    baked.update(p.device for p in model.parameters())
    _follow_devices(graph, baked)
    graph.lint()
    return graph


def _hoist_buffer_assignments(graph: fx.Graph, model: nn.Module) -> None:
    """Move each ``self.buf = value``, which export applies as ``copy_(buf, value)`` at the end
    of the graph, to right after ``value`` is computed.

    In the model the assignment happens there; at the end of the graph it would fall into the
    last stage, far from the stage that computes it ([Note: module state] in ``_state``). It
    moves only when no node in between uses the buffer or writes ``value``.
    """
    names = _state.BufferNames(model)
    aliases = _state.alias_table(graph, names, model)
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
            continue
        target, value = node.args[0], node.args[1]
        if not (
            isinstance(target, fx.Node)
            and target.op == "get_attr"
            and isinstance(value, fx.Node)
            and value.op == "call_function"
            and not node.users
        ):
            continue
        buffer = names.of_target(str(target.target))
        if buffer is None:
            continue
        between: list[fx.Node] = []
        cursor = value.next
        while cursor is not node:
            between.append(cursor)
            cursor = cursor.next
        touched = any(
            any(buffer in aliases.get(src, ()) for src in other.all_input_nodes)
            or value in _state.mutated_inputs(other, model)
            for other in between
        )
        if not touched:
            value.append(node)


def _assignment_copies(graph: fx.Graph, model: nn.Module, assigned: set[str]) -> list[fx.Node]:
    """The ``copy_`` nodes into the buffers forward assigned (``assigned``: their names)."""
    if not assigned:
        return []
    names = _state.BufferNames(model)
    wanted = {names.by_id[id(model.get_buffer(n))] for n in assigned}
    return [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and node.target is torch.ops.aten.copy_.default
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "get_attr"
        and names.of_target(str(node.args[0].target)) in wanted
    ]


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _follow_devices(graph: fx.Graph, baked: set[torch.device]) -> None:
    """Make the devices export wrote into the graph follow the tensors at run time.

    export records ``torch.arange(n, device=x.device)`` as ``arange(n, device=cpu)`` when it ran
    on the CPU, so stages moved to a GPU afterwards would create CPU tensors. Every device
    constant equal to a capture device becomes the device of a tensor the op takes, or else of
    the nearest tensor computed before it (never a parameter: that would tie it to this stage):
    a stage runs on one device, so both are the stage's device.
    """
    latest: fx.Node | None = None
    for node in list(graph.nodes):
        if node.op == "call_function" and _mentions_device(node, baked):
            own = [n for n in node.all_input_nodes if _is_tensor(n)]
            ref = own[0] if own else latest
            if ref is not None:
                with graph.inserting_before(node):
                    device = graph.call_function(getattr, (ref, "device"))

                def swap(value: Any, device: fx.Node = device) -> Any:
                    return device if isinstance(value, torch.device) and value in baked else value

                node.args = tuple(swap(a) for a in node.args)
                node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
        if node.op in ("placeholder", "call_function") and _is_tensor(node):
            latest = node


def _mentions_device(node: fx.Node, baked: set[torch.device]) -> bool:
    values = [*node.args, *node.kwargs.values()]
    return any(isinstance(v, torch.device) and v in baked for v in values)


def check_input(value: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Refuse an input whose shape or dtype differs from the example the stages were built on.

    torch.export specialises the graph to the example inputs' shapes; another shape would fail
    deep inside a stage with an unrelated message, or, where a reshape happens to fit, compute
    something else. Traced again (fx re-traces a GraphModule it unpickles), it records itself.
    """
    if isinstance(value, fx.Proxy):
        value.tracer.create_proxy("call_function", check_input, (value, name, shape, dtype), {})
        return
    if not isinstance(value, torch.Tensor):
        raise StructureChangedError(
            f"[Stage 0] input {name!r} is a {type(value).__name__}; the plan was captured with a "
            f"tensor of shape {list(shape)} and dtype {dtype}"
        )
    if tuple(value.shape) != shape or value.dtype != dtype:
        raise StructureChangedError(
            f"[Stage 0] input {name!r} has shape {list(value.shape)} and dtype {value.dtype}; the "
            f"plan was captured with example_inputs of shape {list(shape)} and dtype {dtype}, and "
            "torch.export specialised the stages to them. Feed micro-batches of that shape, or "
            "partition with example inputs shaped like the micro-batches."
        )


def _attach(model: nn.Module, value: Any, added: list[str]) -> str:
    """Set ``value`` on ``model`` under a fresh name; remember it for removal."""
    i = 0
    while hasattr(model, f"_export_constant{i}"):
        i += 1
    name = f"_export_constant{i}"
    if isinstance(value, nn.Module):
        model.add_module(name, value)
    elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        model.register_buffer(name, value, persistent=False)
    else:
        setattr(model, name, value)
    added.append(name)
    return name


def _parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """For every parameter and buffer name, all names the same tensor has in ``model``."""
    by_id: dict[int, list[str]] = {}
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in tensors:
        by_id.setdefault(id(tensor), []).append(name)
    return {name: by_id[id(tensor)] for name, tensor in tensors}


def _module_paths(node: fx.Node) -> list[str]:
    """The modules whose forward ran ``node``, innermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [str(path) for path, _ in reversed(list(stack.values()))]


def _name_in_module(target: str, aliases: Mapping[str, Sequence[str]], paths: Sequence[str]) -> str:
    """The name of ``target`` as the innermost module using it holds it (ties: its own name)."""
    names = aliases.get(target, [target])
    for path in paths:
        prefix = f"{path}." if path else ""
        own = [n for n in names if n.startswith(prefix)]
        if own:
            return min(own, key=lambda n: (n.count("."), n))
    return target


def _output_structure(
    model: nn.Module,
    program: torch.export.ExportedProgram,
    output: fx.Node,
    env: Mapping[fx.Node, Any],
) -> Any:
    """The model's output as tuples/lists/dicts of the new graph's nodes."""
    values: list[Any] = []
    returned = list(output.args[0])  # type: ignore[arg-type]
    for spec, node in zip(program.graph_signature.output_specs, returned, strict=True):
        if spec.kind is not OutputKind.USER_OUTPUT:
            # export's training IR keeps buffer updates as in-place ops (BatchNorm's running
            # statistics included); an update returned as an output would be lost.
            raise CaptureError(
                f"torch.export returned {type(model).__name__}.forward's {spec.kind.name} of "
                f"{spec.target!r} as an output, which pipeline stages cannot apply"
            )
        if isinstance(spec.arg, ConstantArgument):
            values.append(spec.arg.value)
        else:
            values.append(env[node])
    out_spec = program.call_spec.out_spec
    _check_output_spec(model, out_spec)
    return pytree.tree_unflatten(values, out_spec)


def _check_output_spec(model: nn.Module, spec: pytree.TreeSpec) -> None:
    if spec.is_leaf():
        return
    if spec.type not in _OUTPUT_CONTAINERS:
        kind = spec.context if isinstance(spec.context, type) else spec.type  # a namedtuple
        raise CaptureError(
            f"{type(model).__name__}.forward returns a {kind.__name__}; the last stage "
            "can return tuples, lists, dicts, tensors and None. For transformers models pass "
            "concrete_args={'return_dict': False} to get a tuple."
        )
    for child in spec.children():
        _check_output_spec(model, child)


_REGIONS = {
    "wrap_with_set_grad_enabled": "torch.no_grad()/enable_grad()/set_grad_enabled()",
    "wrap_with_autocast": "torch.autocast()",
}


def _region_holding(graph: fx.Graph, model: nn.Module, target: str) -> str | None:
    """How a grad-mode or autocast region whose subgraph computes ``target`` reads (and whose
    forward entered it), or None."""
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(
            node.target, torch._ops.HigherOrderOperator
        ):
            continue
        for arg in node.args:
            sub = getattr(model, str(arg.target), None) if isinstance(arg, fx.Node) else None
            if not (
                isinstance(arg, fx.Node)
                and arg.op == "get_attr"
                and isinstance(sub, fx.GraphModule)
            ):
                continue
            for inner in sub.graph.nodes:
                stack = inner.meta.get("nn_module_stack") or {}
                if any(path == target for path, _ in stack.values()):
                    name = getattr(node.target, "__name__", str(node.target))
                    paths = _module_paths(node)
                    where = f"the forward of {paths[0]!r}" if paths and paths[0] else "forward"
                    return f"{_REGIONS.get(name, name)} region of {where}"
    return None


def locate(
    graph: fx.Graph, points: Sequence[str], targets: Sequence[str], model: nn.Module
) -> list[fx.Node]:
    """For every split point, the last node its module computed; check call count and order."""
    last: dict[str, fx.Node] = {}
    calls: dict[str, set[str]] = {t: set() for t in targets}
    position: dict[fx.Node, int] = {}
    for i, node in enumerate(graph.nodes):
        position[node] = i
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if path in calls:
                calls[path].add(key)
                last[path] = node
    found: list[fx.Node] = []
    for path, target in zip(points, targets, strict=True):
        if target not in last:
            region = _region_holding(graph, model, target)
            if region is not None:
                raise CaptureError(
                    f"split point {path!r} is inside a {region}, which "
                    "torch.export captures as one operation, so no stage can end inside it. "
                    "Choose a split point outside the region, or the last module it calls"
                )
            raise SplitPointError(
                f"split point {path!r} computes nothing in the exported graph (forward never "
                "calls it, or its forward has no tensor operation); choose a module forward "
                "calls and that computes something"
            )
        check_single_call(path, len(calls[target]))
        found.append(last[target])
    check_execution_order(points, [position[node] for node in found], "finishes")
    return found


# -- recomputed regions ([Note: recomputed regions]) ----------------------------------------


def recomputed_region(region: nn.Module, *args: Any) -> Any:
    """Run an outlined region under non-reentrant recomputation ([Note: recomputed regions])."""
    return torch.utils.checkpoint.checkpoint(
        region, *args, use_reentrant=False, preserve_rng_state=True
    )


def _in_module(node: fx.Node, path: str) -> bool:
    return any(p == path for p, _ in (node.meta.get("nn_module_stack") or {}).values())


def check_recomputed_called(graph: fx.Graph, paths: Sequence[str]) -> None:
    """Every recomputed module computes something in the exported graph.

    Raises:
        RecomputeError: naming the first that does not.
    """
    for path in paths:
        if not any(n.op == "call_function" and _in_module(n, path) for n in graph.nodes):
            raise RecomputeError(
                f"recomputed module {path!r} computes nothing in the exported graph (forward "
                "never calls it, or its forward has no tensor operation); drop it from "
                "recompute="
            )


def checkpoint_regions(stage: fx.GraphModule, paths: Sequence[str]) -> None:
    """Outline each recomputed module's nodes of ``stage``'s train-mode graph into a region
    called through :func:`recomputed_region` (the eval-mode graph runs without gradients).

    Raises:
        RecomputeError: a region that writes a buffer, or whose nodes another module's
            computation interleaves.
    """
    count = 0
    for path in paths:
        while _outline(stage, stage.graph, path, f"recomputed_{count}"):
            count += 1
    stage.graph.lint()
    stage.recompile()


def _outline(stage: fx.GraphModule, graph: fx.Graph, path: str, name: str) -> bool:
    """Outline the first run of ``path``'s nodes not outlined yet; False when none is left."""
    nodes = list(graph.nodes)
    inside = [
        i
        for i, n in enumerate(nodes)
        if n.op == "call_function" and n.target is not recomputed_region and _in_module(n, path)
    ]
    if not inside:
        return False
    first, last = inside[0], inside[-1]
    region: list[fx.Node] = []
    for node in nodes[first : last + 1]:
        if node.op == "get_attr":
            nodes[first].prepend(node)  # stays in the stage, read before the region
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if stack and not _in_module(node, path):
            other = [p for p, _ in stack.values()][-1]
            raise RecomputeError(
                f"recomputed module {path!r}: its computation is interleaved with "
                f"{other!r}'s in the exported graph, so it cannot be recomputed as one region; "
                "recompute the modules inside it instead"
            )
        if node.op != "call_function":
            raise RecomputeError(
                f"recomputed module {path!r}: the exported graph holds a {node.op} node "
                f"({node.name}) inside it; drop it from recompute="
            )
        region.append(node)
    for node in region:
        _refuse_writes(path, node, set(region))
    _replace_region(stage, graph, region, name, recomputed_region, ())
    return True


def _refuse_writes(path: str, node: fx.Node, members: set[fx.Node]) -> None:
    """A region may not write in place what it did not compute (a buffer, its input): its
    recomputation would write it twice, or read the written value."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return
    for argument, value in zip(schema.arguments, node.args, strict=False):
        written = argument.alias_info is not None and argument.alias_info.is_write
        if written and isinstance(value, fx.Node) and value not in members:
            what = value.target if value.op == "get_attr" else value.name
            raise RecomputeError(
                f"recomputed module {path!r} writes {what!r} in place ({node.target}), which "
                "it did not compute: recomputing it would write it twice; drop "
                f"{path!r} from recompute="
            )


def _replace_region(
    stage: fx.GraphModule,
    graph: fx.Graph,
    region: list[fx.Node],
    name: str,
    target: Callable[..., Any],
    leading: tuple[Any, ...],
) -> None:
    """Move ``region`` (consecutive nodes of ``graph``) into ``stage``'s parameterless
    submodule ``name``, called as ``target(submodule, *leading, *inputs)``."""
    members = set(region)
    inputs: list[fx.Node] = []
    for node in region:
        for used in node.all_input_nodes:
            if used not in members and used not in inputs:
                inputs.append(used)
    outputs = [n for n in region if any(u not in members for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = sub.placeholder(value.name)
    for node in region:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in outputs))
    stage.add_submodule(name, fx.GraphModule(nn.Module(), sub))
    with graph.inserting_before(region[0]):
        holder = graph.get_attr(name)
        call = graph.call_function(target, (holder, *leading, *inputs))
        results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for node, result in zip(outputs, results, strict=True):
        result.meta = {k: v for k, v in node.meta.items() if k != "nn_module_stack"}
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in members)
    for node in reversed(region):
        graph.erase_node(node)


# -- stages under autocast ([Note: stages under autocast]) ----------------------------------


def autocast_region(region: nn.Module, dtype: torch.dtype, *args: Any) -> Any:
    """Run a stage's outlined body under ``torch.autocast`` on its inputs' device."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    with torch.autocast(device, dtype=dtype):
        return region(*args)


def autocast_stage(stage: fx.GraphModule, graphs: Sequence[fx.Graph], dtype: torch.dtype) -> None:
    """Make ``stage`` run every op of ``graphs`` (its train- and eval-mode graphs) under
    ``torch.autocast(dtype)``: its body becomes one region called through
    :func:`autocast_region` ([Note: stages under autocast])."""
    for number, graph in enumerate(graphs):
        nodes = list(graph.nodes)
        body = [n for n in nodes if n.op not in ("placeholder", "output")]
        for node in body:
            if node.op == "get_attr":
                body[0].prepend(node)
        region = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        if any(n.op != "call_function" for n in region):
            raise CaptureError(
                "autocast stages need the torch.export capture (example_inputs=), whose stage "
                "graphs call functions only"
            )
        if region:
            _replace_region(stage, graph, region, f"autocast_{number}", autocast_region, (dtype,))
    stage.graph.lint()
    stage.recompile()
