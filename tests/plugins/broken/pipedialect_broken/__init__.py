"""A plugin whose import fails, as one with a missing native dependency would."""

raise ImportError("pipedialect_broken needs libfancycomm.so, which is not installed")
