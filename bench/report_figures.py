"""The figures of bench.report: one per benchmark kind, and the page that holds them all.

Each ``draw_<kind>(fig, results)`` draws one kind's figure; the page is those
figures' images pasted onto two columns (first fit), so the page and the single
PNGs are the same pixels. Every value comes from untrusted JSON: numbers go
through ``num``, text shown is cut to fit, and TeX parsing is off while drawing.
matplotlib is imported only to draw.
"""

from __future__ import annotations

import io
import math
import textwrap
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Callable

COLUMN_IN = 7.5  # the page is two columns of this width (inches)
ROW_IN = 4.3
GPU_CHECK = "gpu-check"  # scripts/gpu-check.sh's summary.json
MPS = "mps"  # tests/daemon/test_mps.py's 30/70 split, written by gpu-check
MAX_GROUPS = 8  # models, sizes, session counts... drawn from one result: the rest would not be readable


def num(value) -> float | None:
    """A finite number from untrusted JSON, else None (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float
        return None
    return value if math.isfinite(value) else None


def fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def short(value, limit: int = 60) -> str:
    """Text from a result, cut to fit a title."""
    text = str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def as_dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def ratio(value, digits: int = 2, suffix: str = "×") -> str:
    v = num(value)
    return "n/a" if v is None else f"{v:,.{digits}f}{suffix}"


@dataclass
class Result:
    kind: str
    source: str  # path under DIR; "summary.json#results.switch" for one that summary.json carries
    data: dict
    modified: float = 0.0  # its file's st_mtime: the last way to tell which of two runs is newer


WAYS_SWITCH = (  # PipeSwitch's order: what a switch costs without a warm engine, then with one
    ("cold_ms", "cold: stop-and-start (new process)", "#d62728"),
    ("warm_pageable_ms", "warm process, pageable copy", "#ff7f0e"),
    ("pinned_sync_ms", "warm process, pinned copy, synchronised", "#bcbd22"),
    ("sequential_ms", "sequential swap (CPU waits for the copy)", "#9467bd"),
    ("pipelined_ms", "pipelined swap", "#1f77b4"),
    ("ready_ms", "ready (model resident)", "#2ca02c"),
)
SWITCH_CORE = ("cold_ms", "warm_pageable_ms", "ready_ms", "pipelined_ms")  # the figure's four categories


@dataclass
class SwitchGroups:
    """A switch result as grouped bars: one group per model, one bar per way that was measured."""
    models: list[str]
    ways: list[tuple[str, str, str]]  # (key, label, colour) present for at least one model
    ms: dict[str, list[float | None]]  # key -> one value per model
    missing: list[str]  # labels of the four core ways this run did not measure


def switch_groups(data: dict) -> SwitchGroups:
    models = [name for name, m in as_dict(data.get("models")).items() if isinstance(m, dict)][:MAX_GROUPS]
    table = {key: [num(data["models"][name].get(key)) for name in models] for key, _, _ in WAYS_SWITCH}
    ways = [w for w in WAYS_SWITCH if any(v is not None for v in table[w[0]])]
    present = {w[0] for w in ways}
    missing = [label for key, label, _ in WAYS_SWITCH if key in SWITCH_CORE and key not in present]
    return SwitchGroups(models, ways, {key: table[key] for key, _, _ in ways}, missing)


CHAR_EM = 0.62  # a label character's width, in ems of its font size (DejaVu Sans: 0.55 to 0.64)
LINE_EM = 1.3  # a label line's height, in ems
MAX_LINES = 4  # a label wrapped to more lines than this is rotated instead


@dataclass(frozen=True)
class Ticks:
    """How an axis's labels fit: wrapped, rotated, or only every ``step``-th shown."""
    labels: list[str]  # "" where a label is thinned out
    rotation: int  # degrees: 0, 45 or 90
    step: int = 1


