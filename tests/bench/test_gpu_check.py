"""scripts/gpu-check.sh: two profiles of one device call each, held to their budget from the script's
own step list and caps; its dry mode (what it does without a GPU: installs the carried wheels,
probes the machine, lists every step with its cap, and writes the results folder); a step that
cannot start in what is left is skipped-budget by name; and bench.gpu_summary's summary and README."""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

PROBE = "nodeagent_gpucheck_probe"
PROFILES = {
    "colocate": ["colocate"],
    # issue 33's order: LLM sleep and wake, MPS fault isolation, pytest -m gpu, park with addresses kept,
    # NCCL park, switch, suspend, reclaim, Ray loan
    "rest": ["llm-wake", "llm-wake-mps", "mps-fault", "mps", "pytest-gpu", "park-keep-addresses", "nccl-park",
             "switch", "suspend", "reclaim", "ray-gpu"],
}
# What the script planned before the profiles (1,540 s of caps against 540, 1,660 with Ray): the check must refuse it.
TODAYS_PLAN = ("plan all: budget 540 s; fixed: wheels cap 0 s, env cap 0 s, reserve 20 s\n" + "".join(
    f"step {name} cap {cap} s: python3 -m bench.x\n" for name, cap in (
        ("pytest-gpu", 170), ("switch", 200), ("suspend", 100), ("reclaim", 90), ("llm-wake", 120), ("handoff", 80),
        ("handoff-hold0", 75), ("handoff-hold0-one-hop", 75), ("handoff-hold200", 75),
        ("handoff-hold200-one-hop", 75), ("colocate", 240), ("ray-gpu", 120), ("mps-fault", 120), ("mps", 120))))


def plan_text(profile: str, **env) -> str:
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "--plan", "--profile", profile], cwd=REPO,
                         capture_output=True, text=True, timeout=30, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    return run.stdout


def parse_plan(text: str) -> tuple[int, int, list[tuple[str, int]]]:
    """(budget, fixed costs, [(step, cap)]) from ``--plan``'s lines."""
    head = re.match(r"plan \S+: budget (\d+) s; fixed: wheels cap (\d+) s, env cap (\d+) s, reserve (\d+) s",
                    text.splitlines()[0])
    assert head, text
    budget, *fixed = map(int, head.groups())
    steps = [(m.group(1), int(m.group(2))) for m in re.finditer(r"^step (\S+) cap (\d+) s: ", text, re.M)]
    return budget, sum(fixed), steps


def over_budget(text: str) -> str | None:
    """Why a plan cannot fit its budget, or None."""
    budget, fixed, steps = parse_plan(text)
    total = fixed + sum(cap for _, cap in steps)
    return None if total <= budget and steps else f"caps {total} s (fixed {fixed} s) over the {budget} s budget"


@pytest.mark.parametrize("profile", list(PROFILES))
def test_each_profile_fits_its_budget_with_the_wheels_install_and_in_the_issues_order(profile):
    text = plan_text(profile)
    assert over_budget(text) is None, over_budget(text)
    budget, fixed, steps = parse_plan(text)
    assert budget == 540 and fixed > 0  # the install of the carried wheels and the probe are in it
    assert [name for name, _ in steps] == PROFILES[profile]


def test_the_budget_check_refuses_the_plan_of_before_and_a_budget_cut_below_the_caps():
    assert over_budget(TODAYS_PLAN) == "caps 1680 s (fixed 20 s) over the 540 s budget"
    assert over_budget(plan_text("rest", GPU_CHECK_BUDGET_S="300")).endswith("over the 300 s budget")


def test_a_profile_must_be_named_and_an_unknown_option_is_refused():
    for argv, words in ((["--fast", "--profile", "rest"], "unknown option --fast"),
                        ([], "choose a profile: --profile colocate or --profile rest"),
                        (["--profile", "all"], "(not all)")):
        run = subprocess.run(["bash", "scripts/gpu-check.sh", *argv], cwd=REPO, capture_output=True, text=True,
                             timeout=30)
        assert run.returncode == 2 and words in run.stderr, (argv, run.stderr)


# ------------------------------------------------------------------ the dry run


