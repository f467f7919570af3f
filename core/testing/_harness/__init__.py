"""The conformance suite's machinery, kept apart from its test files in ``testing/suite``.

Cases and models (``_cases``, ``_models``, ``_data``), the single-process reference
(``_reference``), how a dialect is driven in one process or several (``_runner``, ``_driver``),
and the checks and messages that name a broken contract (``_checks``, ``_compare``, ``_rules``).
Private: third parties import the suite, not this.
"""