def tick_layout(labels: list[str], axis_width_in: float, fontsize: float) -> Ticks:
    """Labels that do not overlap on an axis this wide: as they are, else wrapped into their slot, else
    rotated 45 or 90 degrees, else every step-th label (vertical). Widths are estimated, not measured,
    so that the layout is known before drawing."""
    if not labels:
        return Ticks([], 0)
    slot_in = axis_width_in / len(labels)
    char_in, line_in = CHAR_EM * fontsize / 72, LINE_EM * fontsize / 72
    fit = int(slot_in * 0.9 / char_in)  # characters a horizontal label may have per line
    wrapped = ["\n".join(textwrap.fill(line, fit, break_long_words=False) or line for line in label.split("\n"))
               for label in labels] if fit >= 6 else []
    lines = [w.split("\n") for w in wrapped]
    if wrapped and all(len(ls) <= MAX_LINES and max(len(x) for x in ls) <= fit for ls in lines):
        return Ticks(wrapped, 0)
    thickness_in = max(label.count("\n") + 1 for label in labels) * line_in * 1.15
    for angle in (45, 90):  # rotated labels are parallel strips slot·sin(angle) apart
        if slot_in * math.sin(math.radians(angle)) >= thickness_in:
            return Ticks(list(labels), angle)
    step = math.ceil(thickness_in / slot_in)
    return Ticks([label if i % step == 0 else "" for i, label in enumerate(labels)], 90, step)


def set_x_labels(ax, labels: list[str], fontsize: float = 8) -> Ticks:
    """One tick per group, labelled so that the labels never overlap however many there are."""
    width_in = ax.get_position().width * ax.figure.get_figwidth()
    ticks = tick_layout([str(label) for label in labels], width_in, fontsize)
    rotated = {"rotation": ticks.rotation, "ha": "right", "rotation_mode": "anchor"} if ticks.rotation else {}
    ax.set_xticks(range(len(labels)), ticks.labels, fontsize=fontsize, **rotated)
    if ticks.step > 1:
        ax.set_xlabel(f"one group in {ticks.step} labelled, from the left", fontsize=7, color="#555555")
    return ticks


def _grouped_bars(ax, groups: list[str], series: list[tuple[str, list, str | None]], *, log: bool,
                  unit: str = "", label_size: float = 8) -> None:
    """Bars side by side per group, each with its value on top; None (or ≤ 0 on a log axis) draws no bar."""
    n = max(len(series), 1)
    width = 0.8 / n
    rotate = n * len(groups) > 10
    top = 0.0
    for i, (label, values, colour) in enumerate(series):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(groups))]
        pairs = [(x, v) for x, v in zip(xs, values) if v is not None and (v > 0 or not log)]
        if not pairs:
            ax.bar([], [], width, label=label, color=colour)  # keeps the legend entry
            continue
        bars = ax.bar([x for x, _ in pairs], [v for _, v in pairs], width, label=label, color=colour)
        ax.bar_label(bars, labels=[fmt(v) for _, v in pairs], fontsize=6.5, padding=1,
                     rotation=90 if rotate else 0)
        top = max(top, max(v for _, v in pairs))
    set_x_labels(ax, groups, label_size)
    if top <= 0:  # a log axis with nothing on it cannot be drawn at all
        ax.text(0.5, 0.5, "no values to draw in this result", transform=ax.transAxes, ha="center", fontsize=8,
                color="#777777")
    elif log:
        _log_axis(ax)
        ax.set_ylim(top=top * (12 if rotate else 3))
    else:
        ax.set_ylim(0, top * (1.35 if rotate else 1.15))
    if unit:
        ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _log_axis(ax, which: str = "y") -> None:
    """Log scale with plain tick labels (1, 10, 1,000): no TeX, which stays off for text from the results."""
    from matplotlib.ticker import FuncFormatter, NullFormatter
    (ax.set_yscale if which == "y" else ax.set_xscale)("log")
    axis = ax.yaxis if which == "y" else ax.xaxis
    axis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    axis.set_minor_formatter(NullFormatter())


def _panels(fig, n: int, per_row: int = 2) -> list:
    cols = min(n, per_row)
    rows = math.ceil(n / cols)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in axes[n:]:
        ax.set_visible(False)
    return axes[:n]


def _title(ax, text: str) -> None:
    ax.set_title(text, fontsize=8.5)


def _where(r: Result) -> str:
    d = r.data
    device = d.get("device") if isinstance(d.get("device"), str) else d.get("backend")
    return f"{r.source}" + (f" · {short(device)}" if isinstance(device, str) else "")


def _hline(ax, y, label: str, colour: str = "#555555") -> None:
    if num(y) is not None and y > 0:
        ax.axhline(y, color=colour, linestyle="--", linewidth=1, label=label)
        log = ax.get_yscale() == "log"
        ax.set_ylim(top=max(ax.get_ylim()[1], y * (4 if log else 1.2)))  # the line and the legend above it


