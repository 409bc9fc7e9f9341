"""bench.colocate on the cpu: an inference service beside a trainer in every mode this machine can run,
with real processes (the driver, its two workers per mode, its own daemons)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench import colocate
from bench.colocate_worker import poisson_arrivals, serve_phase
from tests.conftest import REPO

LOAD_FIELDS = {"p50_ms", "p99_ms", "max_ms", "mean_ms", "p50_over_alone", "p99_over_alone", "service_p50_ms",
               "service_p99_ms", "offered", "completed", "dropped", "queued_at_end", "latency_ms", "steps",
               "steps_per_s", "kept", "system_throughput"}
TOP_FIELDS = {"benchmark", "backend", "device", "date", "hostname", "cpu_count", "python", "parameters", "trainer",
              "loads", "default_mode", "modes_asked", "modes", "skipped", "failed", "interrupted", "elapsed_s"}
CPU_ARGS = ["--device", "cpu", "--loads", "light=tiny-cnn:4:0.3,bert=tiny-bert:2:0.3", "--phase-s", "0.6",
            "--trainer", "tiny-gpt:8", "--seq-len", "16"]


def _bench(*args: str, timeout: float = 110) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.colocate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_run():
    pytest.importorskip("torch")
    started = time.monotonic()
    run = _bench(*CPU_ARGS, "--modes", "no-daemon,mps,mps-priority,corun-mps,exclusive,corun", "--json")
    return run, time.monotonic() - started


@pytest.mark.slow  # the driver starts two torch processes per mode: about 40 s on 2 cores
def test_the_cpu_run_prints_one_json_object_with_every_field_for_every_mode_it_ran(cpu_run):
    run, seconds = cpu_run
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("\n") == 1  # exactly one object, one line
    r = json.loads(run.stdout)
    assert TOP_FIELDS <= set(r) and r["benchmark"] == "colocate" and r["backend"] == "cpu"
    assert r["device"].startswith("cpu") and not r["failed"] and not r["interrupted"]
    assert r["modes_asked"] == ["alone", "no-daemon", "mps", "mps-priority", "corun-mps", "exclusive", "corun"]
    ran = [m for m, e in r["modes"].items() if e["status"] == "ok"]
    assert ran == ["alone", "no-daemon", "exclusive", "corun"]
    assert r["trainer"]["alone_steps_per_s"] > 0
    for name, load in r["loads"].items():
        assert load["alone_service_ms"] > 0 and load["rate_per_s"] == pytest.approx(
            load["rate_fraction"] * load["capacity_per_s"], rel=0.01)
    for mode in ran:
        entry = r["modes"][mode]
        assert entry["seconds"] > 0 and entry["setup"], mode
        assert set(entry["loads"]) == set(r["loads"]), mode
        for name, e in entry["loads"].items():
            assert LOAD_FIELDS <= set(e), (mode, name)
            assert e["completed"] + e["dropped"] == e["offered"] > 0, (mode, name)
            assert len(e["latency_ms"]) == e["completed"]
            assert 0 < e["p50_ms"] <= e["p99_ms"] <= e["max_ms"], (mode, name)
            assert e["p99_over_alone"] == pytest.approx(e["p99_ms"] / r["modes"]["alone"]["loads"][name]["p99_ms"],
                                                        rel=0.01)
            if mode == "alone":
                assert e["kept"] is None and e["system_throughput"] is None
                continue
            assert e["steps"] > 0 and e["kept"] == pytest.approx(e["steps_per_s"] / r["trainer"]["alone_steps_per_s"],
                                                                 rel=0.01)
            assert e["system_throughput"] == pytest.approx(e["completed"] / e["offered"] + e["kept"], abs=0.002)
            if mode in ("exclusive", "corun"):  # the daemon's own count of what happened in the phase
                assert e["daemon"]["grants"] > 0, (mode, name)
    assert r["modes"]["corun"]["pacer"]["points"] > 0  # the trainer ran with a Pacer attached
    assert "--sharing exclusive" in r["modes"]["exclusive"]["setup"]
    assert "--sharing corun --corun-duty adaptive" in r["modes"]["corun"]["setup"]
    assert seconds < 60


@pytest.mark.slow
def test_cuda_only_modes_are_skipped_on_the_cpu_with_the_reason(cpu_run):
    r = json.loads(cpu_run[0].stdout)
    for mode in ("mps", "mps-priority", "corun-mps"):
        assert r["skipped"][mode] == "needs cuda (MPS); this run is on cpu"
        assert r["modes"][mode] == {"status": "skipped", "reason": r["skipped"][mode]}
    table = cpu_run[0].stderr
    assert "mps-priority      skipped: needs cuda (MPS)" in table and "p99/alone" in table


def test_unknown_modes_are_refused_in_one_line_naming_the_valid_ones():
    run = _bench("--modes", "alone,turbo,corun", timeout=30)
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown mode(s) turbo" in lines[0]
    assert "valid: " + ", ".join(colocate.MODES) in lines[0]


@pytest.mark.parametrize("loads, words", [("light=resnet50:8", "is not NAME=MODEL:BATCH:FRACTION"),
                                          ("light=vgg:8:0.3", "unknown model 'vgg'"),
                                          ("light=resnet50:0:0.3", "batch must be >= 1"),
                                          ("a=tiny-cnn:1:0.3,a=tiny-cnn:2:0.3", "each name once")])
def test_bad_loads_are_refused_in_one_line(loads, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        colocate.main(["--loads", loads])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "--loads" in lines[0]


def test_help_explains_every_option_and_every_mode():
    run = _bench("--help", timeout=30)
    assert run.returncode == 0
    for option in ("--json", "--device", "--modes", "--loads", "--trainer", "--phase-s", "--settle-s", "--input-size",
                   "--seq-len", "--max-backlog", "--threads", "--seed"):
        assert option in run.stdout, option
    for mode in colocate.MODES.values():
        assert f"  {mode.name} " in run.stdout and mode.what[:40] in " ".join(run.stdout.split())
    assert "--worker" not in run.stdout  # the driver's own business


def test_the_driver_knows_every_model_bench_models_builds():
    models = pytest.importorskip("bench.models")
    assert set(colocate.MODEL_NAMES) == set(models.MODELS)


def test_a_full_backlog_drops_arrivals_and_counts_them():
    now = time.monotonic_ns()
    burst = [now - 1000] * 30  # thirty requests, all due at once

    def request():  # 1 ms of work
        until = time.monotonic_ns() + 1_000_000
        while time.monotonic_ns() < until:
            pass
    result = serve_phase(request, burst, end_ns=now + 10**9, max_backlog=8)
    assert (result["offered"], result["completed"], result["dropped"]) == (30, 8, 22)
    assert result["latency_ms"] == sorted(result["latency_ms"])  # first come, first served: each waited longer
    assert result["latency_ms"][-1] >= 8 * 1.0 and all(s >= 1.0 for s in result["service_ms"])


def test_arrivals_are_the_same_for_a_seed_and_come_at_the_rate_asked():
    a = poisson_arrivals(200.0, seed=7, start_ns=0, end_ns=10 * 10**9)
    assert a == poisson_arrivals(200.0, seed=7, start_ns=0, end_ns=10 * 10**9)
    assert a != poisson_arrivals(200.0, seed=8, start_ns=0, end_ns=10 * 10**9)
    assert 1900 < len(a) < 2100 and a == sorted(a) and 0 < a[0] and a[-1] < 10 * 10**9


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _sigint_as_at_a_terminal() -> None:
    """Ctrl-C as a user's shell delivers it: a suite started in the background by a
    non-interactive shell ignores SIGINT, and a child would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow
