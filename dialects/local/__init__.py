"""The ``local`` dialect: every stage in one process, the reference for all other dialects.

Stages run through the same stage wrappers and codec as a distributed run, so a partition can be
debugged on one machine before spending GPUs on it.
"""

from ._plugin import LocalDialect, register_dialects

__all__ = ["LocalDialect", "register_dialects"]
