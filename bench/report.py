"""Render a folder of benchmark results into one page of figures for a ticket.

Every *.json under DIR (recursively) is read and recognised by its content: a
benchmark's --json output ("benchmark": "switch", ...) and what
scripts/gpu-check.sh writes beside them (summary.json, env.json,
mps_30_70.json). OUT gets report.png (every figure on one page),
report-<kind>.png (one figure per benchmark kind) and report.html: the same
figures embedded as data: URIs, so that the one file can be attached to a
ticket, under a header naming the device, host and date found in the results
and a table of their headline ratios.

One run per page: of each measurement (a kind and a file name without folder
and run suffix: colocate-run1.json and colocate-run2.json, or final-tree/x.json
and x.json) the newest run is drawn, or the one named with --run; the others
are listed as left out, with the file drawn in their place.

A JSON file that is no known result is listed as not rendered; a file that is
not JSON at all is named in one line on stderr and skipped. Results that
summary.json repeats from files beside it are drawn once. Needs matplotlib:
pip install 'nodeagent[plot]'.

example: python -m bench.report bench/results/h100-80gb-hbm3-2026-11-23 --out /tmp/report
         python -m bench.report bench/results/h100-80gb-hbm3-2026-11-23b --run review-tree --out /tmp/review

exit status: 0 a page was written; 1 nothing under DIR could be drawn
(report.html still lists what was found); 2 bad arguments (a --run that
names no run among them) or no matplotlib.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.report_figures import (FIGURES, GPU_CHECK, MPS, Result, as_dict, colocate_modes, draw_all, fmt, num, ratio,
                                  short)
from bench.report_runs import TOP, LeftOut, NoSuchRun, choose, cut, in_series_order

INSTALL_HINT = "bench.report needs matplotlib: pip install 'nodeagent[plot]' (or 'matplotlib>=3.7,<4')"
MAX_FILE_BYTES = 32 * 1024 * 1024  # a benchmark's JSON is kilobytes; anything this big is something else
MAX_PER_KIND = 8  # results drawn in one kind's figure
BENCHMARKS = ("colocate", "switch", "suspend", "reclaim", "handoff", "scale", "fairness", "preempt", "enforce",
              "recovery", "cluster_sim")
ENVIRONMENT = "environment"  # gpu-check's env.json: read for the header, no figure of its own
_DATE = re.compile(r"(?<!\d)(20\d\d-[01]\d-[0-3]\d)(?!\d)")


def log(message: str) -> None:
    print(f"[report] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ collection


@dataclass
class Skipped:
    source: str
    reason: str


@dataclass
class Collection:
    results: list[Result] = field(default_factory=list)
    context: list[Result] = field(default_factory=list)  # env.json: header only
    not_rendered: list[Skipped] = field(default_factory=list)
    malformed: list[Skipped] = field(default_factory=list)
    repeated: list[Skipped] = field(default_factory=list)  # summary.json's copies of files beside it
    left_out: list[LeftOut] = field(default_factory=list)  # other runs of a measurement drawn from one run
    runs: list[str] = field(default_factory=list)  # every run label found under DIR
    run: str | None = None  # the run named with --run
    other_runs: int = 0  # results left out because another run of their measurement is drawn
    files: int = 0
    carried: int = 0  # results found inside gpu-check summaries, beside the files

    def by_kind(self) -> dict[str, list[Result]]:
        kinds: dict[str, list[Result]] = {}
        for kind in FIGURES:
            found = [r for r in self.results if r.kind == kind]
            if found:
                kinds[kind] = found
        return kinds


def classify(data) -> str | None:
    """The kind of result a JSON value is, from its content; None when unknown."""
    if not isinstance(data, dict):
        return None
    if data.get("benchmark") in BENCHMARKS:
        return data["benchmark"]
    if isinstance(data.get("steps"), list) and isinstance(data.get("results"), dict):
        return GPU_CHECK
    if num(data.get("throughput_ratio")) is not None and isinstance(data.get("matmuls"), dict):
        return MPS
    if "kernel" in data and "python" in data and ("torch" in data or "nvml" in data):
        return ENVIRONMENT
    return None


def _unknown_reason(data) -> str:
    if isinstance(data, dict) and isinstance(data.get("benchmark"), str):
        return f"benchmark {data['benchmark']!r} has no figure"
    if isinstance(data, dict):
        return "not a result bench.report knows (no known 'benchmark' field)"
    return f"a JSON {type(data).__name__}, not an object"


def _json_files(root: Path) -> list[Path]:
    found = []
    for folder, dirs, names in os.walk(root):  # symlinked folders are not followed
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(folder, n) for n in sorted(names) if n.endswith(".json") and os.path.isfile(Path(folder, n))]
    return found


def collect(root: Path) -> Collection:
    """Read every JSON file under ``root``, sorted into results, header context and what was skipped."""
    out = Collection()
    carried: list[tuple[str, dict, float]] = []  # results inside a gpu-check summary
    for path in _json_files(root):
        out.files += 1
        source = path.relative_to(root).as_posix()
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"{path.stat().st_size} bytes, larger than any benchmark result")
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            log(f"skipped {source}: not readable JSON ({reason})")
            out.malformed.append(Skipped(source, reason))
            continue
        kind = classify(data)
        if kind == ENVIRONMENT:
            out.context.append(Result(kind, source, data))
        elif kind is None:
            out.not_rendered.append(Skipped(source, _unknown_reason(data)))
        else:
            modified = path.stat().st_mtime
            out.results.append(Result(kind, source, data, modified))
            if kind == GPU_CHECK:
                carried += [(f"{source}#results.{name}", value, modified) for name, value in data["results"].items()]
    seen = {_canonical(r.data): r.source for r in out.results}
    for source, value, modified in carried:
        kind = classify(value)
        if kind is None or kind in (ENVIRONMENT, GPU_CHECK):
            continue  # a step that wrote nothing
        out.carried += 1
        if _canonical(value) in seen:
            out.repeated.append(Skipped(source, f"the same result as {seen[_canonical(value)]}, drawn once"))
            continue
        out.results.append(Result(kind, source, value, modified))
    return out


def _canonical(data) -> str:
    return json.dumps(data, sort_keys=True)


def select(collection: Collection, run: str | None = None) -> None:
    """Keep one run of each measurement (the newest, or the one in ``run``) and at most MAX_PER_KIND results
    of a kind, never splitting a result from its variant; the rest go to ``left_out``. Raises NoSuchRun."""
    choice = choose(collection.results, run)
    collection.runs, collection.run = choice.runs, (run.strip("/") or TOP) if run is not None else None
    collection.left_out += choice.left_out
    collection.other_runs = len(choice.left_out)
    kept = []
    for kind in FIGURES:  # a figure of a hundred panels helps nobody and could exhaust memory
        drawn, rest = cut(in_series_order([r for r in choice.drawn if r.kind == kind]), MAX_PER_KIND)
        kept += drawn
        collection.left_out += [LeftOut(r, f"{kind} draws at most {MAX_PER_KIND} results; {len(drawn)} drawn, "
                                           "a result and its variants together") for r in rest]
    collection.results = kept


def tally(collection: Collection) -> str:
    """What became of every JSON file: the one line both stderr and the page show."""
    parts = [f"{len(collection.results)} result{'' if len(collection.results) == 1 else 's'} drawn"]
    for count, words in ((len(collection.left_out), "left out (other runs, or over a figure's limit)"),
                         (len(collection.not_rendered), "not rendered"), (len(collection.malformed), "malformed"),
                         (len(collection.repeated), "repeated in a summary"),
                         (len(collection.context), "read for the header only")):
        if count:
            parts.append(f"{count} {words}")
    carried = f" and {collection.carried} results inside gpu-check summaries" if collection.carried else ""
    return f"{collection.files} JSON files{carried}: " + ", ".join(parts)


# ------------------------------------------------------------------ header and headline ratios


def describe(collection: Collection, root: Path) -> dict[str, str]:
    """Device, host and date as the results record them (each says so when they do not)."""
    everything = collection.context + collection.results
    devices: list[str] = []
    host: dict[str, str] = {}
    dates: list[str] = []
    for r in everything:
        d = r.data
        env = as_dict(d.get("environment")) if r.kind == GPU_CHECK else d if r.kind == ENVIRONMENT else {}
        torch_info = as_dict(env.get("torch"))
        for name in (d.get("device"), torch_info.get("device") if torch_info.get("available") else None):
            if isinstance(name, str) and name and short(name, 80) not in devices and len(devices) < 4:
                devices.append(short(name, 80))
        for key, value in (("host", d.get("hostname") or env.get("hostname")), ("kernel", env.get("kernel")),
                           ("python", d.get("python") or env.get("python")),
                           ("torch", d.get("torch") if isinstance(d.get("torch"), str) else torch_info.get("version")),
                           ("driver", as_dict(env.get("nvml")).get("driver")), ("cores", d.get("cpu_count"))):
            if isinstance(value, (str, int)) and not isinstance(value, bool) and key not in host:
                host[key] = short(value, 80)
        for key in ("date", "started", "started_at", "timestamp", "tag"):
            match = _DATE.search(str(d.get(key))) if d.get(key) is not None else None
            if match:
                dates.append(match.group(1))
    backends = sorted({r.data["backend"] for r in collection.results if isinstance(r.data.get("backend"), str)})
    if devices:
        device = ", ".join(devices)
    else:
        device = (f"{', '.join(backends)} backend, " if backends else "") + "no device named in these results"
    if dates:
        date = ", ".join(sorted(set(dates)))
    else:
        match = _DATE.search(root.resolve().name)
        date = f"{match.group(1)} (from the folder's name)" if match else "not recorded in these results"
    host_text = ", ".join(f"{k} {v}" for k, v in host.items()) or "not recorded in these results"
    return {"device": device, "host": host_text, "date": date}


_GOAL = re.compile(r"^\s*(\S+)\s*(<=|>=|==|<|>)\s*(.+?)\s*$")  # the benchmarks' "ratio_pipe_p50 <= 2.5"
_OPS = {"<=": "≤", ">=": "≥", "==": "=", "<": "<", ">": ">"}


@dataclass
class Headline:
    source: str
    benchmark: str
    what: str
    value: str
    goal: str = ""
    met: bool | None = None
    field: str = ""  # the result's JSON field, shown as a tooltip: the words in `what` are for the reader
    why: str = ""  # for a goal missed: what was measured against what, when "what is value" says too little

    def missed(self) -> str:
        """A missed goal in words: which goal, the value measured and the target."""
        return self.why or f"{self.what} is {self.value}; the goal is {self.goal or 'not stated'}"


# the goals' field names (bench.handoff, bench.scale, bench.scrapers) in words
GOAL_WORDS = {
    "ratio_pipe_p50": "handoff p50 ÷ pipe ping-pong p50",
    "ratio_one_hop_pipe_p50": "one-hop handoff p50 ÷ pipe ping-pong p50",
    "handoff_p99_us": "handoff p99, µs",
    "idle_cpu_percent": "daemon CPU with every session idle, % of a core",
    "handoff_idle_over_empty_p50": "handoff p50 beside idle sessions ÷ without them",
    "handoff_idle_over_empty_p99": "handoff p99 beside idle sessions ÷ without them",
    "sessions_attached": "sessions attached",
    "threads_delta": "daemon threads added under the scraper storm",
    "rss_delta_kb": "daemon memory added under the scraper storm, KB",
    "handoff_storm_over_idle_p50": "handoff p50 in the scraper storm ÷ idle",
}

# the benchmark kinds, as the page names them (the kind itself is the cell's tooltip)
KIND_WORDS = {
    "colocate": "inference beside training", "switch": "model switch", "suspend": "suspend and resume",
    "reclaim": "reclaim of a lent device", "handoff": "token handoff", "scale": "idle sessions",
    "fairness": "weighted fair share", "preempt": "inference preempting training", "enforce": "enforcement",
    "recovery": "daemon restart", "cluster_sim": "cluster simulation", MPS: "MPS partition",
    GPU_CHECK: "GPU check (scripts/gpu-check.sh)",
}


def headlines(result: Result) -> list[Headline]:
    """The few numbers a reader of a ticket wants first, with the goal they are judged by."""
    d, src, kind = result.data, result.source, result.kind
    rows: list[Headline] = []

    def row(what: str, value: str, goal: str = "", met=None, field: str = "", why: str = "") -> None:
        rows.append(Headline(src, kind, what, value, goal, met if isinstance(met, bool) else None, field, why))

    if kind == "switch":
        judged = d.get("backend") == "cuda"
        for name, m in as_dict(d.get("models")).items():
            m = as_dict(m)
            cop = num(m.get("cold_over_pipelined"))
            row(f"{name}: cold ÷ pipelined", ratio(cop, 0), "≥ 50× (GPU only)" if judged else "not judged on cpu",
                cop >= 50 if judged and cop is not None else None, "cold_over_pipelined")
            overhead = num(m.get("overhead_ratio"))
            if overhead is not None:
                row(f"{name}: (pipelined − ready) ÷ (cold − ready)", f"{overhead * 100:.3f}%", "PipeSwitch: 0.11%")
            por = num(m.get("pipelined_over_ready"))
            if judged and name == "resnet152":  # bench/README.md: ResNet-152 pipelined ≤ 1.25× ready on a GPU
                row(f"{name}: pipelined ÷ ready", ratio(por), "≤ 1.25× (GPU)", por <= 1.25 if por else None,
                    "pipelined_over_ready")
            else:
                row(f"{name}: pipelined ÷ ready", ratio(por), field="pipelined_over_ready")
            if num(m.get("swap_efficiency")) is not None:
                row(f"{name}: swap efficiency", ratio(m["swap_efficiency"], suffix=""), "≥ 0.85",
                    m["swap_efficiency"] >= 0.85, "swap_efficiency")
        if isinstance(d.get("pipelined_never_slower"), bool):
            row("pipelined never slower than sequential", "yes" if d["pipelined_never_slower"] else "no", "yes",
                d["pipelined_never_slower"], "pipelined_never_slower",
                "a pipelined swap was slower than a sequential one for at least one model; the goal is never")
    elif kind == "colocate":
        rows += _colocate_headlines(result)
    elif kind in ("handoff", "scale") and isinstance(d.get("goals"), list):
        for g in d["goals"]:
            g = as_dict(g)
            match = _GOAL.match(str(g.get("goal", "?")))
            field_, goal = (match.group(1), f"{_OPS[match.group(2)]} {match.group(3)}") if match else (
                str(g.get("goal")), "")
            value = num(g.get("value"))
            row(GOAL_WORDS.get(field_, field_.replace("_", " ")) + (f" ({g['sessions']} sessions)" if "sessions" in g
                                                                     else ""),
                "n/a" if value is None else fmt(value), goal, g.get("met"), field_)
    elif kind == "handoff":  # before the goals list existed
        row(f"handoff p50 ÷ zmq round trip ({d.get('sessions')} sessions)", ratio(d.get("ratio_p50")), "≤ 2×",
            d.get("goal_p50_met"), "ratio_p50")
        row("handoff p99", f"{fmt(num(d.get('handoff_p99_us')) or 0)} µs", "< 1 ms", d.get("goal_p99_met"),
            "handoff_p99_us")
    elif kind == "fairness":
        row("max error of the share", f"{ratio(d.get('max_error_points'), 2, '')} points", "≤ 2 points",
            d.get("goal_met"), "max_error_points")
    elif kind == "preempt":
        row("inference wait p99 ÷ training slice", ratio(d.get("wait_p99_over_slice"), 3), "≤ 1", d.get("goal_met"),
            "wait_p99_over_slice")
    elif kind == "enforce":
        row("launched hog: inference p99 ÷ grace", ratio(d.get("launched_p99_over_grace"), 3), "≤ 1 + 2 ms",
            d.get("goal_met"), "launched_p99_over_grace")
        lib = as_dict(d.get("library"))
        if lib:
            row("library hog: inference p99 − grace", f"{ratio(lib.get('p99_minus_grace_ms'), 1, ' ms')}", "≤ 2 ms",
                lib.get("goal_met"), "library.p99_minus_grace_ms")
    elif kind == "recovery":
        row("restart → every session attached", ratio(d.get("reattach_s"), 2, " s"))
        kept, total = d.get("sessions_kept"), d.get("sessions")
        row("sessions kept", f"{kept} of {total}", "all, no client error",
            kept == total and d.get("client_errors") == 0 if total is not None else None, "sessions_kept",
            f"{kept} of {total} sessions kept and {d.get('client_errors')} client errors; the goal is all kept and "
            "no client error")
    elif kind == "suspend":
        goal = num(d.get("goal_speedup"))
        for size, s in as_dict(d.get("sizes")).items():
            speedup = num(as_dict(s).get("speedup"))
            row(f"{size} MiB: restart ÷ (suspend + resume)", ratio(speedup, 0),
                f"≥ {goal:.0f}×" if goal else "", speedup >= goal if goal and speedup is not None else None)
    elif kind == "reclaim":
        row("cooperative reclaim − trainer's own park", ratio(d.get("cooperative_minus_park_ms"), 1, " ms"),
            "a few ms")
        row("enforced reclaim − deadline", ratio(d.get("enforced_minus_deadline_ms"), 2, " ms"), "a few ms")
    elif kind == "cluster_sim":
        rows += _cluster_sim_headlines(result)
    elif kind == MPS:
        row(f"throughput ratio of the {_shares_text(d)} split", ratio(d.get("throughput_ratio")),
            f"ideal {ratio(d.get('expected_ratio'))}")
    elif kind == GPU_CHECK:
        for suite, t in as_dict(d.get("pytest")).items():
            t = as_dict(t)
            if t:
                row(f"pytest -m gpu ({suite})", f"{t.get('passed')} of {t.get('tests')} passed", "all",
                    t.get("passed") == t.get("tests"), f"pytest.{suite}")
        bad = [f"{short(s.get('step'), 20)} ({short(s.get('status'), 12)})" for s in d.get("steps", [])
               if isinstance(s, dict) and s.get("status") != "ok"]
        row("every step ok", "yes" if d.get("ok") else "no", "yes", d.get("ok"), "ok",
            f"steps not ok: {', '.join(bad[:6]) or 'none listed'}; the goal is every step ok")
    return rows


# issue 20's goals on a GPU: p99 within 1.10x of alone, training kept at least this much, per load
COLOCATE_KEPT_GOAL = {"light": 0.90, "heavy": 0.70}
COLOCATE_P99_GOAL = 1.10
COLOCATE_BASELINES = ("no-daemon", "mps", "mps-priority")


def _colocate_headlines(result: Result) -> list[Headline]:
    """Per load: nodeagent's default mode (p99 ÷ alone, training kept) against the best baseline
    (the lowest p99 ÷ alone of no daemon and MPS) and against no daemon at all."""
    d, src = result.data, result.source
    judged = d.get("backend") == "cuda"
    modes = colocate_modes(d)
    default = d.get("default_mode") if d.get("default_mode") in modes else next(
        (m for m in ("corun", "corun-mps", "corun-pause", "corun-free") if m in modes), None)
    rows = []

    def row(what, value, goal="", met=None, field="", why=""):
        rows.append(Headline(src, "colocate", what, value, goal, met if isinstance(met, bool) else None, field, why))

    def pct(value) -> str:
        return "n/a" if num(value) is None else f"{num(value) * 100:.0f}%"

    for load in as_dict(d.get("loads")):
        entries = {m: as_dict(as_dict(loads).get(load)) for m, loads in modes.items()}
        baselines = [m for m in COLOCATE_BASELINES if num(entries.get(m, {}).get("p99_over_alone")) is not None]
        best = min(baselines, key=lambda m: entries[m]["p99_over_alone"]) if baselines else None
        if default is not None:
            e = entries[default]
            p99, kept = num(e.get("p99_over_alone")), num(e.get("kept"))
            kept_goal = COLOCATE_KEPT_GOAL.get(load)
            row(f"{load}: {default} p99 ÷ alone", ratio(p99), f"≤ {COLOCATE_P99_GOAL:.2f}×" if judged else
                "not judged on cpu", p99 <= COLOCATE_P99_GOAL if judged and p99 is not None else None,
                "p99_over_alone")
            row(f"{load}: {default} training kept", pct(kept),
                (f"≥ {kept_goal * 100:.0f}%" if judged else "not judged on cpu") if kept_goal else "",
                kept >= kept_goal if judged and kept_goal and kept is not None else None, "kept")
            own, none_ = num(e.get("p99_ms")), num(entries.get("no-daemon", {}).get("p99_ms"))
            if own is not None and none_ is not None:
                row(f"{load}: {default} p99 against no daemon", f"{fmt(own)} vs {fmt(none_)} ms", "never worse",
                    own <= none_, "p99_ms",
                    f"{load}: {default}'s p99 is {fmt(own)} ms, no daemon's {fmt(none_)} ms; the goal is never worse "
                    "than no daemon")
        if best is not None:
            b = entries[best]
            row(f"{load}: best baseline ({best}) p99 ÷ alone · kept",
                f"{ratio(b.get('p99_over_alone'))} · {pct(b.get('kept'))}")
        dropped = [f"{m} ({e['dropped']:,} of {e.get('offered')})" for m, e in entries.items()
                   if isinstance(e.get("dropped"), int) and e["dropped"] > 0]
        if dropped:
            row(f"{load}: requests dropped (backlog full)", ", ".join(dropped))
    failed = as_dict(d.get("failed"))
    if failed:
        row("modes that failed", ", ".join(short(m, 20) for m in failed), "none", False, "failed",
            f"these modes did not finish: {', '.join(short(m, 20) for m in failed)}; the goal is every mode run")
    return rows


def _cluster_sim_headlines(result: Result) -> list[Headline]:
    """Each published comparison the simulation repeats: ours beside the paper's figure."""
    rows = []
    for c in result.data.get("comparisons") if isinstance(result.data.get("comparisons"), list) else []:
        c = as_dict(c)
        paper, ours, against = short(str(c.get("paper", "?")).split(" (")[0], 20), c.get("ours"), c.get("against")
        what = f"{paper}: {short(ours, 24)} vs {short(against, 40)}"
        if num(c.get("paper_queue_ratio")) is not None:
            rows.append(Headline(result.source, "cluster_sim", f"{what}: JCT ÷, queueing ÷",
                                 f"{ratio(c.get('jct_ratio'))} / {ratio(c.get('queue_ratio'))}",
                                 f"paper {ratio(c.get('paper_jct_ratio'))} / {ratio(c.get('paper_queue_ratio'))}"))
        elif isinstance(c.get("paper_jct_change_pct"), list):
            goal = " / ".join(f"{num(v):+.0f}%" for v in c["paper_jct_change_pct"] if num(v) is not None)
            value = num(c.get("jct_change_pct"))
            rows.append(Headline(result.source, "cluster_sim", f"{what}: average JCT",
                                 "n/a" if value is None else f"{value:+.1f}%", f"paper {goal}"))
        elif num(c.get("small_jobs_jct_ratio")) is not None or num(c.get("jct_ratio")) is not None:
            rows.append(Headline(result.source, "cluster_sim", f"{what}: JCT ÷ (all jobs, small jobs)",
                                 f"{ratio(c.get('jct_ratio'))}, {ratio(c.get('small_jobs_jct_ratio'))}",
                                 f"paper: short jobs first, up to {ratio(c.get('paper_jct_ratio'), 1)} on average"))
        elif isinstance(c.get("deadlines_met_share"), dict):
            met = as_dict(c["deadlines_met_share"])
            be = as_dict(c.get("best_effort_jct_avg_s"))
            text = "; ".join(f"{short(k, 20)} {num(v) * 100:.0f}% met, BE {fmt(num(be.get(k)) or 0)} s"
                             for k, v in met.items() if num(v) is not None)
            rows.append(Headline(result.source, "cluster_sim", f"{paper}: deadlines met and best-effort JCT",
                                 short(text, 300), f"paper: misses up to {ratio(c.get('paper_miss_ratio'), 1)} fewer"))
    return rows


