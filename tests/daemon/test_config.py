"""The TOML config file: precedence, and clear errors naming the key."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict

import pytest

from nodeagent.config import ConfigError, ServeConfig, example_toml, load_file
from tests.conftest import REPO


def write(tmp_path, text: str) -> str:
    path = tmp_path / "nodeagent.toml"
    path.write_text(text)
    return str(path)


def test_the_example_file_holds_exactly_the_defaults(tmp_path):
    config = ServeConfig()
    assert load_file(config, write(tmp_path, example_toml()), required=True)
    assert asdict(config) == asdict(ServeConfig())


def test_values_from_the_file_are_applied(tmp_path):
    config = ServeConfig()
    load_file(config, write(tmp_path, """
backend = "cpu"
cpu_devices = 4
[scheduler]
grace_ms = 25
[scheduler.quantum_ms]
training = 80
[heartbeat]
misses = 5
[memory]
policy = "revoke"
[metrics]
port = 9400
"""), required=True)
    config.validate()
    assert (config.backend, config.cpu_devices, config.grace_ms, config.heartbeat_misses) == ("cpu", 4, 25.0, 5)
    assert config.quantum_ms == {"inference": 50.0, "training": 80.0, "best-effort": 200.0}
    assert (config.memory_policy, config.metrics_port) == ("revoke", 9400)


@pytest.mark.parametrize("text, fragment", [
    ('backnd = "cpu"', "unknown key 'backnd'; did you mean 'backend'?"),
    ('[scheduler]\ngrace = 5', "unknown key 'scheduler.grace'; did you mean 'scheduler.grace_ms'?"),
    ('grace_ms = 5', "unknown key 'grace_ms'; did you mean 'scheduler.grace_ms'?"),  # the right key, wrong table
    ('[schedular]\ngrace_ms = 5', "unknown section [schedular]; did you mean [scheduler]?"),
    ('[scheduler.quantum_ms]\ntrainig = 5', "unknown key 'scheduler.quantum_ms.trainig'; "
                                            "did you mean 'scheduler.quantum_ms.training'?"),
    ('[scheduler.quantum_ms]\ngaming = 5', "unknown key 'scheduler.quantum_ms.gaming' (workload classes:"),
    ('zzzz = 1', "unknown key 'zzzz' (`nodeagent config-example` prints every key)"),  # nothing close
    ('cpu_devices = "two"', 'cpu_devices must be an integer, got "two"'),
    ('[scheduler]\ngrace_ms = true', "scheduler.grace_ms must be a number, got true"),
    ('backend = [', "not valid TOML"),
])
def test_bad_files_are_refused_naming_the_key(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as info:
        load_file(ServeConfig(), write(tmp_path, text), required=True)
    assert fragment in str(info.value)
    assert "nodeagent.toml" in str(info.value)


@pytest.mark.parametrize("text, fragment", [
    ('[scheduler.quantum_ms]\ntraining = -1', "scheduler.quantum_ms must be a positive number of ms, got training=-1"),
    ('[memory]\npolicy = "explode"', "memory.policy"),
    ('[heartbeat]\nmisses = 0', "heartbeat.misses"),
    ('backend = "tpu"', "backend"),
    ('[ctxpool]\nresident_mb = "lots"', "ctxpool.resident_mb"),
    ('[ctxpool]\nresident_mb = -1', "ctxpool.resident_mb"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, text, fragment):
    config = ServeConfig()
    load_file(config, write(tmp_path, text), required=True)
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert fragment in str(info.value)


def test_resident_mb_is_auto_by_default_or_a_number(tmp_path):
    assert ServeConfig().ctxpool_resident_mb == "auto"
    config = ServeConfig()
    load_file(config, write(tmp_path, "[ctxpool]\nresident_mb = 4096\n"), required=True)
    config.validate()
    assert config.ctxpool_resident_mb == 4096


def test_missing_file_is_an_error_only_when_named(tmp_path):
    assert load_file(ServeConfig(), str(tmp_path / "absent.toml"), required=False) is False
    with pytest.raises(ConfigError, match="does not exist"):
        load_file(ServeConfig(), str(tmp_path / "absent.toml"), required=True)


def test_flags_override_the_file_and_bad_files_stop_the_daemon(tmp_path, start_daemon, workdir):
    (tmp_path / "nodeagent.toml").write_text('[scheduler.quantum_ms]\ntraining = 70\n[scheduler]\ngrace_ms = 30\n')
    import shutil
    shutil.copy(tmp_path / "nodeagent.toml", f"{workdir}/nodeagent.toml")
    d = start_daemon("--grace-ms", "45")
    from client_lib import Client
    with Client("c", endpoint=d.endpoint) as client:
        assert (client.welcome.slice_ms, client.welcome.grace_ms) == (70.0, 45.0)
    (tmp_path / "bad.toml").write_text("surprise = 1\n")
    out = subprocess.run([sys.executable, "-m", "nodeagent", "serve", "--config", str(tmp_path / "bad.toml")],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 2 and "unknown key 'surprise'" in out.stderr


def test_config_example_command_prints_the_example():
    out = subprocess.run([sys.executable, "-m", "nodeagent", "config-example"], capture_output=True, text=True,
                         timeout=30, cwd=REPO)
    assert out.returncode == 0 and out.stdout == example_toml()


def test_a_bad_value_carries_its_key_so_the_command_line_can_name_the_flag():
    config = ServeConfig(grace_ms=0.0)
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert (info.value.key, info.value.problem) == ("scheduler.grace_ms", "must be a positive number, got 0")
    config = ServeConfig()
    config.quantum_ms["trainng"] = 100.0
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert info.value.key == "scheduler.quantum_ms.trainng"
    assert str(info.value) == ("scheduler.quantum_ms has unknown workload class 'trainng'; did you mean 'training'? "
                               "(classes: inference, training, best-effort)")


@pytest.mark.parametrize("duty, permille", [("adaptive", None), ("pause", 0), ("free", 1000), ("250", 250),
                                            (" 7 ", 7), (30, 30)])
def test_corun_duty_gives_its_permille(duty, permille):
    assert ServeConfig(corun_duty=duty).corun_fixed_duty() == permille


@pytest.mark.parametrize("duty", ["Pause", "", 1001, True, ["free"]])
def test_a_corun_duty_that_is_neither_a_word_nor_a_permille_is_refused(duty):
    with pytest.raises(ConfigError, match=r"^corun\.duty must be adaptive, pause, free or a permille in 0\.\.1000"):
        ServeConfig(corun_duty=duty).corun_fixed_duty()
