"""scripts/gpu-check.sh in its dry mode, which is what it does without a GPU: installs the carried
wheels, probes the machine, plans every GPU step (whose command lines must still parse), and packs
one tarball and a summary that the device tool can bring back."""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import json
import os
import shlex
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytest.importorskip("torch")

PROBE = "nodeagent_gpucheck_probe"
# Every GPU step but "handoff" (which "handoff-*" does not match): the dry run checks the filter too.
ASKED = "pytest-gpu,switch,suspend,reclaim,llm-wake,handoff-*,colocate,ray-gpu,mps*"
GPU_STEPS = ["pytest-gpu", "switch", "suspend", "reclaim", "llm-wake", "handoff", "handoff-hold0",
             "handoff-hold200", "colocate", "ray-gpu", "mps-fault", "mps"]


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


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    _probe_wheel(tmp / "whl")
    _ray_bundle(tmp / "whl")
    out, site = tmp / "out", tmp / "site"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(tmp / "whl"),
           "GPU_CHECK_SITE": str(site), "TMPDIR": str(tmp), "GPU_CHECK_STEPS": ASKED}
    env.pop("OUT", None)
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=180)
    return run, out, site


@pytest.mark.slow
def test_the_dry_run_installs_the_wheels_probes_the_machine_and_packs_one_tarball(dry_run):
    run, out, site = dry_run
    assert run.returncode == 0, run.stdout + run.stderr
    assert "dry run" in run.stdout
    files = sorted(p.name for p in out.iterdir())
    tarballs = [f for f in files if f.endswith(".tar.gz")]
    assert len(tarballs) == 1 and set(files) <= {*tarballs, "summary.json", "summary.txt", "switch.png"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["ok"] and summary["device"] is None
    steps = {s["step"]: s for s in summary["steps"]}
    assert list(steps) == ["wheels", "ray-wheels", "env", *GPU_STEPS]
    assert steps["wheels"]["status"] in ("ok", "unpacked")  # "ok" where this is Python 3.12
    assert (site / f"{PROBE}.py").read_text() == "VALUE = 42\n"
    assert steps["ray-wheels"]["status"] == "ok"  # the Ray bundle unpacked, its script pointed at our Python
    assert (site / "bin" / "ray").read_text().splitlines()[0] == f"#!{sys.executable}"
    probe = summary["environment"]
    assert probe["python"] == sys.version.split()[0] and probe["torch"]["version"]
    for key in ("pidfd_open", "so_peercred", "sigstop", "dev_shm", "libcudart", "page_lock", "zmq", "msgspec"):
        assert key in probe, key  # recorded, whatever this machine answered
    # GPU_CHECK_STEPS: a session with a few device minutes spends them on what it asks for.
    assert all(steps[name]["status"] == "planned" for name in GPU_STEPS if name != "handoff")
    assert steps["handoff"]["status"] == "not-asked" and "handoff: not run (not in GPU_CHECK_STEPS)" in run.stdout
    table = (out / "summary.txt").read_text().splitlines()
    assert table[0].startswith(f"gpu-check {summary['tag']}") and "dry run" in table[0]
    assert [line.split()[0] for line in table[2:]] == list(steps)
    with tarfile.open(out / tarballs[0]) as tar:
        names = tar.getnames()
    tag = summary["tag"]
    assert tag.startswith("nogpu-") and all(n == tag or n.startswith(f"{tag}/") for n in names)
    assert all(n.count("/") <= 1 for n in names)  # one folder: what bench/results/<gpu>-<date>/ holds
    assert {f"{tag}/env.json", f"{tag}/env.txt", f"{tag}/steps.tsv", f"{tag}/summary.json"} <= set(names)


class _Parsed(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("step, expect", [("switch", {"backend": "cuda"}), ("suspend", {"device": "cuda"}),
                                          ("reclaim", {"device": "cuda"}), ("llm-wake", {"device": "cuda"}),
                                          ("handoff", {"work_device": "cuda"}), ("mps-fault", {"json": True}),
                                          ("handoff-hold0", {"hold_us": 0.0}),
                                          ("handoff-hold200", {"hold_us": 200.0}),
                                          ("colocate", {"device": "cuda", "phase_s": 5.0, "json": True,
                                                        "modes": ["alone", "no-daemon", "mps-priority", "exclusive",
                                                                  "corun", "corun-nomps", "corun-pause", "corun-free"]})])
def test_each_planned_benchmark_command_line_parses(dry_run, monkeypatch, step, expect):
    """The options the script passes must exist: parse them with the benchmark's own parser, then stop."""
    run, out, _ = dry_run
    command = {s["step"]: s["command"] for s in json.loads((out / "summary.json").read_text())["steps"]}[step]
    argv = shlex.split(command)
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


@pytest.mark.slow
def test_the_planned_pytest_steps_name_test_files_that_exist(dry_run):
    _, out, _ = dry_run
    steps = {s["step"]: s["command"] for s in json.loads((out / "summary.json").read_text())["steps"]}
    for name in ("pytest-gpu", "ray-gpu", "mps"):
        argv = shlex.split(steps[name])
        assert argv[argv.index("-m", argv.index("pytest")) + 1] == "gpu"
        named = [a for a in argv if a.startswith("tests/") or a.startswith("--ignore=")]
        for arg in named:
            assert (REPO / arg.removeprefix("--ignore=")).exists(), arg
    assert "NODEAGENT_RESULTS_DIR=" in steps["mps"]  # where the 30/70 result is written


def test_an_unknown_option_is_refused():
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "--fast"], cwd=REPO, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2 and "unknown option --fast" in run.stderr

