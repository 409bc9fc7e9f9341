"""Settings declared once (issue 31): one declaration on ServeConfig gives the example file,
the file's key, validation and the `serve` flag; the docs name only settings that exist."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import re
from dataclasses import dataclass

import pytest

from nodeagent import cli, config
from nodeagent.config import ConfigError, ServeConfig, load_file, settings
from tests.conftest import REPO


@dataclass
class _WithDrain(ServeConfig):
    drain_ms: float = config.setting("drain.timeout_ms", 250.0, low=0, above=True, flag="--drain-timeout-ms",
                                     help="how long a drain waits for its sessions")


@pytest.fixture
def one_more_setting(monkeypatch):
    """The daemon's settings with one more declared, in a section of its own: [drain] timeout_ms."""
    monkeypatch.setattr(config, "ServeConfig", _WithDrain)
    return _WithDrain


def write(tmp_path, text: str) -> str:
    path = tmp_path / "nodeagent.toml"
    path.write_text(text)
    return str(path)


def test_one_declaration_is_in_the_example_file(one_more_setting, tmp_path):
    example = config.example_toml()
    assert re.search(r"^\[drain\]\ntimeout_ms = 250\.0 +# how long a drain waits for its sessions$", example, re.M)
    loaded = one_more_setting()
    load_file(loaded, write(tmp_path, example), required=True)  # the example still holds exactly the defaults
    assert loaded == one_more_setting()


def test_one_declaration_is_a_key_of_the_file_with_its_type_and_bounds(one_more_setting, tmp_path):
    loaded = one_more_setting()
    load_file(loaded, write(tmp_path, "[drain]\ntimeout_ms = 40\n"), required=True)
    loaded.validate()
    assert loaded.drain_ms == 40.0
    with pytest.raises(ConfigError, match=r"drain\.timeout_ms must be a number, got \"soon\""):
        load_file(one_more_setting(), write(tmp_path, '[drain]\ntimeout_ms = "soon"\n'), required=True)
    load_file(loaded, write(tmp_path, "[drain]\ntimeout_ms = -1\n"), required=True)
    with pytest.raises(ConfigError) as info:
        loaded.validate()
    assert str(info.value) == "drain.timeout_ms must be a positive number, got -1"
    assert info.value.key == "drain.timeout_ms"
    with pytest.raises(ConfigError, match=r"unknown key 'drain\.timeout'; did you mean 'drain\.timeout_ms'\?"):
        load_file(one_more_setting(), write(tmp_path, "[drain]\ntimeout = 5\n"), required=True)


def test_one_declaration_is_a_serve_flag_with_its_help_and_default(one_more_setting):
    parser = cli.build_parser()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert re.search(r"--drain-timeout-ms DRAIN_MS\s+how long a drain waits for its sessions\s+\(default: 250\)",
                     out.getvalue()), out.getvalue()
    configured, origins = cli._config_from(parser.parse_args(["serve", "--config", "/dev/null",
                                                              "--drain-timeout-ms", "30"]))
    assert configured.drain_ms == 30.0 and origins.name("drain.timeout_ms") == "--drain-timeout-ms"
    with pytest.raises(ConfigError, match=r"^--drain-timeout-ms must be a positive number, got 0$"):
        cli._config_from(parser.parse_args(["serve", "--config", "/dev/null", "--drain-timeout-ms", "0"]))


def _bounded():
    return [pytest.param(s, id=s.key) for s in settings() if s.low is not None and dict not in s.types]


@pytest.mark.parametrize("declared", _bounded())
def test_each_bound_is_enforced_where_it_is_declared(declared):
    """For every bounded setting: its lowest allowed value passes, one step past either bound is
    refused with an error naming the key and saying what is allowed."""
    step = 1 if declared.integral() else 0.5
    lowest = declared.low + step if declared.above else declared.low
    ServeConfig(**{declared.attr: lowest}).validate()
    outside = [declared.low if declared.above else declared.low - step]
    if declared.high is not None:
        ServeConfig(**{declared.attr: declared.high}).validate()
        outside.append(declared.high + step)
    for value in outside:
        with pytest.raises(ConfigError) as info:
            ServeConfig(**{declared.attr: value}).validate()
        assert info.value.key == declared.key
        assert str(info.value).startswith(f"{declared.key} must be ") and f"got {value:g}" in str(info.value)


def _flagged():
    return [pytest.param(s, id=s.flag) for s in settings() if s.flag and dict not in s.types]


