"""The runtimes ("dialects") that ship with pipedialect.

Each subpackage is a plugin registered through the ``pipedialect.dialects`` entry-point group,
exactly as a third-party dialect would be; use :func:`pipedialect.get_dialect` to get one.
"""

__all__: list[str] = []
