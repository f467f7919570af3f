"""pipedialect's conformance suite, run by this project's own CI: ``pytest --dialect sendrecv``.

Importing the suite's classes here, with the suite's plugin named in ``conftest.py``, is all it
takes (as SQLAlchemy's dialect suite works); pytest then runs them against every ``--dialect``
given, and without one it runs none of them.
"""

from pipedialect.testing.suite import *  # noqa: F403
