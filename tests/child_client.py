"""A client process that behaves as told, for tests that need a real, separate,
killable process. Prints one line per event: ``EVENT <monotonic_s> <detail>``
(CLOCK_MONOTONIC is shared by all processes, so times compare across them).

Modes:
  loop      hold slices back to back, doing real work and calling yield_point()
            after each unit, for --seconds or until --stop-file exists; prints GRANT on each
            (re-)grant and a final DONE line;
            with --park-bytes it parks cooperatively when suspended (a reclaim)
  hold      acquire once, print GRANT, then hold the token (sleeping) until killed
  stubborn  acquire once, print GRANT, then compute forever without ever yielding,
            printing TICK every ~20 ms (the daemon must stop it)
  spoof     like stubborn, but speaks the protocol by hand and claims --claim-pid
            in its hello; prints REVOKE if the daemon takes the token away
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

from client_lib import Client


def emit(event: str, detail: str = "") -> None:
    sys.stdout.write(f"{event} {time.monotonic():.6f} {detail}\n")
    sys.stdout.flush()


def work_unit(blob: bytes, rounds: int) -> None:
    for _ in range(rounds):
        hashlib.sha256(blob).digest()


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("mode", choices=["loop", "hold", "stubborn", "spoof"])
    ap.add_argument("--claim-pid", type=int, help="spoof: the pid to claim in hello")
    ap.add_argument("--memory-mb", type=int, default=0, help="device memory the session declares")
    ap.add_argument("--park-bytes", type=int, default=0,
                    help="loop: on suspend, report this many bytes parked (prints PARKED / UNPARKED)")
    ap.add_argument("--name", default="child")
    ap.add_argument("--borrower", default=None, help="the training job the session belongs to (a lent device)")
    ap.add_argument("--workload", default="training")
    ap.add_argument("--weight", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--stop-file", default=None, help="loop: end (DONE) as soon as this file exists")
    ap.add_argument("--rounds", type=int, default=8, help="sha256 rounds of 64 KiB per work unit")
    args = ap.parse_args()
    if args.mode == "spoof":
        return spoof(args)
    client = Client(args.name, workload=args.workload, weight=args.weight, memory_mb=args.memory_mb,
                    endpoint=os.environ["NODEAGENT_ENDPOINT"], borrower=args.borrower)
    emit("SESSION", client.session_id)
    blob = os.urandom(1 << 16)
    if args.park_bytes:
        def park() -> int:
            emit("PARKED")
            return args.park_bytes
        # The host memory kept for the state: the parked bytes rounded up to a page, pinned.
        held = (-(-args.park_bytes // 4096) * 4096, True)
        client.set_suspend_handlers(park, lambda: emit("UNPARKED"), held=lambda: held)
    if args.mode == "hold":
        client.acquire()
        emit("GRANT")
        while True:
            time.sleep(1)
    if args.mode == "stubborn":
        client.acquire()
        emit("GRANT")
        compute_forever(blob, lambda: None)
    units = 0
    stop_at = time.monotonic() + args.seconds
    with client.slice():
        emit("GRANT")
        while time.monotonic() < stop_at and not (args.stop_file and os.path.exists(args.stop_file)):
            work_unit(blob, args.rounds)
            units += 1
            if client.yield_point():
                emit("GRANT")
    emit("DONE", str(units))
    client.close()
    return 0


def compute_forever(blob: bytes, poll) -> None:
    n, next_tick = 0, time.monotonic()
    while True:
        work_unit(blob, 1)
        poll()
        if time.monotonic() >= next_tick:
            n += 1
            emit("TICK", str(n))
            next_tick += 0.02


def spoof(args) -> int:
    from client_lib import protocol as p
    from tests.rawpeer import RawPeer
    peer = RawPeer(os.environ["NODEAGENT_ENDPOINT"])
    peer.hello(args.name, pid=args.claim_pid)
    emit("SESSION")
    peer.send(p.Acquire(id=peer.take_id(), quiet=True))
    peer.next_notice(p.Grant, timeout=10)
    emit("GRANT")

    def poll() -> None:
        while peer.readable(0):
            if isinstance(peer.recv(), p.Revoke):
                emit("REVOKE")
    compute_forever(os.urandom(1 << 16), poll)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