def test_a_killed_child_fails_its_mode_in_one_line_the_next_mode_runs_and_ctrl_c_stops_everything():
    pytest.importorskip("torch")
    driver = subprocess.Popen([sys.executable, "-m", "bench.colocate", *CPU_ARGS, "--loads", "light=tiny-cnn:4:0.3",
                               "--modes", "no-daemon,corun-pause,corun-free", "--json"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=_sigint_as_at_a_terminal)
    started: set[int] = set()
    err = []
    try:
        # Each mode's header is printed before its processes start, and a phase lasts
        # --phase-s once they are up: the test acts on the processes it sees, polled from
        # the header on, never on a later line it might read after the phase ended.
        def wait_for_children(pred) -> list[int]:
            deadline = time.monotonic() + 60
            while driver.poll() is None and time.monotonic() < deadline:
                kids = _children_of(driver.pid)
                started.update(kids)
                if pred(kids):
                    return kids
                time.sleep(0.005)
            pytest.fail("the driver exited or its processes never came up:\n" + "".join(err))

        for line in driver.stderr:
            err.append(line)
            started.update(_children_of(driver.pid))
            if line.startswith("[colocate] no-daemon:"):  # kill its trainer as soon as it exists
                kids = wait_for_children(lambda kids: any("--worker trainer" in _cmdline(p) for p in kids))
                os.kill(next(p for p in kids if "--worker trainer" in _cmdline(p)), signal.SIGKILL)
            if line.startswith("[colocate] corun-free:"):  # Ctrl-C once its daemon and both workers are up
                # (alive, by command line: the last mode's processes may linger as zombies a moment)
                wait_for_children(lambda kids: all(any(role in _cmdline(p) and _alive(p) for p in kids)
                                                   for role in ("--worker trainer", "--worker inference", " serve ")))
                driver.send_signal(signal.SIGINT)
                break
        out, rest = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    err = "".join(err) + rest
    assert driver.returncode == 130, err[-3000:]
    r = json.loads(out)
    assert r["interrupted"] and list(r["modes"]) == ["alone", "no-daemon", "corun-pause"]
    assert r["failed"] == {"no-daemon": r["modes"]["no-daemon"]["error"]}
    assert r["failed"]["no-daemon"].startswith("trainer exited -9: ")
    assert f"[colocate] no-daemon failed: {r['failed']['no-daemon']}\n" in err  # one line
    assert r["modes"]["corun-pause"]["status"] == "ok" and "--corun-duty pause" in r["modes"]["corun-pause"]["setup"]
    assert "interrupted: everything started was stopped" in err
    assert len(started) >= 8  # two workers per mode, daemons of two modes
    assert not [p for p in started if _alive(p)], [(_cmdline(p)) for p in started if _alive(p)]


def test_a_child_interrupted_while_its_readers_start_is_still_stopped():
    """A Ctrl-C can land inside Child.__init__'s Thread.start(), after the child is in LIVE: closing
    it then must stop its process and not fail on the reader that never started (it did, in a full
    run: 'cannot join thread before it is started', the driver exited 1 and not 130)."""
    import threading

    child = colocate.Child.__new__(colocate.Child)
    child.mode, child.role = "no-daemon", "trainer"
    child.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE,
                                  text=True)
    child._threads = [threading.Thread(target=lambda: None)]  # never started
    colocate.LIVE.add(child)
    try:
        colocate.close_live()
        assert child.proc.poll() is not None and child not in colocate.LIVE
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait()
        colocate.LIVE.discard(child)


