"""The daemon's shape, checked as its purity test checks sharing/ (issue 22): one owner of
the schedulers, and constructors that name a handful of collaborators."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
DAEMON = REPO / "nodeagent" / "daemon"
SCHEDULER_OWNERS = {"tokens.py"}  # the tokens component, alone
MUTATORS = {"add_session", "remove_session", "request", "cancel", "release", "revoke", "preempt", "set_weight",
            "set_policy", "tick"}
MAX_COLLABORATORS = 8


def _python_files():
    return sorted(p for p in (REPO / "nodeagent").rglob("*.py"))


def _scheduler_like(node: ast.AST) -> bool:
    """A scheduler, as code outside the owner would reach one: ``...schedulers[i]``, or a
    name or attribute called scheduler or lane."""
    if isinstance(node, ast.Subscript):
        return _scheduler_like(node.value)
    if isinstance(node, ast.Attribute):
        return node.attr in ("schedulers", "_schedulers", "scheduler", "_scheduler", "lane")
    if isinstance(node, ast.Name):
        return node.id in ("schedulers", "scheduler", "lane")
    return False


def test_the_schedulers_change_only_in_the_tokens_component():
    offenders = []
    for path in _python_files():
        if path.parent == DAEMON and path.name in SCHEDULER_OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MUTATORS and _scheduler_like(node.func.value)):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.func.attr}()")
            if isinstance(node, ast.Attribute) and node.attr == "_schedulers":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} holds the schedulers")
    assert not offenders, "schedulers changed outside nodeagent/daemon/tokens.py: " + ", ".join(offenders)


def test_the_checks_above_see_a_scheduler_change_where_one_is():
    """The grep is not vacuous: the owner itself is caught by it."""
    tree = ast.parse((DAEMON / "tokens.py").read_text())
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in MUTATORS and _scheduler_like(node.func.value)]
    assert len(found) >= 8


def test_no_component_constructor_takes_more_than_8_collaborators():
    too_many = []
    for path in sorted(DAEMON.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    count = len(args.args) - 1 + len(args.kwonlyargs)  # less self
                    if count > MAX_COLLABORATORS:
                        too_many.append(f"{path.name}:{node.name} ({count})")
    assert not too_many, f"constructors over {MAX_COLLABORATORS} parameters: {too_many}"


# Who writes each field of a Session after it is built (sessions.Session): its owner alone.
# A session restored from the journal is built by restore.py, which sets what the record kept.
SESSION_FIELD_OWNERS = {
    "last_seen": {"sessions.py"}, "pidfd": {"sessions.py"}, "route": {"sessions.py"},
    "managed_cgroup": {"sessions.py", "restore.py"}, "managed_pidfd": {"sessions.py", "restore.py"},
    "managed_pgid": {"restore.py"},
    "memory_used_bytes": {"memory.py"},
    "mps": {"server.py"}, "weight": {"tokens.py"},
}
# Names that hold something else with a field of the same name (serving's queues have a grant).
NOT_SESSIONS = {("serving.py", "q")}
_CHANGING_CALLS = {"add", "discard", "update", "clear", "append", "remove", "pop", "extend", "insert"}


def _session_field_writes(tree: ast.AST, file: str = ""):
    """(field, line) for each assignment to ``<x>.<field>`` and each changing call on one."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _CHANGING_CALLS and isinstance(node.func.value, ast.Attribute)):
            targets = [node.func.value]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in SESSION_FIELD_OWNERS and not (
                    isinstance(t.value, ast.Name) and (t.value.id == "self" or (file, t.value.id) in NOT_SESSIONS)):
                yield t.attr, node.lineno


def test_each_session_field_is_written_by_its_owner_only():
    offenders = []
    for path in sorted(DAEMON.glob("*.py")):
        for field_name, line in _session_field_writes(ast.parse(path.read_text()), path.name):
            if path.name not in SESSION_FIELD_OWNERS[field_name]:
                offenders.append(f"{path.name}:{line} writes Session.{field_name}")
    assert not offenders, "a component writes another's state: " + ", ".join(offenders)


def test_the_field_check_sees_a_write_where_one_is():
    """Not vacuous: a write of each kind, in code, is found."""
    tree = ast.parse("s.mps = 1\ns.last_seen.append(x)\na, s.route = 1, 2\ns.weight += 1\nself.mps = 2\n")
    assert sorted(f for f, _ in _session_field_writes(tree)) == ["last_seen", "mps", "route", "weight"]


