"""bench.report: a results folder rendered to report.png, report-<kind>.png and a self-contained report.html."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import subprocess
import sys

import pytest

from bench import report
from bench.report_figures import SWITCH_CORE, _layout, switch_groups
from tests.conftest import REPO

RESULTS = REPO / "bench" / "results"
H100 = RESULTS / "h100-80gb-hbm3-2026-11-23"
CPU = RESULTS / "cpu-2core-2026-11-23"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

needs_matplotlib = pytest.mark.skipif(not report.matplotlib_available(), reason="needs matplotlib (the plot extra)")


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which a valid PNG has first."""
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _self_contained(page: str) -> None:
    sources = re.findall(r"""\bsrc\s*=\s*['"]?([^'" >]*)""", page, flags=re.I)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources), sources[:3]
    for tag in ("<link", "<script", "<iframe", "url(", "@import", "href="):
        assert tag not in page.lower(), tag
    for uri in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page):
        assert base64.b64decode(uri)[:8] == PNG_MAGIC


# ------------------------------------------------------------------ the switch figure's data


def test_switch_groups_put_the_four_categories_side_by_side_for_every_model_of_the_h100_run():
    data = json.loads((H100 / "switch.json").read_text())
    g = switch_groups(data)
    assert g.models == ["resnet50", "bert-base", "resnet152"]
    assert g.missing == []
    for key in SWITCH_CORE:  # cold (stop-and-start), warm, ready, pipelined
        assert len(g.ms[key]) == 3 and all(v is not None and v > 0 for v in g.ms[key]), key
    for i, name in enumerate(g.models):
        for key in g.ms:
            assert g.ms[key][i] == data["models"][name][key]
    keys = [key for key, _, _ in g.ways]
    assert keys == ["cold_ms", "warm_pageable_ms", "pinned_sync_ms", "sequential_ms", "pipelined_ms", "ready_ms"]
    assert "stop-and-start" in g.ways[0][1]


def test_switch_groups_name_a_category_the_run_did_not_measure():
    g = switch_groups(json.loads((RESULTS / "cpu-2core-2026-11-22" / "switch.json").read_text()))
    assert [key for key, _, _ in g.ways] == ["cold_ms", "sequential_ms", "pipelined_ms", "ready_ms"]
    assert g.missing == ["warm process, pageable copy"]
    assert "warm_pageable_ms" not in g.ms


def test_switch_groups_take_what_is_there_from_a_result_of_the_wrong_shape():
    g = switch_groups({"benchmark": "switch", "models": {"a": {"cold_ms": "slow", "ready_ms": 2, "pipelined_ms": True},
                                                        "b": [1, 2], "c": {"ready_ms": float("nan")}}})
    assert g.models == ["a", "c"]
    assert g.ms == {"ready_ms": [2.0, None]}
    assert len(g.missing) == 3


def test_layout_fills_the_hole_a_full_width_figure_leaves():
    # half rows: a full-width figure 1 row high, a half, a full-width 1.5 rows high, another half
    assert _layout([(2, 1), (1, 1), (2, 1.5), (1, 1)]) == [(0, 0), (2, 0), (4, 0), (2, 1)]


# ------------------------------------------------------------------ whole folders


@pytest.fixture(scope="module")
def h100_report(tmp_path_factory):
    """The committed H100 folder, copied, rendered once in this process (its report/ left out)."""
    if not report.matplotlib_available():
        pytest.skip("needs matplotlib (the plot extra)")
    results = tmp_path_factory.mktemp("h100") / H100.name
    shutil.copytree(H100, results, ignore=shutil.ignore_patterns("report"))
    out = results / "report"  # inside DIR, as the committed renders are
    assert report.main([str(results), "--out", str(out)]) == 0
    return out


