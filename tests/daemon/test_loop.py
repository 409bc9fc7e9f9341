"""EventLoopPoller: plain descriptors and ZeroMQ sockets in one epoll set."""

from __future__ import annotations

import os
import time

import zmq

from nodeagent.daemon.loop import POLLIN, POLLOUT, EventLoopPoller


def test_plain_descriptors_report_readable_writable_and_hang_ups():
    poller = EventLoopPoller()
    r, w = os.pipe()
    try:
        poller.register(r, POLLIN, on_ready=lambda *_: None, where="test")
        assert poller.poll(0) == []
        os.write(w, b"x")
        assert poller.poll(1000) == [(r, POLLIN)]
        os.read(r, 1)
        poller.register(w, POLLOUT, on_ready=lambda *_: None, where="test")
        assert (w, POLLOUT) in poller.poll(0)
        poller.unregister(w)
        poller.unregister(w)  # twice (an owner closing what a step before it dropped): let be
        os.close(w)
        w = -1
        ((fd, events),) = poller.poll(1000)  # the writer went: reported as readable, so the owner reads the EOF
        assert fd == r and events & POLLIN
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        poller.close()


def test_a_zmq_message_that_arrived_while_the_loop_was_busy_is_not_missed():
    """A ZeroMQ socket's FD signals edges: a message that arrived while the loop
    handled something else, after the edge was consumed, must still be reported."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://loop-test")
    b.connect("inproc://loop-test")
    poller = EventLoopPoller()
    try:
        poller.register(b, POLLIN, on_ready=lambda *_: None, where="test")
        a.send(b"one")
        assert poller.poll(1000) == [(b, POLLIN)]
        a.send(b"two")  # arrives before the first is read: no new edge on b's FD
        time.sleep(0.01)
        assert b.recv() == b"one"
        assert poller.poll(1000) == [(b, POLLIN)]  # read from EVENTS, not from the (spent) edge
        assert b.recv() == b"two"
        assert poller.poll(50) == []
        assert b in poller
        poller.unregister(b)
        assert b not in poller
    finally:
        poller.close()
        a.close(0)
        b.close(0)
        ctx.term()