# A session's whole-device suspension (its sharing.suspension.Suspension machine) and the host
# memory its client keeps for it are the suspension component's (issue 31 item 2): kept by
# session id in nodeagent/daemon/suspension.py, read by the others through its views.
MOVED_TO_SUSPENSIONS = {"suspension", "host_bytes", "host_pinned", "suspend_state", "bytes_parked"}
MACHINE_HOLDERS = {"suspension.py", "restore.py"}  # restore builds one from the journal and hands it over


def _uses(tree: ast.AST, cls: str, attrs: tuple[str, ...], *, writes_only: bool):
    """Lines that name ``cls`` (or import it) or touch one of ``attrs`` (``writes_only``: change)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == cls:
            yield node.lineno
        elif isinstance(node, ast.ImportFrom) and any(alias.name == cls for alias in node.names):
            yield node.lineno
        elif (isinstance(node, ast.Attribute) and node.attr in attrs
              and (isinstance(node.ctx, ast.Store) or not writes_only)):
            yield node.lineno


def _machine_uses(tree: ast.AST):
    """Lines that name the machine's class or change one of its fields."""
    return _uses(tree, "Suspension", ("keep_request", "bytes_parked"), writes_only=True)


def test_a_sessions_suspension_is_kept_by_the_suspension_component_alone():
    import dataclasses

    from nodeagent.daemon.sessions import Session

    kept = {f.name for f in dataclasses.fields(Session)} | set(vars(Session))
    assert not kept & MOVED_TO_SUSPENSIONS, f"Session holds suspension state again: {kept & MOVED_TO_SUSPENSIONS}"
    assert len(dataclasses.fields(Session)) <= 23  # 31 before the suspension state moved out, 28 before the token's
    offenders = [f"{path.name}:{line}" for path in sorted(DAEMON.glob("*.py")) if path.name not in MACHINE_HOLDERS
                 for line in _machine_uses(ast.parse(path.read_text()))]
    assert not offenders, "a suspension machine held or changed outside suspension.py: " + ", ".join(offenders)


def test_the_machine_check_sees_a_holder_where_one_is():
    """Not vacuous: the owner's own machines, and a write of the wish a gate once made, are found."""
    assert list(_machine_uses(ast.parse((DAEMON / "suspension.py").read_text())))
    assert list(_machine_uses(ast.parse("s.suspension.keep_request = True\n"))) == [1]


# ------------------------------------------------------------------ the loop


def _server(tmp_path):
    from prometheus_client import CollectorRegistry

    from nodeagent.config import ServeConfig
    from nodeagent.daemon.server import AgentServer
    from nodeagent.devices import CpuBackend
    from nodeagent.metrics import Metrics

    config = ServeConfig(backend="cpu", endpoint=f"ipc://{tmp_path}/shape.sock", state_dir=str(tmp_path))
    return AgentServer(config, CpuBackend(1), metrics=Metrics(CollectorRegistry()))


def test_every_component_with_timers_is_in_the_timed_list_with_a_deadline(tmp_path):
    """One list of timed components: the poll timeout is the earliest of their deadlines, so a
    component with timers left out of it (or without a deadline) acts late, on someone else's wake-up."""
    server = _server(tmp_path)
    server.serve_metrics(0)
    try:
        timed = [component for _, component in server._timers]
        with_timers = {name: value for name, value in vars(server).items() if callable(getattr(value, "on_timers", None))
                       and not isinstance(value, type)}
        missing = [name for name, value in with_timers.items() if not any(value is t for t in timed)]
        assert not missing, f"components with timers left out of the timed list: {missing}"
        assert "_restorer" in with_timers and "_metrics_http" in with_timers and "_tokens" in with_timers
        now = server._clock()
        for component in timed:
            at = component.next_deadline(now)  # every one says when it is next due
            assert at is None or isinstance(at, float), (component, at)
        duties = {getattr(t.on_timers, "__name__", "") for t in timed}
        assert {"_drop_closed", "_check_liveness"} <= duties  # the server's own timed duties are listed too
    finally:
        server._metrics_http.close()
        server._sessions.close()


