"""The waiting line of one workload class, in fair order, at O(log n) a step (:class:`FairQueue`).

Order: least virtual time, then earliest ``waiting_since``, then id (ids are unique). A heap
whose members leaving from the middle are dropped lazily; how, and what a listing costs:
docs/internals.md. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from itertools import count
from typing import Generic, TypeVar

__all__ = ["DEFAULT_SLACK", "FairQueue"]

T = TypeVar("T")

DEFAULT_SLACK = 64  # stale entries tolerated beyond the live ones; read when a line is made

# (vtime_s, waiting_since, id, seq, item). seq is unique, so two entries never tie
# and the item is never compared: it breaks the tie between a member's live entry
# and a stale one left from an earlier stay with the same key.
_Entry = tuple[float, float, str, int, T]


class FairQueue(Generic[T]):
    """Members keyed by (virtual time, waiting since, id), a key fixed while they wait (the
    scheduler charges only the holder): that is what lets a heap hold them. ``slack`` (default
    :data:`DEFAULT_SLACK`) bounds the stale entries kept beyond the live ones."""

    __slots__ = ("_members", "_heap", "_stale", "_seq", "_slack", "_listed", "_added", "_listing")

    def __init__(self, slack: int | None = None) -> None:
        if slack is None:
            slack = DEFAULT_SLACK
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ValueError(f"slack must be an int >= 0, got {slack!r}")
        self._members: dict[str, _Entry] = {}  # id -> its live entry
        self._heap: list[_Entry] = []  # live entries and stale ones not yet dropped
        self._stale = 0  # entries in _heap that are not live
        self._seq = count()
        self._slack = slack
        self._listed: list[_Entry] | None = None  # sorted, as of the last listing (may hold stale entries)
        self._added: list[_Entry] = []  # pushed since the last listing
        self._listing: tuple[str, ...] | None = ()  # the last listing, while nothing changed since

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._members

    @property
    def entries(self) -> int:
        """Entries stored, live and stale: stays within 2 x members + slack."""
        return len(self._heap)

    def push(self, vtime_s: float, waiting_since: float, member_id: str, item: T) -> None:
        """Add a member; ``member_id`` must not be in the line already."""
        if member_id in self._members:
            raise KeyError(f"{member_id!r} is already in line")
        entry = (vtime_s, waiting_since, member_id, next(self._seq), item)
        self._members[member_id] = entry
        heapq.heappush(self._heap, entry)
        self._listing = None
        if self._listed is not None:
            self._added.append(entry)
            if len(self._added) > len(self._listed) + self._slack:
                self._listed, self._added = None, []  # cheaper to sort afresh than to keep

    def discard(self, member_id: str) -> T:
        """Take a member out of the line wherever it stands; returns its item."""
        entry = self._members.pop(member_id)
        self._stale += 1
        self._listing = None
        self._compact_if_due()
        return entry[4]

    def min_vtime(self) -> float:
        """The least virtual time in line (the first's), ``math.inf`` if empty."""
        top = self._top()
        return math.inf if top is None else top[0]

    def pop_first(self) -> T:
        """Take the first member out of the line; IndexError if it is empty."""
        top = self._top()
        if top is None:
            raise IndexError("pop_first from an empty line")
        heapq.heappop(self._heap)
        del self._members[top[2]]
        self._listing = None
        self._compact_if_due()
        return top[4]

    def ordered_ids(self) -> tuple[str, ...]:
        """Every member's id, first in line first."""
        if self._listing is not None:
            return self._listing
        members = self._members
        if self._listed is None:
            live = list(members.values())
        else:  # the last listing is sorted: timsort merges it with the newcomers in O(n + k log k)
            live = [e for e in self._listed if members.get(e[2]) is e]
            live.extend(e for e in self._added if members.get(e[2]) is e)
        live.sort()
        self._listed, self._added = live, []
        self._listing = tuple(e[2] for e in live)
        return self._listing

    def _compact_if_due(self) -> None:
        """Drop every stale entry once they outnumber the live ones by more than the slack.

        O(live), paid for by the departures that left those entries behind."""
        if self._stale > len(self._members) + self._slack:
            self._heap = list(self._members.values())
            heapq.heapify(self._heap)
            self._stale = 0
            self._listed, self._added = None, []  # it too holds many who left

    def _top(self) -> _Entry | None:
        """The first live entry, after dropping the stale ones above it."""
        heap, members = self._heap, self._members
        while heap:
            top = heap[0]
            if members.get(top[2]) is top:
                return top
            heapq.heappop(heap)
            self._stale -= 1
        return None
