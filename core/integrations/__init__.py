"""Training loops people already use, running through a pipeline dialect.

- :mod:`pipedialect.integrations.transformers`: Hugging Face's ``Trainer``
  (:class:`~pipedialect.integrations.transformers.PipelineTrainer`).

Nothing here is imported by ``import pipedialect``: each integration imports its framework,
and is imported only by the programs that use it.
"""

from __future__ import annotations

__all__: list[str] = []
