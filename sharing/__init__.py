"""Pure scheduling logic for nodeagent: no I/O, no clock of its own.

The token scheduler's and the device lifecycle's public names are re-exported
here; the MPS partition planner lives in :mod:`sharing.partition` and the
scheduler's per-class waiting line in :mod:`sharing.fairqueue`.
"""

from sharing import lifecycle as _lifecycle
from sharing import scheduler as _scheduler
from sharing.lifecycle import *  # noqa: F401,F403 - the names are listed once, in lifecycle.__all__
from sharing.scheduler import *  # noqa: F401,F403 - the names are listed once, in scheduler.__all__

__all__ = [*_scheduler.__all__, *_lifecycle.__all__]
