"""Modules recomputed in backward, as calls of the stage graph.

[Note: recomputed calls]
``partition(..., recompute=["blocks.*"])`` keeps each matched module as one ``call_module``
node during capture (like a split point), and after the cut rewrites that node in its stage
graph into ``call_function(recomputed, (get_attr module, *args), kwargs)``: the module is
still an attribute of the stage under its own path, so parameter names, ties and the stage's
``named_parameters`` do not change, and the call runs through non-reentrant
``torch.utils.checkpoint`` with the RNG state preserved (dropout draws the same mask when
recomputed) and the module's state replayed: the recomputation starts from the buffers and
attributes the forward started from and leaves them as the forward left them (BatchNorm counts
each batch once; ``module_state`` [Note: recomputation and module state]). Being part of the stage
graph, it behaves alike on every dialect; the generated code names the helper and the module,
so fingerprints stay deterministic.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from ...runtime.module_state import recompute_with_state
from ._modal import stage_graphs

__all__: list[str] = []


def recomputed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` under non-reentrant activation recomputation ([Note: recomputed calls]);
    its recomputation sees and leaves the module's buffers and attributes as the first run did
    (``module_state`` [Note: recomputation and module state])."""
    return recompute_with_state(module, (module,), *args, **kwargs)


def checkpoint_calls(stage: fx.GraphModule, paths: frozenset[str]) -> None:
    """Route ``stage``'s calls of the modules at ``paths`` through :func:`recomputed`."""
    changed = False
    for graph in stage_graphs(stage):
        for node in list(graph.nodes):
            if node.op != "call_module" or str(node.target) not in paths:
                continue
            with graph.inserting_before(node):
                module = graph.get_attr(str(node.target))
                call = graph.call_function(recomputed, (module, *node.args), dict(node.kwargs))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            changed = True
        graph.lint()
    if changed:
        stage.recompile()