def _probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, standing in for the pyzmq and msgspec wheels a GPU run carries."""
    folder.mkdir(parents=True)
    dist = f"{PROBE}-1.0.dist-info"
    files = {
        f"{PROBE}.py": b"VALUE = 42\n",
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: nodeagent-gpucheck-probe\nVersion: 1.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for name, data in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{PROBE}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            whl.writestr(name, data)
    return path


def _ray_bundle(folder: Path) -> None:
    """What gpu-wheels.sh --ray packs, reduced to its console script (written for another Python)."""
    staging = folder.parent / "ray-site"
    (staging / "bin").mkdir(parents=True)
    (staging / "bin" / "ray").write_text("#!/somewhere/else/python3.11\nprint('ray')\n")
    subprocess.run(["tar", "-cJf", str(folder / "ray-site.tar.xz"), "-C", str(staging), "."], check=True)


def _gpu_check(tmp: Path, profile: str, *args: str, **env) -> tuple[subprocess.CompletedProcess, Path, Path]:
    if not (tmp / "whl").exists():
        _probe_wheel(tmp / "whl")
        _ray_bundle(tmp / "whl")
    out, site = tmp / f"out-{profile}", tmp / "site"
    environ = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(tmp / "whl"),
               "GPU_CHECK_SITE": str(site), "TMPDIR": str(tmp), "GPU_CHECK_ENV_CAP_S": "240", **env}
    environ.pop("OUT", None)
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "--profile", profile, *args, str(out)], cwd=REPO,
                         env=environ, capture_output=True, text=True, timeout=420)
    folders = [p for p in out.iterdir() if p.is_dir()] if out.exists() else []
    assert len(folders) == 1, run.stdout + run.stderr  # one folder: what bench/results/<gpu>-<date>/ holds
    return run, folders[0], site


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("gpu-check")
    return {profile: _gpu_check(tmp, profile, "--dry-run") for profile in PROFILES}


@pytest.mark.slow
@pytest.mark.timeout(900)  # torch imported in the probe: minutes on a loaded 2-core VM
@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_dry_run_installs_the_wheels_probes_the_machine_and_lists_each_step_with_its_cap(dry_runs, profile):
    run, folder, site = dry_runs[profile]
    assert run.returncode == 0, run.stdout + run.stderr
    assert "dry run" in run.stdout
    _, _, planned = parse_plan(plan_text(profile))
    for name, cap in planned:  # the same steps and caps as the plan the budget test adds up
        assert re.search(rf"^gpu-check: {re.escape(name)}: cap {cap} s: not run \(dry run\): ", run.stdout, re.M), name
    summary = json.loads((folder / f"summary-{profile}.json").read_text())
    assert summary["dry_run"] and summary["ok"] and summary["device"] is None and summary["profile"] == profile
    steps = {s["step"]: s for s in summary["steps"]}
    fixed = ["wheels", "ray-wheels", "env"] if profile == "rest" else ["wheels", "env"]
    assert list(steps) == fixed + PROFILES[profile]
    assert all(steps[name]["status"] == "planned" and steps[name]["cap_s"] == cap for name, cap in planned)
    assert steps["wheels"]["status"] in ("ok", "unpacked")  # "ok" where this is Python 3.12
    assert steps["env"]["status"] == "ok" and (site / f"{PROBE}.py").read_text() == "VALUE = 42\n"
    if profile == "rest":  # the Ray bundle unpacked, its script pointed at our Python
        assert steps["ray-wheels"]["status"] == "ok"
        assert (site / "bin" / "ray").read_text().splitlines()[0] == f"#!{sys.executable}"
    probe = summary["environment"]
    assert probe["python"] == sys.version.split()[0] and probe["torch"]["version"] and probe["tree"]
    for key in ("pidfd_open", "so_peercred", "sigstop", "dev_shm", "libcudart", "page_lock", "zmq", "msgspec"):
        assert key in probe, key  # recorded, whatever this machine answered
    assert folder.name == summary["tag"] and folder.name.startswith("nogpu-")
    names = {p.name for p in folder.iterdir()}
    assert {"env.json", "env.txt", f"steps-{profile}.tsv", f"summary-{profile}.json", f"summary-{profile}.txt",
            "README.md"} <= names and all(p.is_file() for p in folder.iterdir())
    table = (folder / f"summary-{profile}.txt").read_text().splitlines()
    assert table[0] == f"gpu-check {summary['tag']} profile {profile} (dry run: nothing ran on a GPU)"
    assert [line.split()[0] for line in table[2:]] == list(steps)


class _Parsed(Exception):
    pass


@pytest.mark.slow
@pytest.mark.timeout(900)  # torch imported in the probe: minutes on a loaded 2-core VM
@pytest.mark.parametrize("profile, step, expect", [
    ("colocate", "colocate", {"device": "cuda", "requests": 600, "budget_s": 455.0, "json": True,
                              "modes": ["alone", "mps-priority", "corun", "no-daemon", "corun-pause", "corun-free",
                                        "mps", "corun-nomps"]}),
    ("rest", "llm-wake", {"device": "cuda", "mps": "off"}), ("rest", "llm-wake-mps", {"mps": "on"}),
    ("rest", "mps-fault", {"json": True}), ("rest", "switch", {"backend": "cuda"}),
    ("rest", "suspend", {"device": "cuda"}), ("rest", "park-keep-addresses", {"keep_addresses": True}),
    ("rest", "reclaim", {"device": "cuda"})])
def test_each_planned_benchmark_command_line_parses(dry_runs, monkeypatch, profile, step, expect):
    """The options the script passes must exist: parse them with the benchmark's own parser, then stop."""
    folder = dry_runs[profile][1]
    command = {s["step"]: s["command"] for s in json.loads((folder / f"summary-{profile}.json").read_text())["steps"]}
    argv = shlex.split(command[step])
    at = argv.index("-m")
    module = importlib.import_module(argv[at + 1])
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed) as parsed:
        module.main(argv[at + 2:])
    namespace = parsed.value.args[0]
    assert {k: getattr(namespace, k) for k in expect} == expect


