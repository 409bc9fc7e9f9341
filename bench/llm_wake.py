"""LLM wake: the first token from a server that slept through a lend, against a cold start.

The server is examples/llm_server.py (a decoder-only transformer written in
torch, static KV cache, its decode step in a CUDA graph on cuda), with
weights of --weights-mb MiB written to a file first. A daemon of its own with
the cluster endpoint on (CURVE keys made for the run, protect_s 0) holds the
server's session; a `PlacementClient` drives it as a placement layer would:

  sleep   lend(node, 0, borrower, suspend=[server]): the device is lent and
          the server parks its weights and KV cache in pinned host memory,
          their device memory unmapped, their addresses kept
  wake    reclaim(node, 0, resume=[server]): the device back, the server told
          to resume in the same call; it maps memory at the same addresses,
          copies back, verifies, and serves a request that waited in its
          socket while it slept

Per cycle (--cycles, medians reported):

  wake_ttft_ms   from the reclaim call to the first token of that request, on
                 the requester's side (max_new_tokens 1: prefill and argmax)
  wake_ms        the server's unpark (the Yielder's, measured by the client
                 library: remap, copy back, verify)
  park_ms        the server's park when the lend put it to sleep
  outputs_identical  a --new-tokens greedy generation after every wake equals
                 the one before the first sleep, token for token
  addresses_kept every weight and the KV cache at the addresses they had
                 (what lets the captured decode graph replay)

Baselines, same run:

  cold_ttft_ms   a new process of the same server, timed from its spawn to the
                 first token of the same request: import torch, start CUDA,
                 build the model, load the weights from the file (just written:
                 from the page cache, so a lower bound), warm up and capture
                 the graph (median of --cold-repeats). It runs without a
                 session (--no-daemon): no Yielder, so nothing of ours is in it
  warm_ttft_ms   the same request to the server awake (median of 5)

  speedup        cold_ttft_ms / wake_ttft_ms

The daemon runs on the server's backend (cuda on a GPU: it sees the device
freed). --mps on puts the server on an MPS server of the daemon's ([mps]
devices = [0]), off keeps it outside MPS; on cuda the JSON's ``mps`` holds the
evidence either way (bench.mps_evidence: the MPS server's client list, NVML's,
what the server's driver read) and a server that did not run as asked exits 1.

Goals (issue 23, on a GPU): speedup >= 20 and wake_ms < 100 for 1 GiB of
weights. On cpu every field is reported, but the goals are not: the "device"
is host memory, nothing is unmapped, a park is a copy within RAM, and the
model is small (--weights-mb 16 by default), so the ratios say little.

Always starts its own daemon (it needs the cluster endpoint and its keys).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import queue as queue_mod
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench import common
from bench.reclaim import NODE, _Node  # a private daemon with the cluster endpoint, and a PlacementClient

BORROWER = "bench-llm-job"
SERVER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "llm_server.py")
_START_TIMEOUT_S = 180.0  # import torch, 1 GiB from a file, CUDA, graphs: seconds; a loaded 2-core machine: more
_REQUEST_TIMEOUT_S = 120.0
_WARM_REQUESTS = 5


class ServerProc:
    """One examples/llm_server.py process, its ready line read."""

    def __init__(self, args: list[str], workdir: str, name: str, env: dict[str, str]) -> None:
        self.socket = os.path.join(workdir, f"{name}.sock")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self._lines: queue_mod.Queue = queue_mod.Queue()
        with open(self.log_path, "ab") as err:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen([sys.executable, SERVER, "--socket", self.socket, *args], env=env,
                                         stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._wait_ready()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self) -> dict:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue_mod.Empty:
                line = None
            if line is None:
                self.stop()
                raise RuntimeError(f"the server did not start: {self.log_tail()}")
            if line.startswith("ready "):
                return json.loads(line[len("ready "):])

    def ask(self, request: dict) -> dict:
        reply = ask(self.socket, request)
        if not reply.get("ok"):
            raise RuntimeError(f"the server refused {request.get('op')}: {reply.get('error')}")
        return reply

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                ask(self.socket, {"op": "quit"}, timeout=10.0)
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                common.stop_process(self.proc)


def ask(path: str, request: dict, timeout: float = _REQUEST_TIMEOUT_S) -> dict:
    """One JSON line to the server at ``path``, one back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"{path} closed the connection without answering")
            data += chunk
    return json.loads(data)