def draw_switch(fig, results: list[Result]) -> None:
    handles: dict[str, object] = {}
    for ax, r in zip(_panels(fig, len(results)), results):
        g = switch_groups(r.data)
        names = []
        for name in g.models:
            m = r.data["models"][name]
            cop, size = num(m.get("cold_over_pipelined")), num(m.get("model_bytes"))
            names.append(short(name, 30) + (f"\n{size / 1e6:,.0f} MB" if size else "")
                         + (f" · cold ÷ pipelined {cop:,.0f}×" if cop else ""))
        _grouped_bars(ax, names, [(label, g.ms[key], colour) for key, label, colour in g.ways], log=True,
                      unit="ms from request to output ready (log)")
        d = r.data
        shape = ", ".join(p for p in (f"batch {d['batch']}" if "batch" in d else "",
                                      f"{d['input_size']} px" if "input_size" in d else "",
                                      f"{d['seq_len']} tokens" if "seq_len" in d else "") if p)
        _title(ax, f"{_where(r)}\n{shape}" + (f"\nnot measured in this run: {', '.join(g.missing)}"
                                               if g.missing else ""))
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=3, fontsize=7.5, frameon=False)


def _handoff_rows(r: Result) -> list[tuple[str, dict]]:
    d = r.data
    by = as_dict(d.get("by_sessions"))
    rows = [(str(n), as_dict(v)) for n, v in by.items()][:MAX_GROUPS] if by else [(str(d.get("sessions", "?")), d)]
    work = d.get("work_device")
    path, _, carried = r.source.partition("#results.")  # the figure's caption names the files in full
    name = short(carried or PurePosixPath(path).stem, 32)
    return [(f"{short(n, 12)} sessions" + (f", work on {short(work, 12)}" if work not in (None, "none") else "")
             + f"\n{name}", v)
            for n, v in rows]


HANDOFF_SERIES = (("handoff_p50_us", "handoff p50", "#1f77b4"), ("handoff_p99_us", "handoff p99", "#aec7e8"),
                  ("relay_p50_us", "unix relay p50 (no scheduler)", "#ff7f0e"),
                  ("pipe_rtt_p50_us", "pipe ping-pong p50", "#2ca02c"),
                  ("baseline_rtt_p50_us", "raw zmq round trip p50", "#7f7f7f"))


def draw_handoff(fig, results: list[Result]) -> None:
    rows = [row for r in results for row in _handoff_rows(r)]
    ax = fig.subplots()
    series = [(label, [num(v.get(key)) for _, v in rows], colour) for key, label, colour in HANDOFF_SERIES
              if any(num(v.get(key)) is not None for _, v in rows)]
    _grouped_bars(ax, [name for name, _ in rows], series, log=True, unit="µs (log)", label_size=7)
    goals = {num(v.get("goal_p99_us")) for _, v in rows} - {None}
    _hline(ax, min(goals) if goals else 1000.0, "p99 goal")
    _title(ax, "release → next holder's grant, against baselines measured in the same run")
    ax.legend(fontsize=7, ncol=2)


def draw_scale(fig, results: list[Result]) -> None:
    axes = fig.subplots(len(results), 2, squeeze=False)
    for (left, right), r in zip(axes, results):
        d = r.data
        n = f"{d['sessions']:,}" if isinstance(d.get("sessions"), int) else "?"
        hz = num(d.get("status_hz"))
        groups = [("no idle sessions", "handoff_empty"), (f"{n} idle sessions", "handoff_idle"),
                  (f"{n} idle + {fmt(hz) if hz is not None else '?'} status/s", "handoff_status")]
        groups = [(name, key) for name, key in groups if num(d.get(f"{key}_p50_us")) is not None]
        _grouped_bars(left, [name for name, _ in groups],
                      [(p, [num(d.get(f"{key}_{p}_us")) for _, key in groups], c)
                       for p, c in (("p50", "#1f77b4"), ("p99", "#aec7e8"))], log=False, unit="handoff µs")
        left.legend(fontsize=7)
        _title(left, f"{r.source}\nidle CPU {ratio(d.get('idle_cpu_percent'), 2, '%')}, "
                     f"{ratio(d.get('rss_per_session_kb'), 2, ' KB')} and {ratio(d.get('fds_per_session'), 0, '')} "
                     f"fds per session, status {ratio(d.get('status_ms'), 1, ' ms')}")
        steps = sorted((int(k), num(as_dict(v).get("grant_next_us_p50")))
                       for k, v in as_dict(d.get("scheduler")).items() if k.isdigit())
        if not steps:
            steps = sorted((int(k), num(v)) for k, v in as_dict(d.get("scheduler_step_us")).items() if k.isdigit())
        steps = [(k, v) for k, v in steps if v is not None]
        if steps:
            right.plot([k for k, _ in steps], [v for _, v in steps], marker="o")
            for k, v in steps:
                right.annotate(fmt(v), (k, v), textcoords="offset points", xytext=(0, 5), fontsize=7, ha="center")
            _log_axis(right, "x")
            right.set_ylim(0, max(v for _, v in steps) * 1.4)
        right.set_xlabel("sessions waiting", fontsize=8)
        right.set_ylabel("µs per grant (p50)", fontsize=8)
        right.tick_params(labelsize=7)
        right.grid(alpha=0.3)
        _title(right, "the scheduler's grant_next, in process")