def test_the_planned_pytest_steps_name_test_files_that_exist():
    steps = dict(re.findall(r"^step (\S+) cap \d+ s: (.*)$", plan_text("rest"), re.M))
    for name in ("pytest-gpu", "mps", "nccl-park", "ray-gpu"):
        argv = shlex.split(steps[name])
        assert argv[argv.index("-m", argv.index("pytest")) + 1] == "gpu"
        assert f"--junitxml=$OUT_DIR/<gpu>-<date>/{name}.xml" in argv  # where bench.gpu_summary reads it
        for arg in (a for a in argv if a.startswith("tests/") or a.startswith("--ignore=")):
            assert (REPO / arg.removeprefix("--ignore=")).exists(), arg
    assert "NODEAGENT_RESULTS_DIR=" in steps["mps"]  # where the 30/70 result is written


@pytest.mark.slow
@pytest.mark.timeout(900)  # torch imported in the probe: minutes on a loaded 2-core VM
def test_a_step_that_cannot_start_in_what_is_left_is_skipped_budget_by_name(tmp_path):
    """With 70 s of budget, what the wheels and the probe took spent and 15 s kept back, a step whose
    cap is over what is left is not started (skipped-budget, by name); one that fits runs (here it
    fails or skips at once: no GPU)."""
    pytest.importorskip("torch")
    run, folder, _ = _gpu_check(tmp_path, "rest", GPU_CHECK_FORCE="1", GPU_CHECK_BUDGET_S="70",
                                GPU_CHECK_ENV_CAP_S="60", GPU_CHECK_STEPS="llm-wake,mps-fault,mps")
    with open(folder / "steps-rest.tsv") as f:
        steps = {row["step"]: row for row in csv.DictReader(f, delimiter="\t")}
    for name in ("llm-wake", "mps-fault", "mps"):  # mps: a pytest step that needs no torch to skip
        cap = int(steps[name]["cap"])
        said = re.search(rf"^gpu-check: {re.escape(name)}: (running|skipped-budget) \(cap {cap} ?s, (-?\d+)s of the "
                         r"budget left\)", run.stdout, re.M)
        assert said, (name, run.stdout)
        left = int(said.group(2))
        assert left <= 120 - 15
        if cap > left:
            assert said.group(1) == "skipped-budget" and steps[name]["status"] == "skipped-budget", name
        else:
            assert said.group(1) == "running" and steps[name]["status"] in ("ok", "failed", "timeout"), name
    assert steps["llm-wake"]["status"] == "skipped-budget"  # 60 s: over the 55 s that 70 s leaves at most
    assert steps["switch"]["status"] == "not-asked"
    assert {s["step"] for s in json.loads((folder / "summary-rest.json").read_text())["steps"]} >= set(steps)


