"""Which values each pipeline stage receives, and so which values each boundary carries.

Values are named as in the plan's top-level graph (see :mod:`pipedialect.runtime.stage`): a model
input by its forward parameter name, stage ``k``'s output as ``submod_k`` (or ``submod_k.i`` when
the stage returns several values).

[Note: liveness]
``liveness[k]`` is what stage ``k`` receives. Stage 0 receives the model's inputs, in
forward-signature order (the order the data loader supplies them in). A later stage ``k``
receives its own arguments in call order, then every value a later stage needs that was defined
before stage ``k``, in the order the next stage receives them: a skip connection rides through
every stage in between. What stage ``k`` sends is exactly ``liveness[k + 1]``; each of those
values is either produced by stage ``k`` or received by it.

The stage that defines a value is given explicitly (``defined_by``), never guessed from a name
prefix: Slapo strips names starting with ``"submod_1"`` when it reaches stage 1, which would also
match ``"submod_10"``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from ..errors import PartitionError

__all__ = ["compute_liveness"]

logger = logging.getLogger(__name__)

#: The stage id ``defined_by`` gives a model input.
INPUT_STAGE = -1


def compute_liveness(
    input_names: Sequence[str],
    stage_arg_names: Sequence[Sequence[str]],
    defined_by: Mapping[str, int],
) -> tuple[tuple[str, ...], ...]:
    """Return, for every stage, the names of the values it receives (see [Note: liveness]).

    Args:
        input_names: the model's inputs in data-loader (forward-signature) order.
        stage_arg_names: for every stage, its arguments in call order.
        defined_by: for every value name, the stage that produces it (``-1`` for a model input).

    Raises:
        PartitionError: a stage uses a value that is unknown, or defined by itself or a later stage.
    """
    inputs = tuple(input_names)
    num_stages = len(stage_arg_names)
    if num_stages == 0:
        raise PartitionError("a pipeline needs at least one stage")
    for name in inputs:
        if defined_by.get(name, INPUT_STAGE) != INPUT_STAGE:
            raise PartitionError(
                f"model input {name!r} has the same name as a value stage {defined_by[name]} "
                "produces; rename the forward parameter"
            )
    own: list[tuple[str, ...]] = []
    for k, args in enumerate(stage_arg_names):
        for name in args:
            if name not in defined_by and name not in inputs:
                raise PartitionError(f"[Stage {k}] uses {name!r}, which no stage or input defines")
            where = defined_by.get(name, INPUT_STAGE)
            if where >= k:
                raise PartitionError(
                    f"[Stage {k}] uses {name!r}, which stage {where} defines; a stage can only "
                    "use values of earlier stages"
                )
            if where == INPUT_STAGE and name not in inputs:
                raise PartitionError(f"[Stage {k}] uses input {name!r}, not among {list(inputs)}")
        own.append(tuple(dict.fromkeys(args)))

    receives: list[tuple[str, ...]] = [()] * num_stages
    receives[0] = inputs
    for k in range(num_stages - 1, 0, -1):
        later = receives[k + 1] if k + 1 < num_stages else ()
        mine = set(own[k])
        bypass = tuple(n for n in later if n not in mine and defined_by.get(n, INPUT_STAGE) < k)
        receives[k] = own[k] + bypass
    logger.debug("liveness: %s", receives)
    return tuple(receives)
