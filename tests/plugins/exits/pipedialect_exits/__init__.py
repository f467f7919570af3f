"""A plugin whose import raises ``SystemExit``, as a script-like module calling sys.exit would."""

import sys

sys.exit(3)
