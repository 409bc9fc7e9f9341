"""More time for a late yield from a holder that yields: the step before a stop (:class:`YieldGrace`).

On a loaded host a cooperative client's yield can arrive a little after the policy's grace. The
first time a verified holder overruns in an ask, the daemon warns and waits once more instead of
stopping it; past that it is stopped, and a session once stopped gets no more. Pure: time is passed in.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 8  # yields per session whose time is kept
CAP_GRACES = 10.0  # the longest extension, in graces: what a late holder may cost a waiter more


class YieldGrace:
    """Per session: when it was last asked to yield, how long its yields took, and
    whether it had its extension in this ask or was ever stopped."""

    def __init__(self) -> None:
        self._asked: dict[str, float] = {}  # session -> when the ask now open was made
        self._took: dict[str, deque[float]] = {}  # session -> seconds its last yields took
        self._extended: set[str] = set()  # sessions given their extension in the ask now open
        self._stopped: set[str] = set()  # sessions stopped once: no extension again

    def asked(self, session: str, now: float) -> None:
        self._asked.setdefault(session, now)  # a second ask of one slice keeps the first time

    def yielded(self, session: str, now: float) -> float | None:
        """``session`` gave the token back: how long after the ask (None if none was open)."""
        self._extended.discard(session)
        asked = self._asked.pop(session, None)
        if asked is None:
            return None
        took = max(0.0, now - asked)
        self._took.setdefault(session, deque(maxlen=WINDOW)).append(took)
        return took

    def extension_s(self, session: str, grace_s: float) -> float | None:
        """More time for ``session``, past its deadline in this ask: twice the slowest of its last
        ``WINDOW`` yields, within one to ``CAP_GRACES`` graces (one grace with none measured yet);
        None if it has had its extension in this ask or was stopped before (then enforce)."""
        if session in self._extended or session in self._stopped or not (grace_s > 0 and math.isfinite(grace_s)):
            return None
        self._extended.add(session)
        took = self._took.get(session)
        if not took:
            return grace_s
        return min(CAP_GRACES * grace_s, max(grace_s, 2.0 * max(took)))

    def slowest_s(self, session: str) -> float | None:
        took = self._took.get(session)
        return max(took) if took else None

    def stopped(self, session: str) -> None:
        self._stopped.add(session)
        self.ended(session)

    def ended(self, session: str) -> None:
        """The slice ended another way (revoked, preempted): no ask stays open."""
        self._asked.pop(session, None)
        self._extended.discard(session)

    def forget(self, session: str) -> None:
        self.ended(session)
        self._took.pop(session, None)
        self._stopped.discard(session)
