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

LOAD_FIELDS = {"p50_ms", "p99_ms", "max_ms", "mean_ms", "p50_over_alone", "p99_over_alone", "p99_with_dropped_ms",
               "service_p50_ms", "service_p99_ms", "offered", "completed", "dropped", "queued_at_end", "latency_ms",
               "requests", "steps", "steps_per_s", "kept", "system_throughput"}
TOP_FIELDS = {"benchmark", "backend", "device", "date", "hostname", "cpu_count", "python", "parameters", "trainer",
              "loads", "default_mode", "modes_asked", "modes", "skipped", "failed", "interrupted", "elapsed_s",
              "record_format"}
CPU_ARGS = ["--device", "cpu", "--quick", "--loads", "light=tiny-cnn:4:0.3x,bert=tiny-bert:2:0.3x",
            "--trainer", "tiny-gpt:8", "--seq-len", "16"]


def _bench(*args: str, timeout: float = 110) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.colocate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_run():
    pytest.importorskip("torch")
    started = time.monotonic()
    run = _bench(*CPU_ARGS, "--modes", "no-daemon,mps,mps-priority,corun-mps,exclusive,corun", "--json", timeout=840)
    return run, time.monotonic() - started


@pytest.mark.slow  # the driver starts two torch processes per mode: about 40 s on 2 quiet cores
@pytest.mark.timeout(900)  # a loaded 2-core VM took 80 s a mode
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
    assert r["record_format"] == colocate.RECORD_FORMAT and r["parameters"]["requests_per_cell"] == colocate.QUICK[
        "requests"]
    for name, load in r["loads"].items():
        assert load["alone_service_ms"] > 0 and load["rate_per_s"] == pytest.approx(
            load["rate_fraction"] * load["capacity_per_s"], rel=0.01)
    for mode in ran:
        entry = r["modes"][mode]
        assert entry["seconds"] > 0 and entry["setup"], mode
        assert set(entry["loads"]) == set(r["loads"]), mode
        for name, e in entry["loads"].items():
            assert LOAD_FIELDS <= set(e), (mode, name)
            assert e["completed"] + e["dropped"] == e["offered"] == colocate.QUICK["requests"], (mode, name)
            assert len(e["latency_ms"]) == e["completed"]
            _check_record(r, mode, name, e)
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
    assert seconds < 600  # a loaded 2-core VM: most of it is six torch processes starting


def _check_record(r: dict, mode: str, name: str, e: dict) -> None:
    """The per-request record bench.replay reads: arrivals drawn again from the seed, start and end
    of every served request, and latency = end - arrival."""
    rec = e["requests"]
    assert rec["seed"] == r["loads"][name]["seed"] and rec["count"] == e["offered"]
    assert rec["rate_per_s"] == pytest.approx(r["loads"][name]["rate_per_s"], rel=1e-3)
    assert len(rec["arrival_us"]) == len(rec["start_us"]) == len(rec["end_us"]) == e["offered"]
    t0 = rec["window_us"][0]
    again = poisson_arrivals(rec["rate_per_s"], rec["seed"], 0, count=rec["count"])
    assert all(abs((a - t0) - b / 1000) <= 2 for a, b in zip(rec["arrival_us"], again)), (mode, name)
    assert rec["window_us"][1] >= rec["arrival_us"][-1]
    served = [(a, s, f) for a, s, f in zip(rec["arrival_us"], rec["start_us"], rec["end_us"]) if s is not None]
    assert len(served) == e["completed"]
    assert all(a <= s + 1 and s <= f for a, s, f in served), (mode, name)
    assert [round((f - a) / 1000, 0) for a, _, f in served] == pytest.approx([round(v) for v in e["latency_ms"]],
                                                                             abs=1.01)
    steps = r["modes"][mode]["trainer_steps_us"]
    assert steps == sorted(steps) and steps


@pytest.mark.slow
@pytest.mark.timeout(900)
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


