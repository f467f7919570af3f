"""Loads pipedialect's conformance-suite plugin for this project's tests.

The plugin is opt-in (pipedialect declares no pytest entry point): it adds ``--dialect``, the
suite's markers and its summary to the sessions that name it, and to no other.
"""

pytest_plugins = ["pipedialect.testing.plugin"]