def draw_fairness(fig, results: list[Result]) -> None:
    for ax, r in zip(_panels(fig, len(results)), results):
        d = r.data
        weights = d.get("weights") if isinstance(d.get("weights"), list) else []
        n = min(max((len(d[k]) for k in ("asked_share", "measured_share", "daemon_share")
                     if isinstance(d.get(k), list)), default=0), 2 * MAX_GROUPS)
        groups = [f"client {i + 1}" + (f" (weight {fmt(weights[i])})" if i < len(weights) and num(weights[i])
                                       is not None else "") for i in range(n)]

        def pct(key):
            values = d.get(key) if isinstance(d.get(key), list) else []
            return [(num(values[i]) * 100 if i < len(values) and num(values[i]) is not None else None)
                    for i in range(n)]
        _grouped_bars(ax, groups, [("asked", pct("asked_share"), "#7f7f7f"),
                                   ("measured by the clients", pct("measured_share"), "#1f77b4"),
                                   ("the daemon's accounting", pct("daemon_share"), "#ff7f0e")],
                      log=False, unit="% of the device")
        ax.legend(fontsize=7)
        _title(ax, f"{_where(r)}\nmax error {ratio(d.get('max_error_points'), 2, '')} points, "
                   f"quantum {ratio(d.get('quantum_ms'), 0, ' ms')}")


def draw_preempt(fig, results: list[Result]) -> None:
    for ax, r in zip(_panels(fig, len(results)), results):
        d = r.data
        groups = ["token idle\np50", "beside trainer\np50", "p99", "max"]
        values = [num(d.get(k)) for k in ("idle_wait_p50_ms", "inference_wait_p50_ms", "inference_wait_p99_ms",
                                           "inference_wait_max_ms")]
        _grouped_bars(ax, groups, [("inference wait", values, "#1f77b4")], log=True, unit="ms (log)")
        _hline(ax, d.get("training_slice_ms"), "training slice (p99 goal)", "#d62728")
        ax.legend(fontsize=7)
        _title(ax, f"{_where(r)}\ninference request every {ratio(d.get('period_ms'), 0, ' ms')} "
                   "beside a back-to-back trainer")


def draw_enforce(fig, results: list[Result]) -> None:
    for ax, r in zip(_panels(fig, len(results)), results):
        d = r.data
        cases = [("no hog", {"inference_wait_p50_ms": d.get("idle_wait_p50_ms")}),
                 ("launched hog\n(nodeagent run)", as_dict(d.get("launched"))),
                 ("library hog\n(never yields)", as_dict(d.get("library")))]
        series = [(key, [num(c.get(f"inference_wait_{key}_ms")) for _, c in cases], colour)
                  for key, colour in (("p50", "#1f77b4"), ("p99", "#aec7e8"), ("max", "#7f7f7f"))]
        _grouped_bars(ax, [name for name, _ in cases], series, log=True, unit="inference wait, ms (log)")
        _hline(ax, d.get("grace_ms"), "grace period", "#d62728")
        ax.legend(fontsize=7)
        _title(ax, f"{_where(r)}\nan inference request beside a holder that never yields")