def _headlines_or_note(result: Result) -> list[Headline]:
    try:
        return headlines(result)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a known name with an unexpected shape
        return [Headline(result.source, result.kind, "headline ratios", f"unreadable ({type(exc).__name__})")]


def _shares_text(d: dict) -> str:
    shares = as_dict(d.get("shares"))
    return "/".join(f"{v}" for v in shares.values()) if shares else "MPS"


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def render(collection: Collection, root: Path, out: Path, dpi: int = 100) -> list[str]:
    """Write report-<kind>.png, report.png and report.html into ``out``; the kinds drawn."""
    out.mkdir(parents=True, exist_ok=True)
    header = describe(collection, root)
    kinds = collection.by_kind()
    drawn = draw_all(kinds, f"nodeagent benchmarks: {root.resolve().name} · {short(header['device'], 80)} · "
                            f"{header['date']}", dpi, log)
    for kind, png in drawn.figures.items():
        _write(out / f"report-{kind}.png", png)
    for stale in set(FIGURES) - set(drawn.figures):  # only names this tool writes
        (out / f"report-{stale}.png").unlink(missing_ok=True)
    if drawn.page is not None:
        _write(out / "report.png", drawn.page)
    else:
        (out / "report.png").unlink(missing_ok=True)
    for kind, reason in drawn.failed.items():
        collection.not_rendered += [Skipped(r.source, f"could not draw: {reason}") for r in kinds[kind]]
    collection.results = [r for r in collection.results if r.kind not in drawn.failed]
    _write(out / "report.html", render_html(collection, root, header, drawn.figures).encode())
    return list(drawn.figures)


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1600px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;font-size:.9em;
text-align:left;vertical-align:top}th{background:#f3f3f3}.met{color:#1a7f37}.missed{color:#c62828;font-weight:bold}
.why{color:#c62828;font-size:.9em}figure{margin:1em 0}img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.85em;color:#555}code{font-size:.9em}td[title]{text-decoration:underline dotted #999}"""

HEADLINE_COLUMNS = ("benchmark", "from file", "measure", "value", "goal", "goal met?")


def _met_cell(h: Headline) -> str:
    if h.met is True:
        return "<span class='met'>yes</span>"
    if h.met is False:
        return f"<span class='missed'>no</span>: <span class='why'>{html.escape(h.missed())}</span>"
    return ""


def _runs_text(collection: Collection) -> str:
    if collection.run is not None:
        return f"run {collection.run}, named with --run, of {len(collection.runs)}: {', '.join(collection.runs)}"
    if len(collection.runs) > 1 and not collection.other_runs:
        return (f"results from {', '.join(collection.runs)}: each measurement ran once, all are drawn; "
                "name one run with --run NAME")
    if len(collection.runs) > 1:
        return (f"{len(collection.runs)} runs ({', '.join(collection.runs)}): of each measurement the newest run is "
                "drawn, the others are listed as left out under Files; name one with --run NAME")
    return "one run" if collection.runs else "none"


def render_html(collection: Collection, root: Path, header: dict, figures: dict[str, bytes]) -> str:
    """One self-contained page: every figure a data: URI, every string from a result escaped."""
    e = html.escape
    rendered_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>nodeagent benchmarks: {e(root.resolve().name)}</title><style>{_CSS}</style></head><body>",
             f"<h1>nodeagent benchmarks: {e(root.resolve().name)}</h1><table>",
             *(f"<tr><th>{k}</th><td>{e(v)}</td></tr>" for k, v in header.items()),
             f"<tr><th>runs</th><td>{e(_runs_text(collection))}</td></tr>",
             f"<tr><th>files</th><td class='tally'>{e(tally(collection))}</td></tr>",
             f"<tr><th>rendered</th><td>{rendered_at} by <code>python -m bench.report</code></td></tr></table>"]
    rows = [h for results in collection.by_kind().values() for r in results for h in _headlines_or_note(r)]
    if rows:
        parts.append("<h2>Headline ratios</h2><p>Hover a measure for the field of the result's JSON it comes "
                     "from.</p><table><tr>" + "".join(f"<th>{c}</th>" for c in HEADLINE_COLUMNS) + "</tr>")
        for h in rows:
            what = f"<td title='{e(h.field)}'>{e(h.what)}</td>" if h.field else f"<td>{e(h.what)}</td>"
            parts.append(f"<tr><td title='{e(h.benchmark)}'>{e(KIND_WORDS.get(h.benchmark, h.benchmark))}</td>"
                         f"<td><code>{e(h.source)}</code></td>{what}<td>{e(h.value)}</td><td>{e(h.goal)}</td>"
                         f"<td>{_met_cell(h)}</td></tr>")
        parts.append("</table>")
    if figures:
        parts.append("<h2>Figures</h2><p>The same figures are on one page in <code>report.png</code>, "
                     "and one by one in <code>report-&lt;kind&gt;.png</code>.</p>")
    for kind, png in figures.items():
        sources = ", ".join(r.source for r in collection.results if r.kind == kind)
        others = [o.result.source for o in collection.left_out if o.result.kind == kind]
        left = f"; left out: {', '.join(others)} (why: under Files)" if others else ""
        parts.append(f"<figure><img alt='{e(FIGURES[kind].title)}' src='data:image/png;base64,"
                     f"{base64.b64encode(png).decode()}'><figcaption>{e(KIND_WORDS.get(kind, kind))}, drawn from "
                     f"{e(sources)}{e(left)}</figcaption></figure>")
    parts.append("<h2>Files</h2><ul>")
    parts += [f"<li><code>{e(r.source)}</code>: header (device, host)</li>" for r in collection.context]
    parts += [f"<li><code>{e(s.source)}</code>: {e(s.reason)}</li>" for s in collection.repeated]
    parts += [f"<li><code>{e(o.result.source)}</code>: left out: {e(o.reason)}</li>" for o in collection.left_out]
    parts += [f"<li><code>{e(s.source)}</code>: not rendered: {e(s.reason)}</li>" for s in collection.not_rendered]
    parts += [f"<li><code>{e(s.source)}</code>: malformed, skipped: {e(s.reason)}</li>" for s in collection.malformed]
    parts.append("</ul></body></html>\n")
    return "\n".join(parts)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _dpi(text: str) -> int:
    value = int(text)
    if not 50 <= value <= 300:
        raise argparse.ArgumentTypeError(f"must be 50 to 300, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=doc[0],
                                 epilog="\n\n".join(doc[1:]).strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", metavar="DIR", type=Path, help="a results folder, e.g. bench/results/<machine>-<date>")
    ap.add_argument("--out", required=True, type=Path,
                    help="folder for report.html, report.png and report-<kind>.png (made if missing)")
    ap.add_argument("--dpi", type=_dpi, default=100, help="resolution of the PNGs, 50 to 300 (default 100)")
    ap.add_argument("--run", metavar="NAME",
                    help="draw this run instead of the newest of each measurement: a subfolder of DIR "
                         "(final-tree), a run suffix (run2 for *-run2.json), both (first-contact/run1), "
                         "or . for DIR's own files without a suffix")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        ap.error(f"DIR {args.dir} is not a folder")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} exists and is not a folder")
    if not matplotlib_available():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    collection = collect(args.dir)
    try:
        select(collection, args.run)
    except NoSuchRun as exc:
        ap.error(f"--run: {exc}")
    if len(collection.runs) > 1 or args.run is not None:
        log(_runs_text(collection))
    drawn = render(collection, args.dir, args.out, args.dpi)
    log(f"{tally(collection)} (under {args.dir})")
    if not drawn:
        log(f"nothing under {args.dir} is a benchmark result this tool draws; {args.out / 'report.html'} lists "
            "what was found")
        return 1
    log(f"wrote {args.out / 'report.html'} and {args.out / 'report.png'} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
