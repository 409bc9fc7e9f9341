"""Which run a result of bench.report belongs to, and the one run of each measurement a page draws.

A results folder often holds one measurement several times: ``colocate-run1.json`` and
``colocate-run2.json``, ``handoff_sessions_64_run3.json``, or whole copies of a run in
subfolders (``final-tree/``, ``review-tree/``). A measurement (a *series*) is a result's kind
and its file name without folder, extension and run suffix; of each series the page draws one
run, the newest, and lists the others as left out. Pure functions: nothing here reads a file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from bench.report_figures import Result

TOP = "."  # the run label of a file directly in DIR, without a run suffix
_RUN_SUFFIX = re.compile(r"^(?P<stem>.+?)[-_.]?run[-_]?(?P<number>\d+)$", re.IGNORECASE)
_STAMP = re.compile(r"(?<!\d)20\d\d-[01]\d-[0-3]\d(?:[T ][0-2]\d:[0-5]\d(?::[0-5]\d(?:\.\d+)?)?)?")
_STAMP_KEYS = ("date", "started_at", "started", "timestamp", "finished_at")
_VARIANT_SEPARATORS = "-_."


@dataclass(frozen=True)
class RunOf:
    series: str  # the measurement: "handoff-hold0-one-hop", "colocate", "handoff_sessions_64"
    run: str  # "." for DIR's own files, else "final-tree", "run2", "first-contact/run1"
    number: int  # the run suffix's number; 1 without one (the first file written has none)
    depth: int  # folders between DIR and the file
    recorded: str  # the date (and time) the result records, ISO; "" when it records none


def run_of(result: Result) -> RunOf:
    """Series and run of a result, from its path under DIR (and its recorded date)."""
    path, _, carried = result.source.partition("#results.")  # "final-tree/summary.json#results.switch"
    pure = PurePosixPath(path)
    name = carried or pure.stem
    match = _RUN_SUFFIX.match(name)
    series, number = (match.group("stem"), int(match.group("number"))) if match else (name, None)
    folder = pure.parent.as_posix()
    parts = [p for p in (folder if folder != "." else "", f"run{number}" if number is not None else "") if p]
    return RunOf(series, "/".join(parts) or TOP, number if number is not None else 1,
                 0 if folder == "." else len(pure.parent.parts), _recorded(result.data))


def _recorded(data: dict) -> str:
    for key in _STAMP_KEYS:
        match = _STAMP.search(str(data.get(key))) if isinstance(data.get(key), str) else None
        if match:
            return match.group(0).replace(" ", "T")
    return ""


def _newer_key(result: Result) -> tuple:
    r = run_of(result)
    return r.recorded, r.number, -r.depth, result.modified


def _why_newer(chosen: Result, other: Result) -> str:
    """Why ``chosen`` counts as newer than ``other``, in words: the first thing that tells them apart."""
    a, b = run_of(chosen), run_of(other)
    if a.recorded != b.recorded:
        return f"it records {a.recorded}, {other.source} " + (f"{b.recorded}" if b.recorded else "no date")
    if a.number != b.number:
        return f"run {a.number} is the highest run number"
    if a.depth != b.depth:
        return "no date or run number tells them apart; the file nearest DIR's top is drawn"
    if chosen.modified != other.modified:
        return "no date or run number tells them apart; the file modified last is drawn"
    return "nothing tells which is newer; the first by name is drawn"


@dataclass
class LeftOut:
    result: Result
    reason: str


@dataclass
class Choice:
    drawn: list[Result]  # in the order they came, one per series
    left_out: list[LeftOut]
    runs: list[str]  # every run label found, sorted


class NoSuchRun(ValueError):
    def __init__(self, name: str, runs: list[str]):
        super().__init__(f"no run {name!r} under DIR; runs found: {', '.join(runs) or 'none'}")
        self.runs = runs


def choose(results: list[Result], run: str | None = None) -> Choice:
    """One result per series: the newest, or the one in ``run`` (a run label; others are left out)."""
    runs = sorted({run_of(r).run for r in results}, key=lambda label: (label != TOP, label))
    if run is not None:
        run = run.strip("/") or TOP
        if run not in runs:
            raise NoSuchRun(run, runs)
    left_out = [LeftOut(r, f"in run {run_of(r).run}, not the run named with --run {run}")
                for r in results if run is not None and run_of(r).run != run]
    named = [r for r in results if run is None or run_of(r).run == run]
    series: dict[tuple[str, str], list[Result]] = {}
    for r in named:
        series.setdefault((r.kind, run_of(r).series), []).append(r)
    drawn = []
    for r in named:
        group = series[(r.kind, run_of(r).series)]
        newest = sorted(group, key=lambda x: x.source)  # the first by name wins a tie
        newest = max(newest, key=_newer_key)
        if r is newest:
            drawn.append(r)
        else:
            left_out.append(LeftOut(r, f"another run of {r.kind} {run_of(r).series!r}: {newest.source} is drawn "
                                       f"({_why_newer(newest, r)})"))
    return Choice(drawn, left_out, runs)


def related(a: Result, b: Result) -> bool:
    """A result and its variant (``handoff-hold0`` and ``handoff-hold0-one-hop``): drawn together or not at all."""
    x, y = sorted((run_of(a).series, run_of(b).series), key=len)
    return a.kind == b.kind and len(y) > len(x) and y.startswith(x) and y[len(x)] in _VARIANT_SEPARATORS


def in_series_order(results: list[Result]) -> list[Result]:
    """Results of one kind with each variant right after the result it varies."""
    return sorted(results, key=lambda r: (run_of(r).run, run_of(r).series))


def cut(results: list[Result], limit: int) -> tuple[list[Result], list[Result]]:
    """The first ``limit`` results and the rest, moving the cut back so that no pair is split."""
    at = limit
    while 0 < at < len(results) and related(results[at - 1], results[at]):
        at -= 1
    if at == 0:  # one family longer than the limit: it has to be split somewhere
        at = limit
    return results[:at], results[at:]