@pytest.mark.parametrize("loads, words", [("light=resnet50:8", "is not NAME=MODEL:BATCH:RATE"),
                                          ("light=vgg:8:0.3", "unknown model 'vgg'"),
                                          ("light=resnet50:0:0.3", "batch must be >= 1"),
                                          ("light=resnet50:8:3x", "(0, 2]x of capacity"),
                                          ("light=resnet50:8:fast", "requests per second, or 0.3x"),
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
                   "--seq-len", "--max-backlog", "--threads", "--seed", "--requests", "--budget-s", "--quick"):
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

    def request(queue):  # 1 ms of work
        until = time.monotonic_ns() + 1_000_000
        while time.monotonic_ns() < until:
            pass
    result = serve_phase(request, burst, end_ns=now + 10**9, max_backlog=8)
    assert (result["offered"], result["completed"], result["dropped"]) == (30, 8, 22)
    assert result["latency_ms"] == sorted(result["latency_ms"])  # first come, first served: each waited longer
    assert result["latency_ms"][-1] >= 8 * 1.0 and all(s >= 1.0 for s in result["service_ms"])


def test_the_service_tells_its_slice_the_queue_it_has_at_acquire_and_at_release():
    """What Client.slice(queue=...) is told: at the acquire the request in hand is counted with
    the oldest's arrival; once served (the release) only those behind it, or none."""
    now = time.monotonic_ns()
    arrivals = [now - 3_000_000, now - 2_000_000, now - 1_000_000]
    seen = []

    def request(queue):
        seen.append(queue())
        queue.served = True
        seen.append(queue())
    serve_phase(request, arrivals, end_ns=now + 10**9, max_backlog=8)
    (w0, o0), (w1, o1), (w2, o2), (w3, o3), (w4, o4), (w5, o5) = seen
    assert (w0, w1, w2, w3, w4, w5) == (3, 2, 2, 1, 1, 0)
    assert o0 == arrivals[0] / 1e9 and o1 == arrivals[1] / 1e9 == o2 and o3 == arrivals[2] / 1e9 and o5 is None


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
@pytest.mark.timeout(900)
def test_a_killed_child_fails_its_mode_in_one_line_the_next_mode_runs_and_ctrl_c_stops_everything():
    pytest.importorskip("torch")
    driver = subprocess.Popen([sys.executable, "-m", "bench.colocate", *CPU_ARGS, "--loads", "light=tiny-cnn:4:0.3x",
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
            deadline = time.monotonic() + 240
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
        out, rest = driver.communicate(timeout=300)
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


def _popen_then_ctrl_c(made: list):
    """A Popen that starts a process which waits on stdin, then takes a Ctrl-C before it returns."""
    real = subprocess.Popen

    def popen(*args, **kwargs):
        proc = real([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        made.append(proc)
        signal.raise_signal(signal.SIGINT)  # its handler runs before this returns: inside Popen
        return proc
    return popen


def test_a_ctrl_c_inside_a_childs_popen_still_leaves_it_for_close_live_to_stop(monkeypatch):
    """CI caught a corun-free inference worker alive after the driver said it had stopped
    everything: the Ctrl-C had landed inside Popen, after the fork, before the child was in LIVE."""
    made: list[subprocess.Popen] = []
    monkeypatch.setattr(subprocess, "Popen", _popen_then_ctrl_c(made))
    try:
        with pytest.raises(KeyboardInterrupt):
            colocate.Child("corun-free", "inference", {}, {})
        assert [c.proc for c in colocate.LIVE] == made
        colocate.close_live()
        assert made[0].poll() is not None and not colocate.LIVE
    finally:
        for proc in made:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        colocate.LIVE.clear()


def test_a_ctrl_c_inside_the_daemons_popen_still_stops_the_daemon(monkeypatch):
    made: list[subprocess.Popen] = []
    monkeypatch.setattr(subprocess, "Popen", _popen_then_ctrl_c(made))
    monkeypatch.setattr(colocate, "daemon_args", lambda *args: ["unused"])
    try:
        with pytest.raises(KeyboardInterrupt):
            with colocate.nodeagent_daemon(None, None):
                pytest.fail("the Ctrl-C came before the daemon was up")
        assert len(made) == 1 and made[0].poll() is not None
    finally:
        for proc in made:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_worker_told_to_stop_before_it_is_ready_exits_without_starting_up():
    """A mode that fails (its other worker killed) or is interrupted closes a worker that may
    still be importing torch: it exits then, and never builds, warms up and says ready."""
    spec = {"device": "cpu", "seed": 0, "input_size": 32, "seq_len": 16, "threads": 1, "max_backlog": 8,
            "warmup_requests": 1, "calibrate": 0, "calibrate_s": 1.0, "mode": "no-daemon",
            "loads": [{"name": "light", "model": "tiny-cnn", "batch": 1}]}
    worker = subprocess.run([sys.executable, "-m", "bench.colocate", "--worker", "inference", "--spec",
                             json.dumps(spec)], input=json.dumps({"op": "stop"}) + "\n", cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert worker.stdout == ""  # no "ready": it did not start up
    assert "[inference] asked to stop before it was ready: exiting" in worker.stderr


def test_the_default_loads_are_the_issues_fixed_rates_with_600_requests_a_cell():
    light, heavy = colocate.parse_loads(colocate.DEFAULTS["cuda"]["loads"])
    assert (light.model, light.batch, light.rate_per_s, light.fraction) == ("resnet50", 8, 45.0, None)
    assert (heavy.model, heavy.batch, heavy.rate_per_s) == ("resnet50", 64, 30.4)
    assert colocate.DEFAULTS["cuda"]["requests"] >= 600
    relative = colocate.parse_loads("x=tiny-cnn:4:0.3x")[0]
    assert (relative.rate_per_s, relative.fraction) == (None, 0.3)


def test_exactly_the_asked_number_of_arrivals_are_drawn_from_the_seed():
    a = poisson_arrivals(45.0, seed=3, start_ns=10**9, count=600)
    assert len(a) == 600 and a == sorted(a) and a[0] > 10**9
    assert a == poisson_arrivals(45.0, seed=3, start_ns=10**9, count=600)
    assert a[:100] == poisson_arrivals(45.0, seed=3, start_ns=10**9, count=100)
    assert 600 / 45.0 * 0.8 < (a[-1] - 10**9) / 1e9 < 600 / 45.0 * 1.2
    with pytest.raises(ValueError):
        poisson_arrivals(45.0, seed=3, start_ns=0)


def test_a_mode_that_drops_arrivals_cannot_show_a_good_p99():
    served = [10.0] * 100
    assert colocate.p99_with_dropped(served, 0) == 10.0
    assert colocate.p99_with_dropped(served, 2) is None  # 2 of 102 never answered: the p99 is one of them
    assert colocate.p99_with_dropped([10.0] * 1000, 2) == 10.0
    assert colocate.p99_with_dropped([], 0) is None


def test_the_record_marks_a_dropped_request_with_no_start_or_end():
    now = time.monotonic_ns()
    result = serve_phase(lambda queue: None, [now - 1000] * 5, end_ns=now + 10**9, max_backlog=2)
    assert result["dropped"] == 3 and result["begin_ns"].count(None) == 3 == result["finish_ns"].count(None)
    assert result["arrival_ns"] == [now - 1000] * 5
    served = [(s, f) for s, f in zip(result["begin_ns"], result["finish_ns"]) if s is not None]
    assert len(served) == 2 and all(s <= f for s, f in served)


def _cuda_run(budget_s=None) -> "colocate.Run":
    return colocate.Run(device="cuda", loads=colocate.parse_loads("light=resnet50:8:45"), trainer=("resnet50", 64),
                        phase_s=6.0, settle_s=1.0, max_backlog=64, seed=0, budget_s=budget_s,
                        worker={"input_size": 224, "seq_len": 128, "threads": 0})


def test_a_mode_that_cannot_finish_in_the_budget_left_is_skipped_by_name_not_started(monkeypatch):
    run = _cuda_run(budget_s=100.0)
    run.alone_steps_per_s = 30.0
    result = colocate._skeleton(run, ["alone", "corun", "mps"])
    result["modes"] = {"alone": {"status": "ok", "seconds": 60.0}, "corun": {"status": "ok", "seconds": 52.0}}
    started = []
    monkeypatch.setattr(colocate, "run_mode", lambda mode, run: started.append(mode.name) or {"status": "ok"})
    colocate._one_mode(colocate.MODES["mps"], run, result, run_started=time.monotonic() - 60.0)
    assert started == [] and result["modes"]["mps"]["status"] == "skipped-budget"
    assert "mps" in result["skipped"] and "not started" in result["skipped"]["mps"]
    colocate._one_mode(colocate.MODES["mps"], run, result, run_started=time.monotonic() - 10.0)
    assert started == ["mps"]  # 90 s left: a 52 s mode fits


def _reports(trainer_env=None, inference_env=None) -> dict:
    return {"trainer": {"pid": 11, "mps_env": trainer_env or {}}, "inference": {"pid": 12, "mps_env": inference_env or {}}}


def _scripted(servers: dict[int, list[int]], nvml_mps: list[int]):
    from bench import mps_evidence

    def command(text: str) -> str:
        if text == "get_server_list":
            return "".join(f"{pid}\n" for pid in servers)
        return "".join(f"{pid}\n" for pid in servers[int(text.split()[1])])

    return lambda reports: mps_evidence.collect(reports, command=command, nvml=lambda: (
        [{"pid": 900, "used_bytes": 1 << 30}], [{"pid": pid, "used_bytes": 1 << 20} for pid in nvml_mps]))


def test_an_mps_mode_whose_clients_ran_as_set_keeps_the_evidence():
    run = _cuda_run()
    pipe = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps"}
    evidence = colocate.check_mps(colocate.MODES["mps-priority"], run, _reports(
        {**pipe, "CUDA_MPS_CLIENT_PRIORITY": "1"}, pipe), collect=_scripted({900: [11, 12]}, [11, 12]))
    assert evidence["checked"] and evidence["problems"] == [] and evidence["servers"] == {"900": [11, 12]}
    assert evidence["clients"]["trainer"]["priority"] == "1" and evidence["clients"]["inference"]["priority"] is None
    assert evidence["nvml"]["mps"][0] == {"pid": 11, "used_bytes": 1 << 20}


@pytest.mark.parametrize("servers, nvml_mps, trainer_env, words", [
    ({900: [12]}, [12], {"CUDA_MPS_CLIENT_PRIORITY": "1"}, "trainer (pid 11) did not run under MPS"),
    ({900: [11, 12]}, [11, 12], {}, "CUDA_MPS_CLIENT_PRIORITY was None at its context's creation, not '1'"),
    ({900: [11, 12]}, [11, 12], {"CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=70000M"},
     "trainer: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT was '0=70000M'"),
])
def test_an_mps_mode_whose_clients_did_not_run_as_set_fails_by_name(servers, nvml_mps, trainer_env, words):
    """Issue 30, defect 6: a client that cannot reach the MPS server runs without it, silently."""
    with pytest.raises(colocate.ModeFailed) as failed:
        colocate.check_mps(colocate.MODES["mps-priority"], _cuda_run(), _reports(trainer_env),
                           collect=_scripted(servers, nvml_mps))
    assert str(failed.value).startswith("MPS evidence: ") and words in str(failed.value)
    assert failed.value.evidence["problems"] and failed.value.evidence["expected"]["trainer"]["mps"]


def test_a_mode_without_mps_fails_if_its_clients_ran_under_it_and_nothing_answering_is_no_proof():
    from bench import mps_evidence
    with pytest.raises(colocate.ModeFailed, match="inference .pid 12. ran under MPS where the mode sets none"):
        colocate.check_mps(colocate.MODES["no-daemon"], _cuda_run(), _reports(), collect=_scripted({900: [12]}, []))

    def broken(text):
        raise OSError("Cannot find MPS control daemon process")
    evidence = mps_evidence.collect(_reports(), command=broken, nvml=lambda: (_ for _ in ()).throw(RuntimeError("x")))
    assert evidence["servers"] is None and evidence["nvml"] is None and len(evidence["errors"]) == 2
    problems = mps_evidence.verify(evidence, {"trainer": {"mps": True, "priority": "1", "mem_limit": None}})
    assert problems[0].startswith("trainer (pid 11): nothing could say whether it ran under MPS (MPS control: ")


def test_on_cpu_the_mps_evidence_is_what_the_processes_reported_and_is_not_checked():
    run = _cuda_run()
    run.device = "cpu"
    evidence = colocate.check_mps(colocate.MODES["corun"], run, _reports())
    assert evidence["checked"] is False and evidence["expected"]["trainer"]["mps"] is False


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
