"""The pipedialect conformance suite: one command that says whether a dialect is correct.

Run it against any installed dialect with ``pipedialect check NAME`` or
``pytest --pyargs pipedialect.testing.suite --dialect NAME``, or import it into your own test
module (SQLAlchemy's dialect suite and fsspec's abstract tests work the same way)::

    from pipedialect.testing.suite import *  # noqa: F403

and run ``pytest --dialect NAME``. Each class covers one contract area:

==================================  ==============================================================
:class:`TestRegistration`           entry point, declared capabilities, components, topology
:class:`TestCodec`                  lossless round trips through the dialect's codec (Hypothesis)
:class:`TestStages`                 stage wrappers chained in one process equal the unsplit forward
:class:`TestTies`                   tie analysis; tied weights trained like the unsplit model
:class:`TestTraining`               ``pipe_engine`` + ``runtime_engine`` equal the unsplit model
:class:`TestPortableCheckpoints`    ``pipedialect.checkpoint`` to and from the local dialect
:class:`TestTracing`                ``pipedialect.trace``: every stage's spans, values unchanged
:class:`TestErrors`                 mistakes get a named :class:`~pipedialect.PipeDialectError`
==================================  ==============================================================

Tests of what the dialect does not declare (:class:`~pipedialect.Capability`) are skipped and
reported as such. Subclass a class to pin the dialect or the engine options with fixtures (see
:class:`SuiteBase`).
"""

from __future__ import annotations

from .._harness._base import SuiteBase
from .._options import EngineOptions
from .._requirements import refuses, requires, runs_dialect
from .test_codec import TestCodec
from .test_errors import TestErrors
from .test_portability import TestPortableCheckpoints, TestTracing
from .test_registration import TestRegistration
from .test_stages import TestStages
from .test_ties import TestTies
from .test_training import TestTraining

__all__ = [
    "EngineOptions",
    "SuiteBase",
    "TestCodec",
    "TestErrors",
    "TestPortableCheckpoints",
    "TestRegistration",
    "TestStages",
    "TestTies",
    "TestTracing",
    "TestTraining",
    "refuses",
    "requires",
    "runs_dialect",
]