def _timed_first_token(server: ServerProc, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    reply = server.ask({"op": "generate", "prompt": prompt, "max_new_tokens": 1})
    return (time.perf_counter() - t0) * 1000.0, reply


def _cold_start(args_common: list[str], workdir: str, index: int, prompt: list[int], env: dict) -> dict:
    """A new server process without a session, spawn to first token."""
    server = ServerProc([*args_common, "--no-daemon"], workdir, f"cold{index}", env)
    try:
        reply = server.ask({"op": "generate", "prompt": prompt, "max_new_tokens": 1})
        ttft_ms = (time.perf_counter() - server.started) * 1000.0
    finally:
        server.stop()
    common.log(f"[llm_wake] cold start {index + 1}: first token {ttft_ms:.0f} ms after the spawn "
               f"(phases {server.ready['phases_ms']})")
    return {"ttft_ms": ttft_ms, "phases_ms": server.ready["phases_ms"], "server_ttft_ms": reply["ttft_ms"],
            "graphs": server.ready["graphs"]}


def _cycle(node: _Node, server: ServerProc, session: str, prompt: list[int], reference: list[int],
           new_tokens: int, deadline_ms: float) -> dict:
    """Sleep through a lend, wake with a reclaim while a request waits; time the first token."""
    t0 = time.perf_counter()
    node.placement.lend(NODE, 0, BORROWER, suspend=[session], deadline_ms=deadline_ms)
    sleep_call_ms = (time.perf_counter() - t0) * 1000.0
    state = node.session_state(session)
    box: dict = {}

    def waiting_request() -> None:
        try:
            box["reply"] = server.ask({"op": "generate", "prompt": prompt, "max_new_tokens": 1})
            box["at"] = time.perf_counter()
        except BaseException as exc:  # reported below
            box["error"] = exc
    requester = threading.Thread(target=waiting_request, daemon=True)
    requester.start()
    time.sleep(0.2)  # it is in the server's socket, waiting
    if box:
        raise RuntimeError(f"the server answered while asleep: {box}")
    t0 = time.perf_counter()
    node.placement.reclaim(NODE, 0, deadline_ms=deadline_ms, resume=[session])
    wake_call_ms = (time.perf_counter() - t0) * 1000.0
    requester.join(_REQUEST_TIMEOUT_S)
    if "at" not in box:
        raise RuntimeError(f"the waiting request was not served after the wake: {box.get('error', 'no reply')}")
    after = server.ask({"op": "generate", "prompt": prompt, "max_new_tokens": new_tokens})["tokens"]
    return {"sleep_call_ms": sleep_call_ms, "wake_call_ms": wake_call_ms,
            "wake_ttft_ms": (box["at"] - t0) * 1000.0, "server_ttft_ms": box["reply"]["ttft_ms"],
            "asleep": state is not None and state[1] is not None, "identical": after == reference}


def _median(values: list[float]) -> float | None:
    return common.rounded(statistics.median(values)) if values else None


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("llm_wake", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip(),
                       endpoint_help="ignored: this benchmark always starts its own daemon (it needs the\n"
                       "                      cluster endpoint and keys made for the run)")
    ap.add_argument("--device", default=None, help="cuda when available, else cpu (default)")
    ap.add_argument("--weights-mb", type=common.positive_float, default=None,
                    help="model weights in MiB (default: 1024 on cuda, bf16; 16 on cpu, fp32)")
    ap.add_argument("--max-seq", type=common.positive_int, default=None,
                    help="KV cache length in tokens (default: 1024 on cuda, 256 on cpu)")
    ap.add_argument("--prompt-tokens", type=common.positive_int, default=16, help="prompt length (default: 16)")
    ap.add_argument("--new-tokens", type=common.positive_int, default=32,
                    help="tokens generated to compare before and after each wake (default: 32)")
    ap.add_argument("--cycles", type=common.positive_int, default=3, help="sleep/wake cycles (default: 3)")
    ap.add_argument("--cold-repeats", type=common.positive_int, default=2,
                    help="cold starts; cold_ttft_ms is their median (default: 2)")
    ap.add_argument("--deadline-ms", type=common.positive_float, default=10_000.0,
                    help="suspend and reclaim deadline (default: 10000)")
    ap.add_argument("--mps", choices=("on", "off"), default="off",
                    help="on cuda: the daemon puts the server on an MPS server of its own ([mps] devices = [0]) "
                         "or not ([mps] devices = []); the JSON's mps holds the evidence (default: off)")
    ap.add_argument("--threads", type=common.positive_int, default=None,
                    help="torch intra-op threads in the servers on cpu (default: all cores but one)")
    args = ap.parse_args(argv)

    wall0 = time.monotonic()
    if args.device is not None and not args.device.startswith("cuda"):
        torch = None  # a cpu run named as such: only the servers need torch (its import is seconds of CPU)
    else:
        import torch  # only to pick the device and name it; the servers do the work

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.startswith("cuda")
    weights_mb = args.weights_mb or (1024.0 if on_cuda else 16.0)
    max_seq = args.max_seq or (1024 if on_cuda else 256)
    if args.prompt_tokens + args.new_tokens > max_seq:
        ap.error(f"--prompt-tokens + --new-tokens must fit --max-seq ({max_seq})")
    threads = args.threads or (None if on_cuda else max(1, (os.cpu_count() or 2) - 1))
    workdir = tempfile.mkdtemp(prefix="nodeagent-bench-llm-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH"))
        if p)}
    node = server = None
    try:
        weights = os.path.join(workdir, "weights.pt")
        t0 = time.perf_counter()
        written = json.loads(subprocess.run(
            [sys.executable, SERVER, "--write-weights", weights, "--weights-mb", str(weights_mb),
             "--max-seq", str(max_seq), "--device", device], env=env, check=True, capture_output=True, text=True,
            timeout=_START_TIMEOUT_S).stdout.strip().splitlines()[-1])
        common.log(f"[llm_wake] weights: {written['weight_bytes'] / 2**20:.0f} MiB ({written['config']}) written in "
                   f"{time.perf_counter() - t0:.1f} s")
        server_args = ["--weights", weights, "--device", device, *(["--threads", str(threads)] if threads else [])]
        vocab = written["config"]["vocab"]
        prompt = [(7919 * i + 13) % vocab for i in range(args.prompt_tokens)]

        colds = [_cold_start(server_args, workdir, i, prompt, env) for i in range(args.cold_repeats)]

        # The daemon on the backend the server runs on: on cuda it sees the device freed (NVML), and
        # under --mps on the server is an MPS client, where its address-keeping regions must hold too.
        mps_config = "[mps]\ndevices = [0]\n" if args.mps == "on" and on_cuda else "[mps]\ndevices = []\n"
        node = _Node(workdir, backend=common.daemon_backend(device), config_extra=mps_config)
        server = ServerProc(server_args, workdir, "warm", {**env, "NODEAGENT_ENDPOINT": node.endpoint})
        ready = server.ready
        session = ready["session"]
        mps = _mps_evidence(ready, args.mps == "on" and on_cuda) if on_cuda else None
        common.log(f"[llm_wake] server up in {ready['phases_ms']['start_ms']:.0f} ms: graphs {ready['graphs']}, "
                   f"keeps addresses {ready['keeps_addresses']} ({ready['address_note'] or 'CUDA VMM'})")
        reference = server.ask({"op": "generate", "prompt": prompt, "max_new_tokens": args.new_tokens})["tokens"]
        warm = [_timed_first_token(server, prompt)[0] for _ in range(_WARM_REQUESTS)]
        cycles = []
        for i in range(args.cycles):
            cycles.append(_cycle(node, server, session, prompt, reference, args.new_tokens, args.deadline_ms))
            common.log(f"[llm_wake] cycle {i + 1}: first token {cycles[-1]['wake_ttft_ms']:.1f} ms after the "
                       f"reclaim call (warm: {statistics.median(warm):.1f} ms); outputs identical: "
                       f"{cycles[-1]['identical']}")
        stats = server.ask({"op": "stats"})
    except BaseException:
        if server is not None:
            common.log(f"[llm_wake] server log:\n{server.log_tail()}")
        raise
    finally:
        if server is not None:
            server.stop()
        if node is not None:
            node.close()
            common.relay_log(node.log_path, keep=lambda line: "[suspend]" in line or "[cluster]" in line, last=8)
        shutil.rmtree(workdir, ignore_errors=True)

    wakes = stats["wakes"]
    cold_ttft = statistics.median(c["ttft_ms"] for c in colds)
    wake_ttft = statistics.median(c["wake_ttft_ms"] for c in cycles)
    wake_ms = statistics.median(w["unpark_ms"] for w in wakes)
    speedup = cold_ttft / wake_ttft
    weight_gib = stats["weight_bytes"] / 2**30
    goals = {
        "first_token_speedup": {"value": common.rounded(speedup, 1), "goal": ">= 20", "met": speedup >= 20},
        "wake_ms": {"value": common.rounded(wake_ms), "goal": "< 100 for 1 GiB of weights",
                    "met": wake_ms < 100 and weight_gib >= 0.95},
    }
    result = {
        "benchmark": "llm_wake",
        "backend": "cuda" if on_cuda else "cpu",
        "device": torch.cuda.get_device_name(torch.device(device)) if on_cuda else "cpu",
        "endpoint_kind": common.OWN,
        "torch": torch.__version__ if torch is not None else importlib.metadata.version("torch"),
        "config": stats["config"],
        "weight_bytes": stats["weight_bytes"],
        "kv_cache_bytes": stats["kv_cache_bytes"],
        "graphs": stats["graphs"],
        "captures": stats["captures"],
        "keeps_addresses": stats["keeps_addresses"],
        "address_note": stats["address_note"],
        "host_buffer_bytes": stats["host_buffer_bytes"],
        "host_buffer_pinned": stats["host_buffer_pinned"],
        "threads": threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "cycles": args.cycles,
        "cold_repeats": args.cold_repeats,
        "samples": args.cycles,
        "cold_ttft_ms": common.rounded(cold_ttft),
        "cold_samples_ms": [common.rounded(c["ttft_ms"]) for c in colds],
        "cold_phases_ms": colds[0]["phases_ms"],
        "warm_ttft_ms": _median(warm),
        "warm_samples_ms": [common.rounded(v) for v in warm],
        "wake_ttft_ms": common.rounded(wake_ttft),
        "wake_ttft_samples_ms": [common.rounded(c["wake_ttft_ms"]) for c in cycles],
        "wake_server_ttft_ms": _median([c["server_ttft_ms"] for c in cycles]),
        "wake_ms": common.rounded(wake_ms),
        "wake_samples_ms": [w["unpark_ms"] for w in wakes],
        "park_ms": _median([w["park_ms"] for w in wakes]),
        "verify_ms": _median([w["verify_ms"] for w in wakes]),
        "checksum_ms": _median([w["checksum_ms"] for w in wakes]),
        "bytes_parked": wakes[-1]["bytes_parked"],
        "bytes_copied": wakes[-1]["bytes_copied"],
        "sleep_call_ms": _median([c["sleep_call_ms"] for c in cycles]),
        "wake_call_ms": _median([c["wake_call_ms"] for c in cycles]),
        "speedup": common.rounded(speedup, 2),
        "asleep_while_lent": all(c["asleep"] for c in cycles),
        "outputs_identical": all(c["identical"] for c in cycles),
        "addresses_kept": all(w["addresses_kept"] for w in wakes),
        "server_start_phases_ms": ready["phases_ms"],
        "daemon_backend": common.daemon_backend(device),
        "mps_asked": args.mps,
        "mps": mps,
        "goals": goals,
        "goals_apply": on_cuda,
        "all_goals_met": on_cuda and all(g["met"] for g in goals.values()),
        "note": (None if on_cuda else "cpu: every field is measured, but the goals are for a GPU: the device is "
                 "host memory, a park is a copy within RAM with nothing unmapped, and the model is small"),
    }
    common.log(f"[llm_wake] {result['weight_bytes'] / 2**20:.0f} MiB of weights + "
               f"{result['kv_cache_bytes'] / 2**20:.0f} MiB of KV cache on {result['device']}: first token "
               f"{wake_ttft:.1f} ms after the wake against {cold_ttft:.0f} ms from a cold start ({speedup:.1f}x; "
               f"warm {result['warm_ttft_ms']} ms); the wake itself {wake_ms:.1f} ms; outputs identical "
               f"{result['outputs_identical']}, addresses kept {result['addresses_kept']}"
               + (f"; goals {'met' if result['all_goals_met'] else 'MISSED'}" if on_cuda else
                  " (cpu: the goals are for a GPU)") + f"; took {time.monotonic() - wall0:.1f} s")
    common.emit(result, args.json)
    return 1 if mps is not None and mps["problems"] else 0


def _mps_evidence(ready: dict, expected: bool) -> dict:
    """Whether the server ran under MPS as asked (``bench.mps_evidence``); the problems named."""
    from bench import mps_evidence
    evidence = mps_evidence.collect({"server": ready})
    evidence["problems"] = mps_evidence.verify(evidence, {"server": {"mps": expected, "priority": None,
                                                                    "mem_limit": None}})
    for line in evidence["problems"]:
        common.log(f"[llm_wake] MPS evidence: {line}")
    return evidence


if __name__ == "__main__":
    raise SystemExit(main())
