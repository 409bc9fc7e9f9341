"""No command line of the project takes an abbreviated flag (issue 24): argparse's
default let ``nodeagent serve --quantum training=100`` pass for ``--quantum-ms``, and
any typo that happens to prefix a flag pass for that flag.

Every parser is found and tried: the nodeagent CLI and each of its subcommands, each
benchmark's and each example's parser (caught as its ``main`` is about to parse), and a
scan of the sources for any ``ArgumentParser`` made without ``allow_abbrev=False``. For
every long option of every parser, the option cut short by one character (where that is
no other option's prefix) must be refused as an unrecognized argument."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import re
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from nodeagent import cli
from tests.conftest import REPO, nodeagent

BENCHMARKS = ("colocate", "enforce", "fairness", "handoff", "llm_wake", "preempt", "reclaim", "recovery", "scale",
              "suspend", "switch")
EXAMPLES = ("train_loop", "ray_colocate", "llm_server", "hf_trainer_yield", "lightning_yield")
# Being reworked by others at the time of issue 24; its parser is theirs to change.
NOT_OURS = {"bench/report.py"}


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def parser_of(main, *args) -> argparse.ArgumentParser:
    """The parser ``main(*args)`` builds, caught when it is about to parse (nothing runs)."""
    real = argparse.ArgumentParser.parse_args

    def catch(self, *_a, **_k):
        raise _Caught(self)

    argparse.ArgumentParser.parse_args = catch
    try:
        main(*args)
    except _Caught as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"{main} returned without parsing its arguments")


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) for ``parser`` and every subcommand's parser under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, path + (name,))


def _value(action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    if action.type is cli._quantum:
        return ["training=100"]
    return ["1"]


def abbreviations(parser: argparse.ArgumentParser):
    """(abbreviation, its value if the option takes one, the option) for each long option
    whose name cut by one character is no other option and prefixes no other option."""
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    for action in parser._actions:
        for option in action.option_strings:
            short = option[:-1]
            if not option.startswith("--") or len(short) < 4:
                continue
            if any(o != option and o.startswith(short) for o in options):
                continue
            yield short, _value(action), option


def refused(parse, argv: list[str], abbreviation: str) -> str | None:
    """None if ``parse(argv)`` refused ``abbreviation`` as unrecognized; else what happened."""
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            parse(argv)
        except SystemExit as exc:
            if exc.code == 2 and "unrecognized arguments" in err.getvalue() and abbreviation in err.getvalue():
                return None
            return f"exit {exc.code}: {err.getvalue().strip().splitlines()[-1:]}"
    return "accepted"


# Positionals a subcommand needs after its options (the options come first).
_AFTER = {("run",): ["--", "true"], ("bench",): ["handoff"]}


def test_every_nodeagent_subcommand_refuses_an_abbreviated_flag():
    problems, tried = [], 0
    for path, parser in subcommands(cli.build_parser()):
        assert parser.allow_abbrev is False, f"nodeagent {' '.join(path)}: allow_abbrev is not False"
        if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            continue  # its options are tried with its subcommands
        for short, value, option in abbreviations(parser):
            tried += 1
            argv = [*path, short, *value, *_AFTER.get(path, [])]
            why = refused(cli.build_parser().parse_args, argv, short)
            if why:
                problems.append(f"nodeagent {' '.join(argv)} ({short} for {option}): {why}")
    assert tried > 20 and not problems, problems


def test_serve_refuses_quantum_for_quantum_ms():
    out = nodeagent("serve", "--quantum", "training=100", "--backend", "cpu")
    assert out.returncode == 2 and "unrecognized arguments: --quantum training=100" in out.stderr, out.stderr


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_refuses_an_abbreviated_flag(name):
    module = importlib.import_module(f"bench.{name}")
    parser = parser_of(module.main, [])
    assert parser.allow_abbrev is False, f"bench.{name}: allow_abbrev is not False"
    found = list(abbreviations(parser))
    assert found, f"bench.{name} has no long option to try"
    problems = [f"{short} for {option}: {why}" for short, value, option in found
                if (why := refused(parser.parse_args, [short, *value], short))]
    assert not problems, f"bench.{name}: {problems}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_refuses_an_abbreviated_flag(name, monkeypatch):
    path = REPO / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        pytest.skip(f"examples/{name}.py needs {exc.name}, not installed here")
    monkeypatch.setattr("sys.argv", [str(path)])
    parser = parser_of(module.main)
    assert parser.allow_abbrev is False, f"examples/{name}.py: allow_abbrev is not False"
    problems = [f"{short} for {option}: {why}" for short, value, option in abbreviations(parser)
                if (why := refused(parser.parse_args, [short, *value], short))]
    assert not problems, f"examples/{name}.py: {problems}"


def test_no_source_makes_a_parser_that_takes_abbreviations():
    """Parsers the tests above cannot reach (a module's second command, a script) are found
    in the sources: each ``ArgumentParser(...)`` call names ``allow_abbrev=False``."""
    problems = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith((".venv/", "tests/")) or "/." in "/" + rel or rel in NOT_OURS:
            continue
        text = path.read_text()
        for m in re.finditer(r"\b(?:argparse\.)?ArgumentParser\(|\b_Parser\(", text):
            if text[m.start() - 6:m.start()] == "class ":
                continue
            call = text[m.end():m.end() + 400]
            depth, end = 1, 0
            for end, ch in enumerate(call):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    break
            if "allow_abbrev=False" not in call[:end]:
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}")
    assert not problems, f"ArgumentParser without allow_abbrev=False at {problems}"
