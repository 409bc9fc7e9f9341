"""Pure scheduling logic for nodeagent: no I/O, no clock of its own.

The token scheduler's public names are re-exported here; the MPS partition
planner lives in :mod:`sharing.partition`.
"""

from sharing.scheduler import *  # noqa: F401,F403 - the names are listed once, in scheduler.__all__
from sharing.scheduler import __all__  # noqa: F401