@pytest.mark.slow  # the fixture renders the folder: 4 to 8 s on 2 shared cores
def test_h100_folder_renders_a_self_contained_page(h100_report):
    page = (h100_report / "report.html").read_text()
    _self_contained(page)
    kinds = ["switch", "suspend", "reclaim", "handoff", "mps", "gpu-check"]
    assert page.count("data:image/png;base64,") == len(kinds)
    for kind in kinds:
        png = (h100_report / f"report-{kind}.png").read_bytes()
        width, height = _png_size(png)
        assert len(png) > 5_000 and width >= 700 and height >= 400, kind
    full = (h100_report / "report.png").read_bytes()
    width, height = _png_size(full)
    assert len(full) > 40_000 and width == 1500 and height > 1500  # dpi 100: two 7.5-inch columns
    assert len(full) < 400_000  # small enough to attach


@pytest.mark.slow
def test_h100_page_header_and_headline_ratios_come_from_the_results(h100_report):
    page = (h100_report / "report.html").read_text()
    header = page[:page.index("<h2>")]
    assert "NVIDIA H100 80GB HBM3" in header and "driver 580.159.04" in header and "2026-11-23" in header
    assert "(from the folder" not in header  # gpu-check's tag carries the date
    # 448.51 in switch.json; the field it comes from is the tooltip
    assert "<td title='cold_over_pipelined'>resnet50: cold ÷ pipelined</td><td>449×</td>" in page
    assert "<td>256 MiB: restart ÷ (suspend + resume)</td><td>732×</td><td>≥ 100×</td>" in page
    assert ("<td title='ratio_pipe_p50'>handoff p50 ÷ pipe ping-pong p50 (8 sessions)</td><td>10.9</td>"
            "<td>≤ 2.5</td><td><span class='missed'>no</span>") in page
    # summary.json carries copies of switch.json etc.: drawn once, and the page says so
    assert "summary.json#results.switch</code>: the same result as switch.json, drawn once" in page
    # first-contact/switch-run1.json is an earlier run of the same measurement
    assert ("<figcaption>model switch, drawn from switch.json; left out: first-contact/switch-run1.json "
            "(why: under Files)</figcaption>") in page


@pytest.mark.slow
@needs_matplotlib
def test_cli_renders_the_cpu_folder_with_progress_on_stderr(tmp_path):
    results = tmp_path / CPU.name
    shutil.copytree(CPU, results, ignore=shutil.ignore_patterns("report"))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "bench.report", str(results), "--out", str(out), "--dpi", "50"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)  # dpi 50: what is drawn, cheaper
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    assert "[report] drew handoff" in run.stderr and "[report] drew scale" in run.stderr
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report-handoff.png", "report-scale.png", "report.html",
                                                     "report.png"]
    page = (out / "report.html").read_text()
    _self_contained(page)
    assert "<td>2026-11-23 (from the folder&#x27;s name)</td>" in page  # no date inside these two files
    assert "<td>cpu backend, no device named in these results</td>" in page


# ------------------------------------------------------------------ what is not a result