def test_the_loop_dispatches_readiness_through_one_registry():
    """No ``owns`` chain in the loop and no second table of readable targets: each ready target is
    looked up once in the poller, which holds what runs for every registered target."""
    tree = ast.parse((DAEMON / "server.py").read_text())
    calls = [node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute)]
    assert "owns" not in calls and calls.count("reader") == 1
    assert "poll_handlers" not in (DAEMON / "bus.py").read_text()
    registers = [node for path in sorted(DAEMON.glob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr == "register" and "poller" in ast.unparse(node.func.value)]
    assert len(registers) >= 8 and all({"on_ready", "where"} <= {k.arg for k in node.keywords} for node in registers)


def test_the_registry_runs_what_a_target_was_registered_with_and_forgets_it_when_unregistered():
    import socket

    from nodeagent.daemon.loop import EventLoopPoller

    poller = EventLoopPoller()
    a, b = socket.socketpair()
    try:
        seen = []
        poller.register(a.fileno(), on_ready=lambda fd, events: seen.append(fd), where="test")
        b.send(b"x")
        [(target, _events)] = poller.poll(1000)
        reader = poller.reader(target)
        assert reader.where == "test"
        reader.on_ready(target, _events)
        assert seen == [a.fileno()]
        poller.unregister(a.fileno())
        assert poller.reader(a.fileno()) is None and a.fileno() not in poller
    finally:
        poller.close()
        a.close()
        b.close()


def test_the_server_reaches_through_no_component():
    """The server asks components; it never reaches into one's parts (``self._tokens.pacing.x``):
    no chain of three attributes below ``self`` but the metrics' families."""
    tree = ast.parse((DAEMON / "server.py").read_text())
    deep = []
    for node in ast.walk(tree):
        parts, value = [], node
        while isinstance(value, ast.Attribute):
            parts.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id == "self" and len(parts) >= 3 and parts[-1] != "metrics":
            deep.append(f"server.py:{node.lineno} self.{'.'.join(reversed(parts))}")
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                and node.value.attr == "_tokens" and node.attr in ("stats", "schedulers", "_pacing")):
            deep.append(f"server.py:{node.lineno} self._tokens.{node.attr}")  # its parts, read or indexed
    assert not deep, "the server reaches through a component: " + ", ".join(deep)
    pacing = [f"{path.name}:{node.lineno}" for path in sorted(DAEMON.glob("*.py")) if path.name != "tokens.py"
              for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
              and node.attr in ("pacing", "_pacing")]
    assert not pacing, "the pacing is the tokens component's part, reached through it: " + ", ".join(pacing)


def test_no_part_of_the_tokens_component_is_bound_back_to_it_late():
    """``Pacing(tokens=self)`` and ``tokens.delegate(owns, on_action)`` were back-references bound
    while the components were being built; the pacing is handed the schedulers call by call, and
    a serving queue's actions are a bus event (``DelegatedAction``)."""
    import inspect

    from nodeagent.daemon.tokens import Pacing
    from nodeagent.daemon.tokens import Tokens

    assert not hasattr(Tokens, "delegate")
    assert "tokens" not in inspect.signature(Pacing).parameters


# A session's token state (the grant it holds and since when, its wait timed, a stop
# of the daemon's) is the tokens component's (issue 31 item 2): kept by session id in tokens.py
# (TokenHold), read by the others through its views (grant_of, held_since, waiting_since, stopped).
MOVED_TO_TOKENS = {"grant", "granted_at", "wait_started", "grants", "stopped"}


def _hold_uses(tree: ast.AST):
    """Lines that name the token state's class or one of its fields outside a view."""
    return _uses(tree, "TokenHold", ("_holds", "wait_started", "granted_at"), writes_only=False)


def test_a_sessions_token_state_is_kept_by_the_tokens_component_alone():
    import dataclasses

    from nodeagent.daemon.sessions import Session

    kept = {f.name for f in dataclasses.fields(Session)} | set(vars(Session))
    assert not kept & MOVED_TO_TOKENS, f"Session holds token state again: {kept & MOVED_TO_TOKENS}"
    offenders = [f"{path.name}:{line}" for path in sorted(DAEMON.glob("*.py")) if path.name != "tokens.py"
                 for line in _hold_uses(ast.parse(path.read_text()))]
    assert not offenders, "a session's token state held or read outside tokens.py: " + ", ".join(offenders)


def test_the_token_state_check_sees_a_holder_where_one_is():
    """Not vacuous: the owner's own records, and a read of a moved field, are found."""
    assert list(_hold_uses(ast.parse((DAEMON / "tokens.py").read_text())))
    assert list(_hold_uses(ast.parse("since = s.wait_started\n"))) == [1]
