"""The TOML config file: precedence, and clear errors naming the key."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict

import pytest

from nodeagent.config import EXAMPLE_TOML, ConfigError, ServeConfig, load_file
from tests.conftest import REPO


def write(tmp_path, text: str) -> str:
    path = tmp_path / "nodeagent.toml"
    path.write_text(text)
    return str(path)


def test_the_example_file_holds_exactly_the_defaults(tmp_path):
    config = ServeConfig()
    assert load_file(config, write(tmp_path, EXAMPLE_TOML), required=True)
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
    ('backnd = "cpu"', "unknown key 'backnd'"),
    ('[scheduler]\ngrace = 5', "unknown key 'scheduler.grace'"),
    ('[schedular]\ngrace_ms = 5', "unknown section [schedular]"),
    ('[scheduler.quantum_ms]\ngaming = 5', "unknown key 'scheduler.quantum_ms.gaming'"),
    ('cpu_devices = "two"', "cpu_devices must be a integer"),
    ('[scheduler]\ngrace_ms = true', "scheduler.grace_ms must be a number"),
    ('backend = [', "not valid TOML"),
])
def test_bad_files_are_refused_naming_the_key(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as info:
        load_file(ServeConfig(), write(tmp_path, text), required=True)
    assert fragment in str(info.value)
    assert "nodeagent.toml" in str(info.value)


@pytest.mark.parametrize("text, fragment", [
    ('[scheduler.quantum_ms]\ntraining = -1', "scheduler.quantum_ms[training]"),
    ('[memory]\npolicy = "explode"', "memory.policy"),
    ('[heartbeat]\nmisses = 0', "heartbeat.misses"),
    ('backend = "tpu"', "backend"),
    ('[ctxpool]\nresident_mb = "lots"', "ctxpool.resident_mb"),
    ('[ctxpool]\nresident_mb = -1', "ctxpool.resident_mb"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, text, fragment):
    config = ServeConfig()
    load_file(config, write(tmp_path, text), required=True)
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        config.validate()


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
    assert out.returncode == 0 and out.stdout == EXAMPLE_TOML
