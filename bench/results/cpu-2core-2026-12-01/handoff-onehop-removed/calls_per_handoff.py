"""Python function calls per token handoff, daemon and client side: a count that a loaded VM's
clock does not move. Run from a tree's root: PYTHONPATH=. python calls_per_handoff.py [HANDOFFS]

The real daemon runs in a thread of this process (tests/inproc.py, exclusive sharing, cpu
backend); two Clients in the main thread pass the token back and forth: A releases, B takes
the grant, A asks again, B releases, ... Every Python and C function call is counted per
thread with a profile hook (daemon thread, and the main thread where the clients run), over
HANDOFFS handoffs after a warm-up; printed as JSON."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from collections import Counter

from client_lib import Client
from tests.inproc import InprocDaemon

HANDOFFS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
WARMUP = 200
counts: Counter = Counter()
counting = False


def hook(frame, event, arg):
    if counting and event in ("call", "c_call"):
        counts[threading.current_thread().name] += 1


def main() -> None:
    global counting
    threading.setprofile(hook)  # the daemon's thread, started below
    d = InprocDaemon(tempfile.mkdtemp(prefix="na-calls-"), ["--sharing", "exclusive", "--log-level", "info",
                                                          "--quantum-ms", "training=600000"]).start()
    a, b = Client("a", endpoint=d.endpoint), Client("b", endpoint=d.endpoint)
    holder, waiter = a, b
    holder.acquire(timeout=10)
    sys.setprofile(hook)
    grants = []
    for i in range(WARMUP + HANDOFFS):
        if i == WARMUP:
            counting = True
        waiter.request()
        holder.release()
        grants.append(waiter.acquire(timeout=10))
        holder, waiter = waiter, holder
    counting = False
    sys.setprofile(None)
    threading.setprofile(None)
    assert all(g2 > g1 for g1, g2 in zip(grants, grants[1:])), "grant ids must rise"
    a.close()
    b.close()
    d.stop()
    print(json.dumps({"handoffs": HANDOFFS,
                      "daemon_calls_per_handoff": round(counts["inproc-daemon"] / HANDOFFS, 1),
                      "client_calls_per_handoff": round(counts["MainThread"] / HANDOFFS, 1),
                      "threads": dict(counts)}))


if __name__ == "__main__":
    main()