# ------------------------------------------------------------------ bench.gpu_summary


def _stage(tmp_path: Path, profile: str, rows: list[tuple[str, str, int, int]], results: dict) -> Path:
    stage = tmp_path / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "env.json").write_text(json.dumps({
        "python": "3.12.3", "tree": "abc1234", "nvml": {"driver": "580.159.04"},
        "torch": {"version": "2.11.0+cu130", "cuda": "13.0", "available": True, "device": "NVIDIA H200"}}))
    with open(stage / "steps.tsv", "w") as f:
        f.write("step\tstatus\trc\tseconds\tcap\tcommand\n")
        for name, status, seconds, cap in rows:
            f.write(f"{name}\t{status}\t{0 if status == 'ok' else '-'}\t{seconds}\t{cap}\tpython3 -m bench.{name}\n")
    for name, result in results.items():
        (stage / f"{name}.json").write_text(json.dumps(result))
    return stage


def _colocate_result() -> dict:
    def cell(p99, alone_p99, kept, dropped=0, queued=0):
        return {"p50_ms": p99 / 3, "p99_ms": p99, "p99_over_alone": round(p99 / alone_p99, 3), "kept": kept,
                "offered": 600, "completed": 600 - dropped, "dropped": dropped, "queued_at_end": queued}
    modes = {"alone": {"status": "ok", "loads": {"light": cell(20.0, 20.0, None), "heavy": cell(33.6, 33.6, None)}},
             "mps-priority": {"status": "ok", "loads": {"light": cell(16.1, 20.0, .94), "heavy": cell(46.4, 33.6, .69)}},
             "corun": {"status": "ok", "loads": {"light": cell(15.9, 20.0, .93),
                                                 "heavy": cell(38.0, 33.6, .70, dropped=3, queued=2)}},
             "mps": {"status": "skipped-budget", "reason": "40 s of --budget-s left"},
             "corun-free": {"status": "failed", "error": "MPS evidence: trainer (pid 7) did not run under MPS"}}
    return {"benchmark": "colocate", "backend": "cuda", "default_mode": "corun", "modes": modes,
            "loads": {"light": {"model": "resnet50", "batch": 8, "rate_per_s": 45.0},
                      "heavy": {"model": "resnet50", "batch": 64, "rate_per_s": 30.4}}}


def test_the_summary_names_every_step_and_mode_and_the_readme_sets_each_figure_beside_goal_and_baseline(tmp_path):
    from bench import gpu_summary
    stage = _stage(tmp_path, "colocate", [("wheels", "ok", 1, 20), ("env", "ok", 5, 30), ("colocate", "ok", 400, 470)],
                   {"colocate": _colocate_result()})
    assert gpu_summary.main([str(stage), "--profile", "colocate"]) == 1  # a mode failed: not ok
    summary = json.loads((stage / "summary-colocate.json").read_text())
    assert summary["tag"].startswith("h200-") and summary["tree"] == "abc1234"
    assert [r["step"] for r in summary["steps"]] == ["wheels", "env", "colocate", "colocate/alone",
                                                     "colocate/mps-priority", "colocate/corun", "colocate/mps",
                                                     "colocate/corun-free"]
    status = {r["step"]: r["status"] for r in summary["steps"]}
    assert status["colocate/mps"] == "skipped-budget" and status["colocate/corun-free"] == "failed"
    found = {f["what"]: f for f in summary["figures"]["colocate"]}
    heavy = found["heavy (resnet50 b64, 30.4 req/s): corun"]
    assert "dropped 3, queued at end 2 of 600" in heavy["value"]  # the headline holds what was dropped
    assert heavy["met"] is False  # 1.13× and 70% kept, but 3 dropped: a drop never reads as a good p99
    assert "mps-priority 1.38× · 69%" in heavy["baseline"] and "alone p99 33.6 ms" in heavy["baseline"]
    light = found["light (resnet50 b8, 45.0 req/s): corun"]
    assert light["met"] is True and light["goal"].startswith("p99 ≤ mps-priority's")
    readme = (stage / "README.md").read_text()
    assert readme.startswith("# NVIDIA H200: scripts/gpu-check.sh")
    assert "| figure | value | goal | in-run baseline | met |" in readme
    assert ("| heavy (resnet50 b64, 30.4 req/s): corun | p99 38.0 ms = 1.13× alone, kept 70%, dropped 3, queued at "
            "end 2 of 600 |") in readme
    assert "| colocate/mps | skipped-budget | 0 | - |" in readme