@pytest.mark.parametrize("declared", _flagged())
def test_each_flag_takes_what_its_setting_allows(declared):
    """The flag's type is the setting's: its default (or example) given as the flag is taken as it is."""
    value = declared.example if declared.default_value() is None else declared.default_value()
    argv = ["serve", "--config", "/dev/null", declared.flag, f"{value:g}" if isinstance(value, float) else str(value)]
    configured, origins = cli._config_from(cli.build_parser().parse_args(argv))
    assert getattr(configured, declared.attr) == value and origins.name(declared.key) == declared.flag


def test_every_flag_of_serve_is_a_declared_setting():
    """No setting flag is written by hand beside the declarations (--config is the file, not a setting)."""
    serve = cli.build_parser().commands["serve"]
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--")} - {"--help", "--config"}
    assert flags == {s.flag for s in settings() if s.flag}


def _named_in_docs():
    """(file, name) for each dotted name in README.md and docs/ that reads as a setting's key."""
    sections = {s.key.split(".")[0] for s in settings()} - {s.key for s in settings()}
    pattern = re.compile(rf"(?<![\w./-])((?:{'|'.join(sections)})\.(?!py\b)[a-z_]+(?:\.[a-z-]+)?)\b")
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for name in sorted(set(pattern.findall(path.read_text()))):
            section, leaf = name.split(".")[:2]
            with contextlib.suppress(ImportError):  # `memory.owners`: a function of nodeagent.memory
                if hasattr(importlib.import_module(f"nodeagent.{section}"), leaf):
                    continue
            with contextlib.suppress(ImportError):  # `ctxpool.engine`: a module of the ctxpool package
                if importlib.util.find_spec(f"{section}.{leaf}") is not None:
                    continue
            with contextlib.suppress(ImportError):  # `scheduler.request`: a method of sharing.scheduler's class
                module = importlib.import_module(f"sharing.{section}")
                if any(hasattr(v, leaf) for v in vars(module).values() if isinstance(v, type)):
                    continue
            yield path.relative_to(REPO).as_posix(), name


def test_the_docs_name_only_settings_that_exist():
    keys = {s.key for s in settings()}
    keys |= {f"{s.key}.{w}" for s in settings() if dict in s.types for w in config.WORKLOADS}
    named = list(_named_in_docs())
    assert len(named) > 40  # the scan finds them
    assert not [f"{path}: {name}" for path, name in named if name not in keys]


@pytest.mark.parametrize("text, message", [
    ('[memory]\nhost_proc = "proc"', "memory.host_proc must be an absolute directory or empty, got 'proc'"),
    ('[ctxpool]\npython_path = ["lib"]', "ctxpool.python_path must be a list of absolute directories, got ['lib']"),
    ("[mps]\ndevices = [-1]", 'mps.devices must be "auto" or a list of device indices, got [-1]'),
    ('[mps]\ndevices = "all"', "mps.devices must be \"auto\" or a list of device indices, got 'all'"),
    ('[cluster]\nendpoint = "ipc:///x"', "cluster.endpoint must be tcp://HOST:PORT, got 'ipc:///x'"),
    ('[cluster]\nevents_endpoint = "udp://x:1"', "cluster.events_endpoint must be tcp://HOST:PORT or empty, "
                                                 "got 'udp://x:1'"),
    ('[scheduler]\nsharing = "both"', "scheduler.sharing must be one of auto, corun, exclusive, got 'both'"),
    ("[memory.class_cap_percent]\nbest-effort = 150", "memory.class_cap_percent must be in (0, 100], "
                                                      "got best-effort=150"),
    ('[ctxpool]\nresident_mb = "lots"', "ctxpool.resident_mb must be \"auto\" or an integer >= 0, got 'lots'"),
    ("[corun]\nduty = 2000", "corun.duty must be adaptive, pause, free or a permille in 0..1000, got 2000"),
])
def test_values_a_bound_cannot_say_are_refused_by_the_declared_check(tmp_path, text, message):
    loaded = ServeConfig()
    load_file(loaded, write(tmp_path, text), required=True)
    with pytest.raises(ConfigError) as info:
        loaded.validate()
    assert str(info.value) == message


def test_the_helm_charts_bounds_are_the_declared_ones():
    """values.schema.json repeats two settings' bounds so that helm refuses a bad value before the pod starts."""
    schema = json.loads((REPO / "deploy/helm/nodeagent/values.schema.json").read_text())["properties"]["daemon"]
    declared = {s.key: s for s in settings()}
    assert tuple(schema["properties"]["backend"]["enum"]) == declared["backend"].choices
    port = schema["properties"]["metricsPort"]
    assert (port["minimum"], port["maximum"]) == (declared["metrics.port"].low, declared["metrics.port"].high)
