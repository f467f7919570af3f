"""Stages that run one graph in train mode and another in eval mode.

[Note: stage modes]
Python reads ``self.training`` while it is traced (``F.dropout(x, p, training=self.training)``,
``if self.training:`` running statistics), and torch.export records BatchNorm and dropout as
they ran: one capture is one mode. So ``partition`` captures the model twice, in train and in
eval mode, cuts both with the same split points, and a stage whose two graphs differ becomes a
:class:`ModalGraphModule`: one module holding the parameters and buffers once, whose
``forward`` runs the train-mode graph when the stage is in train mode and the eval-mode graph
otherwise, so ``stage.train()``/``stage.eval()`` (which every engine calls in ``train_batch``
and ``eval_batch``) switch it. A stage whose two graphs compile to the same code stays a plain
``GraphModule``. Each mode's stages agree among themselves on what every boundary value is; what
both modes must share is the plan's tables: the same number of values per boundary, taken by
the same stages in the same order (and, where the capture recorded them, of the same shapes and
dtypes: the wire layout is frozen by the first training micro-batch). A model whose eval path
sends something else across a boundary is refused by name. Buffer ownership is decided on both
modes together ([Note: module state] in ``_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph_module import reduce_graph_module

__all__: list[str] = []


class ModalGraphModule(fx.GraphModule):
    """A stage that runs :attr:`graph` in train mode and :attr:`eval_graph` in eval mode.

    See [Note: stage modes]. Parameters, buffers and submodules are held once, under the
    model's names, whichever graph uses them; ``forward`` picks the graph by ``self.training``
    at every call, so ``train()``/``eval()`` switch it. Deep copies and pickles keep both.
    """

    #: The eval-mode graph (:attr:`graph` is the train-mode one).
    eval_graph: fx.Graph
    #: The generated code of :attr:`eval_graph` (:attr:`code` is the train-mode one).
    eval_code: str

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        eval_graph: fx.Graph,
        class_name: str = "GraphModule",
    ) -> None:
        super().__init__(root, graph, class_name)
        for node in eval_graph.nodes:
            if node.op in ("get_attr", "call_module"):
                _copy_missing(root, self, str(node.target))
        self.eval_graph = eval_graph
        self.recompile()

    def recompile(self) -> Any:
        """Compile both graphs; ``forward`` runs the one of the current mode."""
        code = super().recompile()
        eval_graph = self.__dict__.get("eval_graph")
        if eval_graph is None:  # inside GraphModule.__init__
            return code
        cls = type(self)
        train_forward = cls.forward
        generated = eval_graph.python_code(root_module="self")
        namespace = dict(generated.globals)
        exec(compile(generated.src, f"<{cls.__name__} eval mode>", "exec"), namespace)
        eval_forward = namespace["forward"]
        self.eval_code = generated.src

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            run = train_forward if module.training else eval_forward
            return run(module, *args, **kwargs)

        cls.forward = forward
        return code

    def _deepcopy_init(self) -> Callable[..., None]:
        def init(module: Any, root: nn.Module, graph: fx.Graph) -> None:
            ModalGraphModule.__init__(module, root, graph, root.__dict__["eval_graph"])

        return init

    def __copy__(self) -> ModalGraphModule:
        copied = ModalGraphModule(self, self.graph, self.eval_graph, type(self).__name__)
        copied.meta = getattr(self, "meta", {})
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        _, (body, import_block) = super().__reduce__()
        body = dict(body)
        eval_graph = body.pop("eval_graph")
        body.pop("eval_code", None)
        helper = fx.GraphModule(self, eval_graph)
        eval_graph.owning_module = self
        _, (eval_body, eval_imports) = helper.__reduce__()
        return (_rebuild_modal, (body, import_block, eval_body["_code"], eval_imports))


def _rebuild_modal(
    body: dict[str, Any], import_block: str, eval_code: str, eval_imports: str
) -> ModalGraphModule:
    """Unpickle a :class:`ModalGraphModule`: re-trace both codes, as fx does for one."""
    train = reduce_graph_module(dict(body), import_block)
    evaluated = reduce_graph_module({**body, "_code": eval_code}, eval_imports)
    return ModalGraphModule(
        train,
        train.graph,  # type: ignore[arg-type]
        evaluated.graph,  # type: ignore[arg-type]
        type(train).__name__,
    )


def stage_graphs(stage: nn.Module) -> list[fx.Graph]:
    """The graphs a stage runs: its graph, and its eval-mode graph when it has one."""
    if isinstance(stage, ModalGraphModule):
        return [stage.graph, stage.eval_graph]
    return [stage.graph] if isinstance(stage, fx.GraphModule) else []


def mode_graph(stage: fx.GraphModule, training: bool) -> fx.Graph:
    """The graph ``stage`` runs in train mode (``training``) or in eval mode."""
    if isinstance(stage, ModalGraphModule) and not training:
        return stage.eval_graph
    return stage.graph


def stage_code(stage: fx.GraphModule) -> str:
    """A stage's generated code; both modes' for a :class:`ModalGraphModule`."""
    if isinstance(stage, ModalGraphModule):
        return f"{stage.code}\n# eval mode\n{stage.eval_code}"
    return stage.code


def _copy_missing(root: nn.Module, module: nn.Module, target: str) -> None:
    """Install ``root``'s attribute at ``target`` in ``module`` unless it is there already."""
    *prefix, attr = target.split(".")
    source, dest = root, module
    for atom in prefix:
        found, held = getattr(source, atom), getattr(dest, atom, None)
        if held is found:
            return
        if held is None:
            held = nn.Module()
            dest.add_module(atom, held)
        source, dest = found, held
    if attr in dest.__dict__ or attr in dest._parameters or attr in dest._buffers:
        return
    if attr in dest._modules:
        return
    value = getattr(source, attr)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        dest.register_buffer(attr, value, persistent=attr not in source._non_persistent_buffers_set)
    else:
        setattr(dest, attr, value)
