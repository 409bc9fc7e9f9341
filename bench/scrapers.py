"""Scrapers: what slow and hostile Prometheus scrapers cost the daemon, and whether
token handoffs notice (issue 21: 2,000 slow scrapers within 10 MB and 10 threads
of the idle daemon, grants unaffected).

One daemon (the own one, metrics on), one run, four phases; two sessions hand
the token back and forth (bench.handoff's contenders) in every phase:

  cost      before the handoffs start: ``--cost-scrapes`` scrapes 150 ms
            apart, alone: the daemon's CPU per scrape (/proc/PID/stat) and
            a scrape's latency when nothing waits (``scrape_p50_ms``)
  idle      no scrapers: the daemon's threads, RSS and (``--storm-s``/3 with
            no handoffs) CPU; handoffs
  scraping  one honest scraper asking back to back (the daemon answers at most
            ten a second): the handoffs beside expositions being written
  storm     ``--scrapers`` slow connections from ``--procs`` forked processes,
            a third each: idle (connects, sends nothing), slowloris (a request
            head one byte every ``--byte-interval-s``, never finished),
            no-reader (a whole request, a 1 KiB receive buffer, never reads);
            each connects again ``--reconnect-s`` after the daemon closes it.
            An honest scraper asks every ``--scrape-interval-s`` meanwhile.
            The first third has no handoffs: the daemon's CPU (and the
            scrapers') in it is what the storm costs.
            The daemon's threads and RSS are sampled every 50 ms (the most
            seen is reported), and so is the time the scrapers took to connect
            (the old server's backlog of 5 made 1,500 take over two minutes)
  idle      handoffs again, the baseline after

Four processes and the daemon share the machine's cores in the storm (two
contenders, two scraper processes): on 2 cores the storm's handoffs also pay
for the scrapers' own CPU.

Handoffs in the scraping and storm phases are compared with the idle phases
pooled (p50 and p99). Goals: threads and RSS during the storm within 10 and
10 MB of idle, and handoff p50 within 10% of idle.
"""

from __future__ import annotations

import math
import os
import resource
import select
import socket
import tempfile
import threading
import time
import urllib.request

from bench import common
from bench.handoff import Contenders, pair_handoffs
from bench.scale import cpu_seconds, rss_kb

_WORKER_TIMEOUT_S = 120.0
_SAMPLE_S = 0.05
GOAL_THREADS = 10
GOAL_RSS_KB = 10 * 1024
GOAL_HANDOFF_RATIO = 1.10
KINDS = ("idle", "slowloris", "no-reader")
_HEAD = b"GET /metrics HTTP/1.1\r\nHost: bench\r\nUser-Agent: slowloris\r\nX-Padding: " + b"a" * 4000
_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n"


def threads_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# ------------------------------------------------------------------ the slow scrapers


class _Slow:
    __slots__ = ("kind", "sock", "sent", "reopen_at")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.sock: socket.socket | None = None
        self.sent = 0  # bytes of the head a slowloris has sent
        self.reopen_at = 0.0