def test_the_rest_profiles_figures_carry_the_goals_of_the_issue(tmp_path):
    from bench import gpu_summary
    llm = {"backend": "cuda", "wake_ttft_ms": 9.0, "cold_ttft_ms": 4200.0, "warm_ttft_ms": 3.0, "speedup": 466.7,
           "wake_ms": 41.0, "park_ms": 30.0, "weight_bytes": 2**30, "kv_cache_bytes": 2**28,
           "outputs_identical": True, "addresses_kept": True, "mps_asked": "on",
           "mps": {"problems": ["server (pid 5) did not run under MPS: neither ..."]}}
    fault = {"fault": {"fault_to_next_good_ms": 812.0, "service_first_error_from_daemon": True,
                       "service_p50_ms_before": 0.4, "service_error": "E_DEVICE: ..."},
             "kill": {"service_error": None, "service_p99_ms_before": 0.5, "service_p99_ms_after": 0.6,
                      "service_requests_after": 150}, "mps_verified": True}
    park = {"sizes": {"1024": {"keep_addresses": {"suspend_gb_per_s": 45.0, "resume_gb_per_s": 44.0,
                                                  "park_of_memcpy": 0.93, "unpark_of_memcpy": 0.88,
                                                  "memcpy_d2h_ms": 22.0, "memcpy_h2d_ms": 21.5,
                                                  "addresses_kept": True}}}}
    stage = _stage(tmp_path, "rest", [("llm-wake-mps", "ok", 50, 55), ("mps-fault", "ok", 40, 45),
                                      ("park-keep-addresses", "ok", 30, 45), ("nccl-park", "skipped-budget", 0, 20)],
                   {"llm-wake-mps": llm, "mps-fault": fault, "park-keep-addresses": park})
    (stage / "nccl-park.xml").write_text('<testsuite tests="6" failures="0" errors="0" skipped="5"/>')
    gpu_summary.main([str(stage), "--profile", "rest"])
    figs = json.loads((stage / "summary-rest.json").read_text())["figures"]
    wake = {f["what"]: f for f in figs["llm-wake-mps"]}
    assert wake["first token after a wake"]["goal"] == "≥ 20× faster than a cold start"
    assert wake["first token after a wake"]["baseline"].startswith("cold start 4200.0 ms") and wake[
        "first token after a wake"]["met"]
    assert wake["the wake"]["met"] and wake["MPS as asked"]["met"] is False
    assert {f["what"]: f["met"] for f in figs["mps-fault"]}["fault → a new service's first good request"] is True
    (row,) = figs["park-keep-addresses"]
    assert row["met"] is False and "93% / 88% of a pinned cudaMemcpy" in row["value"]  # the unpark misses 90%
    assert figs["nccl-park"] == [{"what": "pytest (nccl-park)", "value": "1 passed, 0 failed, 5 skipped",
                                  "goal": "all pass", "baseline": "-", "met": True}]
    # The two profiles' folders of one machine, in one: one README from both summaries.
    other = _stage(tmp_path / "c", "colocate", [("colocate", "ok", 400, 470)], {"colocate": _colocate_result()})
    gpu_summary.main([str(other), "--profile", "colocate"])
    (stage / "summary-colocate.json").write_text((other / "summary-colocate.json").read_text())
    assert gpu_summary.main(["--readme", str(stage)]) == 0
    readme = (stage / "README.md").read_text()
    assert readme.index("## Profile `colocate`") < readme.index("## Profile `rest`")
