"""How :func:`pipedialect.partition` turns a model into stage graphs with torch.fx: one module a
concept, each private to ``plan``.

- ``_capture``: trace a whole model into one flat graph (:func:`_capture.capture`);
- ``_tracer``: the tracer, which keeps split points as single calls and probes their outputs;
- ``_guards``: the structure a split point's output was traced with, checked on every
  micro-batch ([Note: split-point outputs]);
- ``_regions``: grad-mode and autocast regions as nodes, each inside one stage ([Note: grad-mode
  regions]);
- ``_functions``: custom autograd Functions applied as one call ([Note: custom autograd
  Functions]);
- ``_split``: the cut into one GraphModule per stage under the model's names ([Note: own
  splitter]);
- ``_modal``: stages with a train-mode and an eval-mode graph ([Note: stage modes]);
- ``_recompute``: modules recomputed in backward ([Note: recomputed calls]).

The torch.export capture (``plan._export``) shares the cut ([Note: own splitter]).
"""

from __future__ import annotations

__all__: list[str] = []