def _open(port: int, slow: _Slow, poller) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if slow.kind == "no-reader":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.settimeout(10.0)
    try:
        s.connect(("127.0.0.1", port))
        if slow.kind == "no-reader":
            s.sendall(_REQUEST)
    except OSError:
        s.close()
        return False
    s.setblocking(False)
    slow.sock, slow.sent = s, 0
    # Only hang-ups are watched: a no-reader never reads, and the others are sent nothing but a close.
    poller.register(s.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return True


def _storm(ctl: common.WorkerControl, port: int, count: int, offset: int, byte_interval_s: float,
           reconnect_s: float, stop) -> None:
    """``count`` slow connections of the kinds in turn; see the module docstring."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 64), hard))
    poller = select.poll()
    slows = [_Slow(KINDS[(offset + i) % len(KINDS)]) for i in range(count)]
    t0 = time.monotonic()
    failed = sum(1 for s in slows if not _open(port, s, poller))
    connect_s = time.monotonic() - t0
    by_fd = {s.sock.fileno(): s for s in slows if s.sock is not None}
    ctl.ready({"connect_s": connect_s, "connect_failures": failed, "pid": os.getpid()})
    closed = reopened = 0
    next_byte = time.monotonic() + byte_interval_s
    while not stop.is_set():
        now = time.monotonic()
        for fd, _ev in poller.poll(max(0, int(min(byte_interval_s, 0.05) * 1000))):
            slow = by_fd.pop(fd, None)
            if slow is None:
                continue
            poller.unregister(fd)
            slow.sock.close()
            slow.sock = None
            slow.reopen_at = now + reconnect_s
            closed += 1
        now = time.monotonic()
        if now >= next_byte:
            next_byte = now + byte_interval_s
            for slow in slows:
                if slow.kind == "slowloris" and slow.sock is not None and slow.sent < len(_HEAD):
                    try:
                        slow.sock.send(_HEAD[slow.sent:slow.sent + 1])
                        slow.sent += 1
                    except OSError:
                        pass  # closed: the poll says so
        for slow in slows:
            if slow.sock is None and now >= slow.reopen_at:
                if _open(port, slow, poller):
                    by_fd[slow.sock.fileno()] = slow
                    reopened += 1
                else:
                    slow.reopen_at = now + reconnect_s
    for slow in slows:
        if slow.sock is not None:
            slow.sock.close()
    ctl.result({"closed_by_daemon": closed, "reconnected": reopened})


class SlowScrapers:
    """``count`` slow scrapers in ``procs`` forked processes while the block it wraps runs."""

    def __init__(self, port: int, count: int, procs: int = 2, byte_interval_s: float = 1.0,
                 reconnect_s: float = 1.0) -> None:
        self._args = (port, count, procs, byte_interval_s, reconnect_s)
        self._stop = common.mp_context.Event()
        self._workers = common.Workers()
        self.connect_s = 0.0
        self.connect_failures = 0
        self.pids: list[int] = []
        self.closed_by_daemon = 0
        self.reconnected = 0

    def __enter__(self) -> "SlowScrapers":
        port, count, procs, byte_interval_s, reconnect_s = self._args
        offset = 0
        for n in _split(count, procs):
            self._workers.start(_storm, port, n, offset, byte_interval_s, reconnect_s, self._stop)
            offset += n
        ready = self._workers.wait_ready(_WORKER_TIMEOUT_S)
        self.pids = [r["pid"] for r in ready]
        self.connect_s = max(r["connect_s"] for r in ready)
        self.connect_failures = sum(r["connect_failures"] for r in ready)
        self._workers.go()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            if exc[0] is None:
                results = self._workers.results(_WORKER_TIMEOUT_S)
                self.closed_by_daemon = sum(r["closed_by_daemon"] for r in results)
                self.reconnected = sum(r["reconnected"] for r in results)
        finally:
            self._workers.__exit__(*exc)


def _split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# ------------------------------------------------------------------ watching the daemon


class Sampler:
    """The daemon's threads and RSS every 50 ms from a thread, while the block it wraps runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.threads_max = 0
        self.rss_max_kb = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            threads, rss = threads_of(self.pid), rss_kb(self.pid)
            if threads is not None and rss is not None:
                self.threads_max = max(self.threads_max, threads)
                self.rss_max_kb = max(self.rss_max_kb, rss)
                self.samples += 1
            if self._stop.wait(_SAMPLE_S):
                return

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5.0)


class HonestScraper:
    """Scrapes every ``interval_s`` (0: back to back) from a thread: latency and failures."""

    def __init__(self, port: int, interval_s: float) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval_s = interval_s
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self.body_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    self.body_bytes = len(resp.read())
                self.latencies_s.append(time.perf_counter() - t0)
            except OSError as exc:
                self.failures.append(str(exc))
            if self.interval_s and self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "HonestScraper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15.0)


# ------------------------------------------------------------------ the run


