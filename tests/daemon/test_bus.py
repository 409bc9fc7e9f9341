"""The daemon's event bus and device facts (nodeagent/daemon/bus.py) on their own.

What publishers and subscribers rely on: delivery by the event's own type, in the order of
subscription, inside ``publish`` (an event published by a subscriber is heard before the next
subscriber of the first), and a subscriber that raises costs only its own delivery. Then the
device facts a failed backend query leaves as they were."""

from __future__ import annotations

import logging

import pytest

from nodeagent.daemon.bus import Bus, DeviceFacts, DeviceLost, Granted, MayAsk, Published, SliceEnded
from nodeagent.devices import CpuBackend, DeviceError


def test_subscribers_hear_their_events_type_only_in_the_order_they_subscribed():
    bus, heard = Bus(), []
    bus.subscribe(MayAsk, lambda e: heard.append(("first", e.session)))
    bus.subscribe(DeviceLost, lambda e: heard.append(("lost", e.device)))
    bus.subscribe(MayAsk, lambda e: heard.append(("second", e.session)))
    bus.publish(MayAsk("s-1", 1.0))
    bus.publish(DeviceLost(3, "gone", 2.0))
    bus.publish(Granted(None, 7, 0.5))  # no subscriber: nothing happens
    assert heard == [("first", "s-1"), ("second", "s-1"), ("lost", 3)]


def test_an_event_is_delivered_by_its_own_type_not_a_base_class():
    class Special(Published):
        __slots__ = ()

    bus, heard = Bus(), []
    bus.subscribe(Published, heard.append)
    bus.publish(Special("grant", 0, "s-1"))
    assert heard == []


def test_a_subscriber_that_raises_costs_only_its_own_delivery(caplog):
    bus, heard = Bus(), []
    calls = []

    def broken(event):
        calls.append(event)
        raise RuntimeError("a bug in one component")

    bus.subscribe(SliceEnded, lambda e: heard.append(("before", e.held_s)))
    bus.subscribe(SliceEnded, broken)
    bus.subscribe(SliceEnded, lambda e: heard.append(("after", e.held_s)))
    with caplog.at_level(logging.ERROR, logger="nodeagent.daemon.bus"):
        bus.publish(SliceEnded(None, 1.5))  # the publisher does not see the error
        bus.publish(SliceEnded(None, 2.5))  # and the broken one still hears the next event
    assert heard == [("before", 1.5), ("after", 1.5), ("before", 2.5), ("after", 2.5)]
    assert len(calls) == 2
    failures = [r for r in caplog.records if "[bus] a subscriber of SliceEnded failed" in r.getMessage()]
    assert len(failures) == 2


def test_an_interrupt_in_a_subscriber_is_not_swallowed():
    bus = Bus()

    def interrupted(event):
        raise KeyboardInterrupt

    bus.subscribe(MayAsk, interrupted)
    with pytest.raises(KeyboardInterrupt):
        bus.publish(MayAsk("s-1", 0.0))


def test_delivery_is_in_turn_an_event_a_subscriber_publishes_is_heard_before_the_next_subscriber():
    bus, heard = Bus(), []

    def finish(event: MayAsk) -> None:
        heard.append(("finish", event.session))
        bus.publish(DeviceLost(0, "then this", event.now))
        heard.append(("finish returns", event.session))

    bus.subscribe(MayAsk, finish)
    bus.subscribe(MayAsk, lambda e: heard.append(("later", e.session)))
    bus.subscribe(DeviceLost, lambda e: heard.append(("nested", e.notice)))
    bus.publish(MayAsk("s-1", 5.0))
    heard.append(("publish returned", None))
    assert heard == [("finish", "s-1"), ("nested", "then this"), ("finish returns", "s-1"), ("later", "s-1"),
                     ("publish returned", None)]


def test_event_is_shorthand_for_a_published_event():
    bus, heard = Bus(), []
    bus.subscribe(Published, heard.append)
    bus.event("health", journal="failed", error="disk full")
    bus.event("preempt", 2, "s-9", by="s-1")
    assert heard == [Published("health", None, None, {"journal": "failed", "error": "disk full"}),
                     Published("preempt", 2, "s-9", {"by": "s-1"})]


# ------------------------------------------------------------------ device facts


class FlakyBackend:
    """A cpu backend whose device query fails while ``failing``."""

    name = "flaky"

    def __init__(self, count: int) -> None:
        self._real = CpuBackend(count)
        self.count = count
        self.failing = False

    def devices(self):
        if self.failing:
            raise DeviceError("NVML: GPU is lost")
        return self._real.devices()[:self.count]


def test_device_facts_keep_the_last_answer_when_the_backend_fails(caplog):
    backend = FlakyBackend(3)
    facts = DeviceFacts(backend, lost=None)
    assert (facts.name, facts.count) == ("flaky", 3)
    first = facts.info()
    backend.failing = True
    with caplog.at_level(logging.WARNING, logger="nodeagent.daemon.bus"):
        assert facts.refresh() is first
    assert facts.count == 3
    assert any("live query failed, using the last values" in r.getMessage() for r in caplog.records)
    backend.failing, backend.count = False, 2  # answers again, with what it sees now
    assert len(facts.refresh()) == 2 and facts.count == 2