def draw_recovery(fig, results: list[Result]) -> None:
    for ax, r in zip(_panels(fig, len(results)), results):
        d = r.data
        bars = [("one round of grants\nbefore the restart", d.get("first_round_s"), "#7f7f7f"),
                ("new daemon answers", d.get("ready_s"), "#ff7f0e"),
                ("every session attached", d.get("reattach_s"), "#1f77b4"),
                ("every session granted", d.get("all_granted_s"), "#aec7e8")]
        bars = [(name, num(v), c) for name, v, c in bars if num(v) is not None]
        shown = ax.barh([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
        ax.bar_label(shown, labels=[f"{b[1]:.2f} s" for b in bars], fontsize=7, padding=2)
        ax.invert_yaxis()
        ax.set_xlabel("seconds after the SIGKILL and restart", fontsize=8)
        ax.tick_params(labelsize=7)
        if bars:
            ax.set_xlim(0, max(b[1] for b in bars) * 1.25)
        _title(ax, f"{_where(r)}\n{d.get('sessions_kept')} of {d.get('sessions')} sessions kept, "
                   f"{d.get('client_errors')} client errors")


def draw_suspend(fig, results: list[Result]) -> None:
    for ax, r in zip(_panels(fig, len(results)), results):
        sizes = [(k, as_dict(v)) for k, v in as_dict(r.data.get("sizes")).items()][:MAX_GROUPS]
        groups = [f"{k} MiB" + (f"\n{num(s.get('speedup')):,.0f}× faster" if num(s.get("speedup")) else "")
                  for k, s in sizes]
        ways = (("suspend_ms", "suspend (park in host memory)", "#1f77b4"), ("resume_ms", "resume", "#aec7e8"),
                ("restart_ms", "restart: save, new process, load", "#d62728"))
        _grouped_bars(ax, groups, [(label, [num(s.get(key)) for _, s in sizes], colour) for key, label, colour in ways],
                      log=True, unit="ms (log)")
        ax.legend(fontsize=7)
        _title(ax, f"{_where(r)}\nparams + grads + Adam state")


def draw_reclaim(fig, results: list[Result]) -> None:
    for ax, r in zip(_panels(fig, len(results)), results):
        d = r.data
        bars = [("no-op round trip", "rtt_ms", None, "#7f7f7f"),
                ("trainer's own park", "park_ms", "park_samples_ms", "#aec7e8"),
                ("cooperative reclaim", "reclaim_cooperative_ms", "reclaim_cooperative_samples_ms", "#1f77b4"),
                ("deadline", "deadline_ms", None, "#ffbb78"),
                ("enforced reclaim\n(SIGSTOP)", "reclaim_enforced_ms", "reclaim_enforced_samples_ms", "#d62728")]
        bars = [b for b in bars if num(d.get(b[1])) is not None and d[b[1]] > 0]
        _grouped_bars(ax, [b[0] for b in bars], [("median", [d[b[1]] for b in bars], None)], log=True, unit="ms (log)",
                      label_size=7)
        for patch, b in zip(ax.patches, bars):
            patch.set_color(b[3])
        for i, b in enumerate(bars):
            samples = [v for v in (d.get(b[2]) if b[2] and isinstance(d.get(b[2]), list) else [])
                       if num(v) is not None and v > 0]
            ax.scatter([i + 0.25] * len(samples), samples, s=8, color="black", zorder=3,
                       label="samples" if samples and i == 2 else None)
        ax.legend(fontsize=7, loc="upper left")
        _title(ax, f"{_where(r)}\n{ratio(d.get('state_mb'), 0, ' MiB')} of training state, "
                   f"{d.get('transport', 'cluster endpoint')}")


def draw_mps(fig, results: list[Result]) -> None:
    for ax, r in zip(_panels(fig, len(results)), results):
        d = r.data
        shares, done = as_dict(d.get("shares")), as_dict(d.get("matmuls"))
        names = [n for n in done if num(done[n]) is not None][:MAX_GROUPS]
        _grouped_bars(ax, [f"{short(n, 20)} ({short(shares.get(n, '?'), 8)}% of SMs)" for n in names],
                      [("matmuls done", [num(done[n]) for n in names], "#1f77b4")], log=False, unit="matmuls")
        _title(ax, f"{r.source}\nMPS split: throughput ratio {ratio(d.get('throughput_ratio'))} "
                   f"(ideal {ratio(d.get('expected_ratio'))})")


LOAD_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def colocate_modes(data: dict) -> dict[str, dict]:
    """A colocate result's modes that ran, as {mode: {load: entry}}, in the order they ran."""
    return {str(name): as_dict(entry.get("loads")) for name, entry in as_dict(data.get("modes")).items()
            if isinstance(entry, dict) and entry.get("status") == "ok"}


def draw_colocate(fig, results: list[Result]) -> None:
    """Per result, per mode: inference p99 ÷ alone (log) and training kept, one bar per load."""
    axes = fig.subplots(len(results), 2, squeeze=False)
    for (left, right), r in zip(axes, results):
        d = r.data
        modes = colocate_modes(d)
        names = [m for m in modes if m != "alone"][:2 * MAX_GROUPS] or list(modes)[:1]
        loads = [str(name) for name in as_dict(d.get("loads"))][:len(LOAD_COLOURS)]

        def series(key: str, scale: float = 1.0):
            return [(short(load, 24), [None if num(as_dict(modes[m].get(load)).get(key)) is None else
                                       num(as_dict(modes[m].get(load)).get(key)) * scale for m in names], colour)
                    for load, colour in zip(loads, LOAD_COLOURS)]
        labels = [short(m, 18).replace("-", "-\n", 1) for m in names]
        _grouped_bars(left, labels, series("p99_over_alone"), log=True, unit="inference p99 ÷ alone (log)",
                      label_size=6.5)
        _hline(left, 1.0, "alone", "#555555")
        _hline(left, 1.10, "goal: 1.10×", "#d62728")
        shown = [v for _, values, _ in series("p99_over_alone") for v in values if v is not None and v > 0]
        left.set_ylim(bottom=min([0.8, *shown]) * 0.8)  # bars grow from below 1, where "alone" is
        left.legend(fontsize=7)
        trainer = as_dict(d.get("trainer"))
        _title(left, f"{_where(r)}\ntrainer {short(trainer.get('model', '?'), 20)} batch "
                     f"{short(trainer.get('batch', '?'), 6)}, {ratio(trainer.get('alone_steps_per_s'), 1, '')} "
                     "steps/s alone")
        _grouped_bars(right, labels, series("kept", 100.0), log=False, unit="training kept, % of alone",
                      label_size=6.5)
        _hline(right, 100.0, "alone", "#555555")
        right.legend(fontsize=7)
        rates = ", ".join(f"{short(name, 12)}: {short(as_dict(v).get('model', '?'), 12)} b"
                          f"{short(as_dict(v).get('batch', '?'), 5)} at {ratio(as_dict(v).get('rate_per_s'), 0, '')}"
                          " req/s" for name, v in list(as_dict(d.get("loads")).items())[:3])
        _title(right, f"per load: {rates}" if rates else "training kept")


_STEP_COLOURS = {"ok": "#2ca02c", "failed": "#d62728", "timeout": "#ff7f0e"}


def draw_gpu_check(fig, results: list[Result]) -> None:
    for ax, r in zip(_panels(fig, len(results)), results):
        steps = [s for s in r.data["steps"] if isinstance(s, dict)][:3 * MAX_GROUPS]
        seconds = [num(s.get("seconds")) or 0.0 for s in steps]
        shown = ax.barh([short(s.get("step", "?"), 20) for s in steps], seconds,
                        color=[_STEP_COLOURS.get(s.get("status"), "#7f7f7f") for s in steps])
        ax.bar_label(shown, labels=[f"{s.get('status')} · {v:.0f} s" for s, v in zip(steps, seconds)], fontsize=7,
                     padding=2)
        ax.invert_yaxis()
        ax.set_xlim(0, max(seconds, default=1) * 1.35 or 1)
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(labelsize=7)
        tests = "; ".join(f"pytest {suite}: {t.get('passed')} of {t.get('tests')} passed"
                          for suite, t in as_dict(r.data.get("pytest")).items() if isinstance(t, dict))
        _title(ax, f"{r.source} · {short(r.data.get('device') or '')}\n{tests}")


SIM_POLICIES = ("max-workers", "fifo", "tiresias", "knapsack", "deadline")
SIM_BUCKETS = ("small", "medium", "large", "xlarge")
SIM_COLOURS = {"max-workers": "#7f7f7f", "fifo": "#d62728", "tiresias": "#ff7f0e", "knapsack": "#1f77b4",
               "deadline": "#2ca02c"}


def sim_means(data: dict) -> dict[str, dict]:
    """A cluster_sim result's runs as {"policy/lend": mean summary}."""
    return {str(name): as_dict(as_dict(entry).get("mean")) for name, entry in as_dict(data.get("runs")).items()}


def sim_policies(means: dict[str, dict]) -> list[str]:
    names = []
    for run in means:
        policy = run.split("/")[0]
        if policy not in names:
            names.append(policy)
    return sorted(names, key=lambda p: (SIM_POLICIES.index(p) if p in SIM_POLICIES else 99, p))[:2 * MAX_GROUPS]


def _legend(ax, **kwargs) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def draw_cluster_sim(fig, results: list[Result]) -> None:
    """Per result: average JCT and queueing per policy, with and without lending; JCT by job size
    with lending; deadlines met and inference wait."""
    grid = fig.subplots(2 * len(results), 2, squeeze=False)
    for k, r in enumerate(results):
        (jct, queue), (sizes, slo) = grid[2 * k], grid[2 * k + 1]
        means = sim_means(r.data)
        policies = sim_policies(means)

        def values(key: str, lend: str, scale: float = 1.0):
            return [None if num(means.get(f"{p}/{lend}", {}).get(key)) is None
                    else num(means[f"{p}/{lend}"][key]) * scale for p in policies]
        modes = [("lending", "lend", "#1f77b4"), ("no lending", "no-lend", "#aec7e8")]
        modes = [m for m in modes if any(f"{p}/{m[1]}" in means for p in policies)]
        _grouped_bars(jct, policies, [(label, values("jct_avg_s", key, 1 / 3600.0), c) for label, key, c in modes],
                      log=False, unit="average JCT, hours")
        _legend(jct, fontsize=7)
        seeds = r.data.get("seeds") if isinstance(r.data.get("seeds"), list) else []
        workload = as_dict(next(iter(as_dict(r.data.get("workload")).values()), {}))
        cluster = as_dict(r.data.get("cluster"))
        _title(jct, f"{r.source}\n{short(workload.get('source', '?'), 60)}; {len(seeds) or 1} seed(s); "
                    f"{short(cluster.get('training_nodes', '?'), 4)}+{short(cluster.get('inference_nodes', '?'), 4)} "
                    f"nodes x {short(cluster.get('gpus_per_node', '?'), 4)} GPUs (training + inference)")
        _grouped_bars(queue, policies, [(label, [v if v and v > 0 else None for v in values("queue_avg_s", key)], c)
                                        for label, key, c in modes], log=True, unit="average queueing, s (log)")
        _legend(queue, fontsize=7)
        _title(queue, "submission to the first worker up")
        lend = "lend" if any(f"{p}/lend" in means for p in policies) else "no-lend"
        buckets = [b for b in SIM_BUCKETS if any(b in as_dict(means.get(f"{p}/{lend}", {}).get("jct_by_bucket_avg_s"))
                                                 for p in policies)]
        _grouped_bars(sizes, buckets, [(p, [num(as_dict(means.get(f"{p}/{lend}", {}).get("jct_by_bucket_avg_s"))
                                                .get(b)) for b in buckets], SIM_COLOURS.get(p)) for p in policies],
                      log=True, unit="average JCT, s (log)")
        _legend(sizes, fontsize=6.5, ncol=2)
        _title(sizes, f"JCT by job size (GPU-hours <1, 1-10, 10-100, >100), {lend}")
        _grouped_bars(slo, policies, [(f"deadlines met, {label}", values("deadlines_met_share", key, 100.0), c)
                                      for label, key, c in modes], log=False, unit="% of SLO jobs")
        slo.set_ylim(0, 115)
        _legend(slo, fontsize=7, loc="lower left")
        waits = ", ".join(f"{p} {fmt(v)}" for p, v in zip(policies, values("inference_wait_p99_ms", "lend"))
                          if v is not None)
        harvest = ", ".join(f"{p} {fmt(v)}" for p, v in zip(policies, values("harvested_gpu_h", "lend"))
                            if v is not None)
        _title(slo, f"inference wait p99 ms (lending): {short(waits, 90)}\nGPU-h harvested: {short(harvest, 90)}")


@dataclass(frozen=True)
class FigureSpec:
    title: str
    draw: Callable
    shape: Callable[[list[Result]], tuple[int, float]]  # (columns of the page: 1 or 2, rows, in halves)


def _paired(results: list[Result]) -> tuple[int, int]:
    return (1, 1) if len(results) == 1 else (2, math.ceil(len(results) / 2))


FIGURES: dict[str, FigureSpec] = {
    "colocate": FigureSpec("Inference beside training on one device: p99 ÷ alone and training kept, per mode",
                           draw_colocate, lambda rs: (2, len(rs))),
    "switch": FigureSpec("Model switch: request for B while A is active → B's output ready", draw_switch,
                         lambda rs: (2, math.ceil(len(rs) / 2) * 1.5)),
    "suspend": FigureSpec("Suspend and resume a training job vs restarting it", draw_suspend, _paired),
    "reclaim": FigureSpec("Reclaim of a lent device through the cluster endpoint", draw_reclaim, _paired),
    "handoff": FigureSpec("Token handoff", draw_handoff,
                          lambda rs: (1 if sum(len(_handoff_rows(r)) for r in rs) <= 3 else 2, 1)),
    "scale": FigureSpec("Idle sessions: what they cost the daemon and the handoff", draw_scale,
                        lambda rs: (2, len(rs))),
    "fairness": FigureSpec("Weighted fair share", draw_fairness, _paired),
    "preempt": FigureSpec("Inference preempting training", draw_preempt, _paired),
    "enforce": FigureSpec("Enforcement on holders that never yield", draw_enforce, _paired),
    "recovery": FigureSpec("Daemon restart: sessions reattached", draw_recovery, _paired),
    "cluster_sim": FigureSpec("Cluster simulation: the controller's policies on a job trace, with and without lending",
                              draw_cluster_sim, lambda rs: (2, 2 * len(rs))),
    MPS: FigureSpec("MPS partition", draw_mps, _paired),
    GPU_CHECK: FigureSpec("scripts/gpu-check.sh steps", draw_gpu_check, _paired),
}


# ------------------------------------------------------------------ output


def _layout(shapes: list[tuple[int, float]]) -> list[tuple[int, int]]:
    """First fit on a two-column grid of half rows: the (half row, column) where each figure starts."""
    taken: set[tuple[int, int]] = set()
    places = []
    for cols, rows in shapes:
        height = math.ceil(rows * 2)
        row = 0
        while True:
            starts = [0] if cols == 2 else [0, 1]
            free = [c for c in starts if all((row + i, c + j) not in taken for i in range(height) for j in range(cols))]
            if free:
                taken.update((row + i, free[0] + j) for i in range(height) for j in range(cols))
                places.append((row, free[0]))
                break
            row += 1
    return places


def _new_figure(width_in: float, height_in: float):
    from matplotlib.figure import Figure  # not pyplot: no global figure registry, nothing to close
    return Figure(figsize=(width_in, height_in), layout="constrained")


def _rgb(fig, dpi: int):
    from PIL import Image  # Pillow comes with matplotlib
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def _png(image) -> bytes:
    """A PNG of 256 colours: a chart has a handful, and the file is a third of full colour's."""
    out = io.BytesIO()
    image.quantize(colors=256, method=0).save(out, "PNG", optimize=True)  # method 0: median cut
    return out.getvalue()


def _page(images: dict, shapes: list[tuple[int, float]], title: str, dpi: int):
    """The figures pasted on one page, first fit on two columns, under a title."""
    from PIL import Image
    banner = _new_figure(2 * COLUMN_IN, 0.45)
    banner.text(0.5, 0.5, short(title, 160), ha="center", va="center", fontsize=12, fontweight="bold")
    top = _rgb(banner, dpi)
    column_px, half_row_px = round(COLUMN_IN * dpi), round(ROW_IN * dpi / 2)
    places = _layout(shapes)
    bottom = max(half_row_px * row + image.height for (row, _), image in zip(places, images.values()))
    page = Image.new("RGB", (2 * column_px, top.height + bottom), "white")
    page.paste(top, (0, 0))
    for image, (row, col) in zip(images.values(), places):
        page.paste(image, (col * column_px, top.height + row * half_row_px))
    return page


@dataclass
class Drawn:
    figures: dict[str, bytes]  # kind -> its own PNG
    page: bytes | None  # every figure on one page; None when there is none
    failed: dict[str, str]  # kind -> why it could not be drawn


def draw_all(kinds: dict[str, list[Result]], page_title: str, dpi: int = 100,
             progress: Callable[[str], None] = lambda message: None) -> Drawn:
    """Each kind's figure as a PNG, and all of them on one page."""
    import time

    import matplotlib
    matplotlib.use("Agg")
    drawn = Drawn({}, None, {})
    images = {}
    with matplotlib.rc_context({"text.parse_math": False}):  # a '$' in a path is text, not TeX
        for kind, results in kinds.items():
            started = time.monotonic()
            cols, rows = FIGURES[kind].shape(results)
            try:
                fig = _new_figure(cols * COLUMN_IN, rows * ROW_IN)
                fig.suptitle(FIGURES[kind].title, fontsize=10, fontweight="bold")
                FIGURES[kind].draw(fig, results)
                images[kind] = _rgb(fig, dpi)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
                # a result with a known name and an unexpected shape: say which, draw the others
                drawn.failed[kind] = f"{type(exc).__name__}: {short(exc, 200)}"
                progress(f"could not draw {kind} ({', '.join(r.source for r in results)}): {drawn.failed[kind]}")
                continue
            drawn.figures[kind] = _png(images[kind])
            progress(f"drew {kind} from {len(results)} result(s) in {time.monotonic() - started:.1f} s")
        if images:
            drawn.page = _png(_page(images, [FIGURES[k].shape(kinds[k]) for k in images], page_title, dpi))
    return drawn