def run(handle: common.DaemonHandle, args) -> dict:
    pid = common.daemon_status(handle.endpoint).daemon_pid
    loops = math.ceil((args.handoffs + 5) / 2)
    rounds = args.rounds
    # round 0 warms up; then idle, scraping, storm, idle, each ``rounds`` rounds
    plan = [max(100, loops // 4)] + [loops] * (4 * rounds)
    out: dict = {"daemon_pid": pid}
    phases: list[str] = []
    with Contenders(handle.endpoint, 2, plan) as pair:
        out.update(scrape_cost(pid, handle.metrics_port, args.cost_scrapes))
        pair.run_round()
        time.sleep(0.3)
        out.update(threads_idle=threads_of(pid), rss_idle_kb=rss_kb(pid))
        out["daemon_cpu_percent_idle"] = _cpu_window(pid, [], args.storm_s / 3)
        for _ in range(rounds):
            phases.append("idle")
            pair.run_round()

        with HonestScraper(handle.metrics_port, 0.0) as busy:
            for _ in range(rounds):
                phases.append("scraping")
                pair.run_round()
        out.update(scrapes_beside_handoffs=len(busy.latencies_s), scrape_failures=len(busy.failures))

        common.log(f"[scrapers] {args.scrapers} slow scrapers from {args.procs} processes ...")
        with Sampler(pid) as sampler, SlowScrapers(handle.metrics_port, args.scrapers, args.procs,
                                                   args.byte_interval_s, args.reconnect_s) as storm:
            common.log(f"[scrapers] connected in {storm.connect_s:.2f} s; storm for {args.storm_s:g} s")
            with HonestScraper(handle.metrics_port, args.scrape_interval_s) as honest:
                # A third of the storm with no handoffs: what it costs the daemon (and the scrapers) alone.
                quiet_s = args.storm_s / 3
                out["daemon_cpu_percent_storm"], out["scrapers_cpu_percent"] = _cpu_window(pid, storm.pids, quiet_s)
                storm_started = time.monotonic()
                for i in range(rounds):
                    phases.append("storm")
                    pair.run_round()
                    _sleep_until(storm_started + (args.storm_s - quiet_s) * (i + 1) / rounds)
            threads_storm, rss_storm = threads_of(pid), rss_kb(pid)
        out.update(connect_s=storm.connect_s, connect_failures=storm.connect_failures,
                   closed_by_daemon=storm.closed_by_daemon, reconnected=storm.reconnected,
                   threads_storm_max=max(sampler.threads_max, threads_storm or 0),
                   rss_storm_max_kb=max(sampler.rss_max_kb, rss_storm or 0), sampler_reads=sampler.samples,
                   honest_scrapes=len(honest.latencies_s), honest_failures=len(honest.failures),
                   honest_failure_examples=honest.failures[:3],
                   honest_p50_ms=_ms(honest.latencies_s, 50), honest_p99_ms=_ms(honest.latencies_s, 99),
                   honest_max_ms=_ms(honest.latencies_s, 100))
        time.sleep(0.3)
        out.update(threads_after=threads_of(pid), rss_after_kb=rss_kb(pid))
        for _ in range(rounds):
            phases.append("idle")
            pair.run_round()
        records = pair.records()
    if handle.metrics_port is not None:
        samples = common.scrape_metrics(handle.metrics_port)
        out["daemon_closed"] = {r: common.metric(samples, "nodeagent_metrics_http_closed_total", reason=r)
                                for r in ("timeout", "evicted", "refused", "bad_request")}
    per_round, unpaired = pair_handoffs(records, 2)
    by_phase: dict[str, list[int]] = {}
    for i, phase in enumerate(phases):
        by_phase.setdefault(phase, []).extend(per_round.get(i + 1, []))
    out.update(handoffs=by_phase, unpaired=unpaired)
    return out


def scrape_cost(pid: int, port: int, scrapes: int) -> dict:
    """``scrapes`` scrapes 150 ms apart with nothing else asking: the daemon's CPU per
    scrape and the latency of one (both the exposition's cost, spread over loop turns)."""
    url = f"http://127.0.0.1:{port}/metrics"
    latencies, size = [], 0
    time.sleep(0.2)
    cpu0 = cpu_seconds(pid)
    for _ in range(scrapes):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as resp:
            size = len(resp.read())
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.15)
    cpu = cpu_seconds(pid) - cpu0 if cpu0 is not None else None
    return {"cost_scrapes": scrapes, "exposition_bytes": size, "scrape_p50_ms": _ms(latencies, 50),
            "scrape_max_ms": _ms(latencies, 100),
            "cpu_per_scrape_ms": None if cpu is None else common.rounded(cpu / scrapes * 1e3, 3)}


def _cpu_window(pid: int, others: list[int], seconds: float):
    """The daemon's CPU over ``seconds`` in percent of one core (and, with ``others``,
    theirs together as a second value)."""
    t0, cpu0 = time.monotonic(), cpu_seconds(pid)
    others0 = sum(cpu_seconds(p) or 0.0 for p in others)
    time.sleep(seconds)
    wall = time.monotonic() - t0
    cpu1, others1 = cpu_seconds(pid), sum(cpu_seconds(p) or 0.0 for p in others)
    mine = None if cpu0 is None or cpu1 is None else common.rounded((cpu1 - cpu0) / wall * 100, 1)
    if not others:
        return mine
    return mine, common.rounded((others1 - others0) / wall * 100, 1)


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _ms(values_s: list[float], q: float) -> float | None:
    return common.rounded(common.percentile(values_s, q) * 1e3, 3) if values_s else None


def summarize(raw: dict, args, backend: str, kind: str) -> dict:
    us = 1e-3
    h = raw.pop("handoffs")
    p = {phase: (common.percentile(v, 50) * us, common.percentile(v, 99) * us) for phase, v in h.items()}
    threads_delta = raw["threads_storm_max"] - raw["threads_idle"]
    rss_delta_kb = raw["rss_storm_max_kb"] - raw["rss_idle_kb"]
    r = {"benchmark": "scrapers", "backend": backend, "endpoint_kind": kind, "scrapers": args.scrapers,
         "procs": args.procs, "kinds": list(KINDS), "byte_interval_s": args.byte_interval_s,
         "reconnect_s": args.reconnect_s, "storm_s": args.storm_s, "scrape_interval_s": args.scrape_interval_s,
         **{k: v for k, v in raw.items()},
         "threads_delta": threads_delta, "rss_delta_kb": rss_delta_kb,
         "handoff_idle_p50_us": common.rounded(p["idle"][0], 2), "handoff_idle_p99_us": common.rounded(p["idle"][1], 2),
         "handoff_scraping_p50_us": common.rounded(p["scraping"][0], 2),
         "handoff_scraping_p99_us": common.rounded(p["scraping"][1], 2),
         "handoff_storm_p50_us": common.rounded(p["storm"][0], 2),
         "handoff_storm_p99_us": common.rounded(p["storm"][1], 2),
         "samples": {phase: len(v) for phase, v in h.items()}}
    for phase in ("scraping", "storm"):
        for q, i in (("p50", 0), ("p99", 1)):
            r[f"handoff_{phase}_over_idle_{q}"] = common.rounded(p[phase][i] / p["idle"][i], 3)
    r["goals"] = [
        {"goal": f"threads_delta <= {GOAL_THREADS}", "value": threads_delta, "met": threads_delta <= GOAL_THREADS},
        {"goal": f"rss_delta_kb <= {GOAL_RSS_KB}", "value": rss_delta_kb, "met": rss_delta_kb <= GOAL_RSS_KB},
        {"goal": f"handoff_storm_over_idle_p50 <= {GOAL_HANDOFF_RATIO}", "value": r["handoff_storm_over_idle_p50"],
         "met": r["handoff_storm_over_idle_p50"] <= GOAL_HANDOFF_RATIO},
    ]
    r["all_goals_met"] = all(g["met"] for g in r["goals"])
    return r


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("scrapers", __doc__.split("\n\n")[0],
                       endpoint_help="ignored: this benchmark starts its own daemon, with metrics on")
    ap.add_argument("--scrapers", type=common.positive_int, default=2000, help="slow connections (default 2000)")
    ap.add_argument("--procs", type=common.positive_int, default=2, help="processes holding them (default 2)")
    ap.add_argument("--storm-s", type=common.positive_float, default=12.0,
                    help="how long the storm lasts (default 12; past the daemon's 10 s timeout)")
    ap.add_argument("--byte-interval-s", type=common.positive_float, default=1.0,
                    help="a slowloris sends one byte this often (default 1)")
    ap.add_argument("--reconnect-s", type=common.positive_float, default=1.0,
                    help="a scraper the daemon closed connects again after this long (default 1)")
    ap.add_argument("--scrape-interval-s", type=common.positive_float, default=1.0,
                    help="the honest scraper's interval during the storm (default 1)")
    ap.add_argument("--handoffs", type=common.positive_int, default=2000, help="handoffs per round (default 2000)")
    ap.add_argument("--rounds", type=common.positive_int, default=3, help="rounds per phase (default 3)")
    ap.add_argument("--cost-scrapes", type=common.positive_int, default=20,
                    help="scrapes 150 ms apart that measure one's cost (default 20)")
    ap.add_argument("--metrics-timeout-ms", type=common.positive_float, default=None,
                    help="the daemon's metrics.timeout_ms (default: its own, 10000)")
    args = ap.parse_args(argv)
    os.environ.pop("NODEAGENT_ENDPOINT", None)  # always its own daemon: it needs the metrics port
    with tempfile.NamedTemporaryFile("w", prefix="nodeagent-bench-", suffix=".toml") as config:
        if args.metrics_timeout_ms is not None:
            config.write(f"[metrics]\ntimeout_ms = {args.metrics_timeout_ms}\n")
        config.flush()
        with common.daemon(["--config", config.name], metrics=True) as handle:
            backend = common.daemon_status(handle.endpoint).backend
            raw = run(handle, args)
    result = summarize(raw, args, backend, handle.kind)
    explain(result)
    common.emit(result, args.json)
    return 0


def explain(r: dict) -> None:
    common.log(f"[scrapers] {r['scrapers']} slow scrapers connected in {r['connect_s']:.2f} s "
               f"({r['connect_failures']} failed); the daemon closed {r['closed_by_daemon']} "
               f"({r.get('daemon_closed')})")
    common.log(f"[scrapers] daemon CPU {r.get('daemon_cpu_percent_idle')}% of a core idle, "
               f"{r.get('daemon_cpu_percent_storm')}% in the storm (no handoffs in either); the scrapers themselves "
               f"{r.get('scrapers_cpu_percent')}%")
    common.log(f"[scrapers] threads {r['threads_idle']} idle -> {r['threads_storm_max']} in the storm "
               f"(+{r['threads_delta']}); RSS {r['rss_idle_kb'] / 1024:.1f} -> {r['rss_storm_max_kb'] / 1024:.1f} MB "
               f"(+{r['rss_delta_kb'] / 1024:.1f} MB)")
    common.log(f"[scrapers] handoff p50/p99 us: idle {r['handoff_idle_p50_us']}/{r['handoff_idle_p99_us']}, "
               f"scraping {r['handoff_scraping_p50_us']}/{r['handoff_scraping_p99_us']}, "
               f"storm {r['handoff_storm_p50_us']}/{r['handoff_storm_p99_us']}")
    common.log(f"[scrapers] a scrape: {r.get('cpu_per_scrape_ms')} ms of daemon CPU, {r['exposition_bytes']} bytes, "
               f"p50 {r['scrape_p50_ms']} ms alone; during the storm {r['honest_scrapes']} honest scrapes, "
               f"{r['honest_failures']} failed, p50 {r['honest_p50_ms']} ms, max {r['honest_max_ms']} ms")
    for g in r["goals"]:
        common.log(f"[scrapers] goal {g['goal']}: {g['value']} ({'met' if g['met'] else 'NOT met'})")


if __name__ == "__main__":
    raise SystemExit(main())