@needs_matplotlib
def test_malformed_and_unknown_json_are_named_and_the_rest_is_drawn(tmp_path, capsys):
    results = tmp_path / "results"
    (results / "notes").mkdir(parents=True)
    shutil.copy(CPU / "handoff.json", results / "handoff.json")
    (results / "broken.json").write_text('{"benchmark": "switch", "models": {')
    (results / "empty.json").write_text("")
    (results / "binary.json").write_bytes(b"\xff\xfe\x00\x01")
    (results / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (results / "notes" / "other.json").write_text('{"hello": 1}')
    (results / "list.json").write_text("[1, 2]")
    (results / "future.json").write_text('{"benchmark": "teleport", "p50_ms": 1}')
    out = tmp_path / "out"
    assert report.main([str(results), "--out", str(out), "--dpi", "50"]) == 0
    err = capsys.readouterr().err
    for name in ("broken.json", "empty.json", "binary.json", "deep.json"):
        lines = [line for line in err.splitlines() if name in line]
        assert len(lines) == 1 and lines[0].startswith(f"[report] skipped {name}: not readable JSON"), lines
    assert "Traceback" not in err
    page = (out / "report.html").read_text()
    for name in ("broken.json", "empty.json", "binary.json", "deep.json"):
        assert f"<code>{name}</code>: malformed, skipped" in page
    assert "<code>notes/other.json</code>: not rendered" in page
    assert "<code>list.json</code>: not rendered: a JSON list, not an object" in page
    assert "<code>future.json</code>: not rendered: benchmark &#x27;teleport&#x27; has no figure" in page
    assert (out / "report-handoff.png").read_bytes()[:8] == PNG_MAGIC
    assert page.count("data:image/png;base64,") == 1


@needs_matplotlib
def test_a_folder_with_nothing_to_draw_exits_1_and_still_lists_what_it_found(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "x.json").write_text('{"hello": 1}')
    (results / "y.json").write_text("{")
    out = tmp_path / "out"
    assert report.main([str(results), "--out", str(out)]) == 1
    page = (out / "report.html").read_text()
    assert "<code>x.json</code>: not rendered" in page and "<code>y.json</code>: malformed" in page
    assert not (out / "report.png").exists()


_WRONG = {"models": {"m": {"cold_ms": "x", "ready_ms": -1, "pipelined_ms": 1e308 * 10}, "n": 5}, "sizes": [1],
          "by_sessions": {"2": "x", "64": {"handoff_p50_us": "fast"}}, "goals": [1, {"goal": None}],
          "scheduler": {"10": "x", "ten": {}}, "scheduler_step_us": {"10": None}, "weights": ["a", None],
          "asked_share": "all", "measured_share": [0.5, "x"], "launched": [], "library": {"inference_wait_p99_ms": {}},
          "sessions": {"n": 1}, "reattach_s": None, "deadline_ms": -5, "reclaim_enforced_samples_ms": [1, "x", None],
          "device": "<script>alert(1)</script> $x^{2 \\frac", "backend": ["cpu"], "status_hz": [20],
          "batch": {"b": 1}, "training_slice_ms": "long", "grace_ms": float("inf")}


@pytest.mark.slow
@needs_matplotlib
def test_results_of_every_kind_with_fields_of_the_wrong_type_never_crash_the_report(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    for kind in report.BENCHMARKS:
        (results / f"{kind}.json").write_text(json.dumps({"benchmark": kind, **_WRONG}))
    (results / "summary.json").write_text(json.dumps(
        {"steps": [1, {"step": 5, "seconds": "x", "status": None}], "results": {"switch": None, "x": [1]},
         "pytest": {"gpu": "x"}, "device": {"a": 1}, "tag": 7}))
    (results / "mps.json").write_text(json.dumps({"throughput_ratio": 2, "matmuls": {"a": "x", "b": 3}, "shares": 4}))
    out = tmp_path / "out"
    # dpi 50: every kind's figure is drawn as at 100 (the same code, fewer pixels to render)
    assert report.main([str(results), "--out", str(out), "--dpi", "50"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    page = (out / "report.html").read_text()
    _self_contained(page)
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    drawn = {p.name[len("report-"):-len(".png")] for p in out.glob("report-*.png")}
    assert drawn == {*report.BENCHMARKS, "gpu-check", "mps"}  # all drawn, with what could be read


@needs_matplotlib
def test_a_kind_draws_its_first_results_and_lists_the_others(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for i in range(report.MAX_PER_KIND + 2):
        shutil.copy(H100 / "mps_30_70.json", results / f"mps_{i:02d}.json")
    out = tmp_path / "out"
    assert report.main([str(results), "--out", str(out), "--dpi", "50"]) == 0
    page = (out / "report.html").read_text()
    assert page.count(": left out: mps draws at most 8 results") == 2
    assert "<code>mps_09.json</code>: left out" in page and "<code>mps_07.json</code>: left" not in page
    assert page.count("throughput ratio of the 30/70 split") == report.MAX_PER_KIND


def test_without_matplotlib_it_says_in_one_line_how_to_install_it(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None  # an import of it now fails as if it were not installed\n"
            "from bench import report; sys.exit(report.main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, str(CPU), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "pip install 'nodeagent[plot]'" in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()
    helped = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=60,
                            cwd=REPO)
    assert helped.returncode == 0 and "--out OUT" in helped.stdout and "report.html" in helped.stdout


def test_bad_arguments_are_one_usage_error(tmp_path):
    for argv in ([str(tmp_path / "missing"), "--out", str(tmp_path / "o")], [str(CPU)],
                 [str(CPU), "--out", str(tmp_path / "o"), "--dpi", "5"]):
        with pytest.raises(SystemExit) as exited:
            report.main(argv)
        assert exited.value.code == 2


# ------------------------------------------------------------------ one run per page (issue 24)

H100_RUNS = RESULTS / "h100-80gb-hbm3-2026-11-23b"  # the top level, final-tree/ and review-tree/: three runs


def _selected(root, run=None) -> report.Collection:
    collection = report.collect(root)
    report.select(collection, run)
    return collection


def _by_kind(collection) -> dict[str, list[str]]:
    return {kind: [r.source for r in results] for kind, results in collection.by_kind().items()}


def test_a_folder_of_three_runs_draws_each_measurement_once_from_the_newest_and_names_the_others():
    collection = _selected(H100_RUNS)
    assert collection.runs == [".", "final-tree", "review-tree"]
    drawn = _by_kind(collection)
    assert drawn["handoff"] == ["handoff.json", "handoff-hold0.json", "handoff-hold0-one-hop.json",
                                "handoff-hold200.json", "handoff-hold200-one-hop.json"]
    for kind in ("switch", "suspend", "reclaim", "mps", "gpu-check"):
        assert len(drawn[kind]) == 1 and "/" not in drawn[kind][0], drawn[kind]
    left = {o.result.source: o.reason for o in collection.left_out}
    for tree in ("final-tree", "review-tree"):
        assert f"{tree}/summary.json" in left and f"{tree}/handoff-hold0-one-hop.json" in left
    assert "handoff-hold0-one-hop.json is drawn" in left["review-tree/handoff-hold0-one-hop.json"]
    assert "nearest DIR's top" in left["review-tree/handoff-hold0-one-hop.json"]  # nothing else tells them apart
    # every file and every result a summary carries is counted once
    line = report.tally(collection)
    assert line.startswith("21 JSON files and 26 results inside gpu-check summaries: 10 results drawn, 19 left out")
    assert sum(int(n) for n in re.findall(r"(?:: |, )(\d+) ", line)) == 21 + 26
    headline_sources = {h.source for rs in collection.by_kind().values() for r in rs for h in report.headlines(r)}
    assert not any(s.startswith(("final-tree/", "review-tree/")) for s in headline_sources)


def test_the_newest_run_is_the_one_whose_result_records_the_later_time_or_the_higher_run_number():
    colocate = _selected(RESULTS / "h100-80gb-hbm3-2026-11-27")
    assert _by_kind(colocate)["colocate"] == ["colocate-run2.json"]  # 04:52 against run 1's 04:23
    (reason,) = [o.reason for o in colocate.left_out if o.result.source == "colocate-run1.json"]
    assert "it records 2026-11-27T04:52:54, colocate-run1.json 2026-11-27T04:23:01" in reason
    handoff = _selected(RESULTS / "cpu-2core-2026-11-21")
    # the 64-session runs are one measurement, the 2-session run another: both are drawn
    assert _by_kind(handoff)["handoff"] == ["handoff_sessions_2.json", "handoff_sessions_64_run3.json"]
    assert sorted(o.result.source for o in handoff.left_out) == ["handoff_sessions_64.json",
                                                                 "handoff_sessions_64_run2.json"]


def test_a_run_named_with_run_is_drawn_and_an_unknown_name_lists_the_runs(tmp_path, capsys):
    named = _selected(H100_RUNS, "review-tree/")
    assert {s.split("/")[0] for sources in _by_kind(named).values() for s in sources} == {"review-tree"}
    assert "summary.json" in {o.result.source for o in named.left_out}
    runs = _selected(RESULTS / "cpu-2core-2026-11-21", "run2")
    assert _by_kind(runs) == {"handoff": ["handoff_sessions_64_run2.json"]}
    with pytest.raises(SystemExit) as exited:
        report.main([str(H100_RUNS), "--out", str(tmp_path / "out"), "--run", "nightly"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "no run 'nightly' under DIR; runs found: ., final-tree, review-tree" in err
    assert not (tmp_path / "out").exists()


def _mps(path, ratio_value: float = 2.2) -> None:
    data = json.loads((H100 / "mps_30_70.json").read_text())
    data["throughput_ratio"] = ratio_value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_the_figure_limit_never_splits_a_result_from_its_variant(tmp_path):
    _mps(tmp_path / "mps.json")
    for i in range(4):  # after mps.json: a0, a0-one-hop, a1, ...; the 8th and 9th are a pair
        _mps(tmp_path / f"mps-a{i}.json")
        _mps(tmp_path / f"mps-a{i}-one-hop.json")
    collection = _selected(tmp_path)
    drawn = _by_kind(collection)["mps"]
    assert len(drawn) == 7 and "mps-a3.json" not in drawn
    for i in range(3):
        assert drawn.index(f"mps-a{i}-one-hop.json") == drawn.index(f"mps-a{i}.json") + 1
    assert sorted(o.result.source for o in collection.left_out) == ["mps-a3-one-hop.json", "mps-a3.json"]


@needs_matplotlib
def test_stderr_and_the_page_count_the_same_files_the_same_way(tmp_path, capsys):
    results = tmp_path / "results"
    _mps(results / "mps-run1.json", 2.0)
    _mps(results / "mps-run2.json", 2.1)
    (results / "broken.json").write_text("{")
    (results / "other.json").write_text('{"hello": 1}')
    out = tmp_path / "out"
    assert report.main([str(results), "--out", str(out), "--dpi", "50"]) == 0
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "JSON files:" in line]
    on_stderr = line.removeprefix("[report] ").split(" (under ")[0]
    page = (out / "report.html").read_text()
    on_page = html.unescape(re.search(r"<td class='tally'>(.*?)</td>", page).group(1))
    assert on_stderr == on_page == ("4 JSON files: 1 result drawn, 1 left out (other runs, or over a figure's "
                                    "limit), 1 not rendered, 1 malformed")
    assert "<figcaption>MPS partition, drawn from mps-run2.json; left out: mps-run1.json" in page
    assert "2 runs (run1, run2): of each measurement the newest run is drawn" in page
    assert report._runs_text(_selected(CPU)) == ("results from ., one-hop: each measurement ran once, all are "
                                                 "drawn; name one run with --run NAME")


def test_every_missed_goal_says_in_words_which_goal_what_value_and_what_target():
    rows = report.headlines(report.Result("handoff", "handoff.json", {"benchmark": "handoff", "goals": [
        {"goal": "ratio_pipe_p50 <= 2.5", "sessions": 64, "value": 10.9, "met": False},
        {"goal": "handoff_p99_us < 1000", "sessions": 64, "value": 812.0, "met": True}]}))
    missed, met = rows
    assert missed.what == "handoff p50 ÷ pipe ping-pong p50 (64 sessions)" and missed.field == "ratio_pipe_p50"
    cell = report._met_cell(missed)
    assert cell.startswith("<span class='missed'>no</span>: ")
    assert "handoff p50 ÷ pipe ping-pong p50 (64 sessions) is 10.9; the goal is ≤ 2.5" in cell
    assert report._met_cell(met) == "<span class='met'>yes</span>"
    check = report.headlines(report.Result("gpu-check", "summary.json", {"ok": False, "results": {}, "steps": [
        {"step": "wheels", "status": "ok"}, {"step": "switch", "status": "timeout"}]}))
    assert check[-1].missed() == "steps not ok: switch (timeout); the goal is every step ok"


@pytest.mark.slow
def test_h100_page_explains_every_red_mark_and_names_its_columns_in_words(h100_report):
    page = (h100_report / "report.html").read_text()
    marks = page.count("<span class='missed'>no</span>")
    assert marks >= 1 and len(re.findall(r"<span class='missed'>no</span>: <span class='why'>[^<]*the goal is "
                                         r"[^<]+</span>", page)) == marks
    table = page[page.index("<h2>Headline ratios"):page.index("<h2>Figures")]
    assert "<th>measure</th>" in table and "<th>goal met?</th>" in table and "<th>what</th>" not in table
    visible = re.sub(r"title='[^']*'", "", table)
    assert "ratio_pipe_p50" in table and "ratio_pipe_p50" not in visible  # a tooltip, not the words shown
    assert ">gpu-check<" not in visible and ">GPU check (scripts/gpu-check.sh)<" in visible


# ------------------------------------------------------------------ readable axes at any count

def _handoff(sessions: list[int], name: str) -> report.Result:
    rows = {str(n): {"handoff_p50_us": 100.0 + n, "handoff_p99_us": 300.0 + n, "pipe_rtt_p50_us": 20.0}
            for n in sessions}
    return report.Result("handoff", f"one-hop/{name}.json", {"benchmark": "handoff", "by_sessions": rows,
                                                             "work_device": "cuda"})


def _overlapping_labels(ax, renderer) -> list[tuple[str, str]]:
    """Neighbouring x labels whose text overlaps: boxes for level labels; for rotated ones (parallel strips,
    whose boxes overlap anyway) the strips' distance against the text's own height."""
    import math
    shown = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    found = []
    for a, b in zip(shown, shown[1:]):
        angle = a.get_rotation()
        if angle == 0:
            clash = a.get_window_extent(renderer).overlaps(b.get_window_extent(renderer))
        else:
            a.set_rotation(0)
            thickness = a.get_window_extent(renderer).height
            a.set_rotation(angle)
            xa, xb = (ax.transData.transform((t.get_position()[0], 0))[0] for t in (a, b))
            clash = (xb - xa) * math.sin(math.radians(angle)) < thickness
        if clash:
            found.append((a.get_text(), b.get_text()))
    return found


@needs_matplotlib
@pytest.mark.parametrize("counts", [(8, 7), (8, 8, 8)])  # 15 labels (the handoff figure), then 24
def test_the_handoff_figure_labels_never_overlap(counts):
    import matplotlib
    matplotlib.use("Agg")
    from bench.report_figures import COLUMN_IN, FIGURES, ROW_IN, _new_figure
    results = [_handoff(list(range(2, 2 + n)), f"handoff-hold{200 * i}-one-hop") for i, n in enumerate(counts)]
    cols, rows = FIGURES["handoff"].shape(results)
    fig = _new_figure(cols * COLUMN_IN, rows * ROW_IN)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    with matplotlib.rc_context({"text.parse_math": False}):
        FIGURES["handoff"].draw(fig, results)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        (ax,) = fig.axes
        shown = [t for t in ax.get_xticklabels() if t.get_text()]
        assert len(shown) >= sum(counts) // 3  # thinned at most to one in three
        assert _overlapping_labels(ax, canvas.get_renderer()) == []


def test_tick_layout_keeps_short_labels_and_rotates_or_thins_crowded_ones():
    from bench.report_figures import tick_layout
    assert tick_layout(["a", "b", "c"], 6.0, 8).labels == ["a", "b", "c"]
    assert tick_layout(["a", "b", "c"], 6.0, 8).rotation == 0
    wrapped = tick_layout(["64 sessions, work on cuda", "2 sessions, work on cuda"], 3.0, 8)
    assert wrapped.rotation == 0 and all("\n" in label for label in wrapped.labels)
    crowded = tick_layout([f"{n} sessions, work on cuda\nhandoff-hold200-one-hop" for n in range(15)], 11.0, 7)
    assert crowded.rotation in (45, 90) and crowded.step == 1  # 15 labels: rotated, all shown
    many = tick_layout([f"{n} sessions\nhandoff-hold200-one-hop" for n in range(60)], 5.0, 7)
    assert many.rotation == 90 and many.step > 1
    assert [label for label in many.labels if label] == many.labels[::many.step]