# ------------------------------------------------------------------ bench.report


def _result(backend: str = "cuda") -> dict:
    """A colocate result shaped as the bench writes it, with the issue's H100 numbers (not a measurement)."""
    def load(p99, kept, alone_p99, dropped=0):
        return {"p50_ms": p99 / 3, "p99_ms": p99, "max_ms": p99 * 1.2, "p99_over_alone": round(p99 / alone_p99, 3),
                "offered": 300, "completed": 300 - dropped, "dropped": dropped, "kept": kept}
    table = {"alone": ((17.2, None), (33.1, None)), "no-daemon": ((17.8, .87), (294.8, .63)),
             "mps-priority": ((17.3, .93), (41.5, .72)), "exclusive": ((10658, .91), (3630, .70)),
             "corun": ((18.0, .92), (40.0, .69))}
    modes = {m: {"status": "ok", "loads": {"light": load(*light, 17.2), "heavy": load(*heavy, 33.1,
                                                                                  40 if m == "exclusive" else 0)}}
             for m, (light, heavy) in table.items()}
    modes["mps"] = {"status": "failed", "error": "MPS: control daemon did not answer"}
    return {"benchmark": "colocate", "backend": backend, "device": "NVIDIA H100 80GB HBM3", "default_mode": "corun",
            "trainer": {"model": "resnet50", "batch": 64, "alone_steps_per_s": 32.3},
            "loads": {"light": {"model": "resnet50", "batch": 8, "rate_per_s": 50.0},
                      "heavy": {"model": "resnet50", "batch": 64, "rate_per_s": 30.0}},
            "modes": modes, "skipped": {}, "failed": {"mps": modes["mps"]["error"]}}


def _rows(result: dict) -> dict[str, tuple]:
    from bench import report
    from bench.report_figures import Result
    return {h.what: (h.value, h.goal, h.met) for h in report.headlines(Result("colocate", "colocate.json", result))}


def test_the_headline_puts_the_default_mode_against_the_best_baseline_and_no_daemon():
    rows = _rows(_result())
    assert rows["light: corun p99 ÷ alone"] == ("1.05×", "≤ 1.10×", True)
    assert rows["light: corun training kept"] == ("92%", "≥ 90%", True)
    assert rows["heavy: corun p99 ÷ alone"] == ("1.21×", "≤ 1.10×", False)
    assert rows["heavy: corun training kept"] == ("69%", "≥ 70%", False)
    assert rows["light: corun p99 against no daemon"] == ("18 vs 17.8 ms", "never worse", False)
    assert rows["heavy: corun p99 against no daemon"] == ("40 vs 295 ms", "never worse", True)
    assert rows["heavy: best baseline (mps-priority) p99 ÷ alone · kept"][0] == "1.25× · 72%"
    assert rows["heavy: requests dropped (backlog full)"][0] == "exclusive (40 of 300)"
    assert "light: requests dropped (backlog full)" not in rows
    assert rows["modes that failed"] == ("mps", "none", False)


def test_cpu_figures_are_shown_but_not_judged():
    rows = _rows(_result("cpu"))
    assert rows["light: corun p99 ÷ alone"] == ("1.05×", "not judged on cpu", None)
    assert rows["heavy: corun training kept"] == ("69%", "not judged on cpu", None)


def test_bench_report_draws_a_colocate_result_beside_its_headline(tmp_path):
    from bench import report
    if not report.matplotlib_available():
        pytest.skip("needs matplotlib (the plot extra)")
    results = tmp_path / "results"
    results.mkdir()
    (results / "colocate.json").write_text(json.dumps(_result()))
    assert report.main([str(results), "--out", str(tmp_path / "out")]) == 0
    png = (tmp_path / "out" / "report-colocate.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5_000
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<td title='p99_over_alone'>light: corun p99 ÷ alone</td><td>1.05×</td><td>≤ 1.10×</td>" in page
    assert "NVIDIA H100 80GB HBM3" in page[:page.index("<h2>")]  # the card, in the page's header
