"""Command line: ``nodeagent serve | status | top | run | demo | keys | bench | k8s-device-plugin``."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import msgspec

from nodeagent.config import DEFAULT_CONFIG_PATH, settings

# Exit statuses of `serve` that the systemd unit does not restart on (RestartPreventExitStatus=):
# a restart cannot fix them. Each comes with one line on stderr saying what to change.
EXIT_BAD_SETTING = 2  # as argparse: a flag, config value or NODEAGENT_ENDPOINT that is not valid
EXIT_STATE_UNUSABLE = 74  # sysexits EX_IOERR: the state dir or journal cannot be used
EXIT_ADDRESS_UNUSABLE = 78  # sysexits EX_CONFIG: a valid address this host cannot bind (in use, not its own)

# What `nodeagent bench NAME` runs (python -m bench.NAME): every benchmark the README and
# bench/README.md tell a user to run (tests/daemon/test_cli.py checks the docs against this list).
BENCHMARKS = ("handoff", "scale", "fairness", "preempt", "enforce", "recovery", "suspend", "switch", "reclaim",
              "llm_wake", "scrapers", "colocate", "replay", "mps_fault", "cluster_sim", "report", "gpu_summary")

EPILOG = """\
environment:
  NODEAGENT_ENDPOINT   endpoint for both daemon and clients (overrides the default
                       ipc:///run/nodeagent/agent.sock for root, else a socket under
                       $XDG_RUNTIME_DIR/nodeagent or the temp dir)

examples:
  nodeagent serve --backend cpu --cpu-devices 2
  nodeagent status --json
  nodeagent top
  nodeagent run --workload training -- python train.py
  nodeagent demo --seconds 5
  nodeagent k8s-device-plugin --shares 4   (in the DaemonSet of deploy/kubernetes)
"""


RUN_DESCRIPTION = """\
Run CMD as a session of the daemon, time-sliced with no change to its code. CMD
starts stopped, in its own process group and, on cgroup v2, its own cgroup; it
is continued when the session is granted the device token and stopped before
the token is given up or when it is taken away: the cgroup frozen and thawed
(cgroup.freeze), so that no process CMD starts escapes, or where no cgroup can
be made, SIGSTOP and SIGCONT to the process group (which setsid escapes).

signals: SIGINT (Ctrl-C), SIGTERM and SIGHUP are forwarded to CMD's process group,
  followed by SIGCONT (or a thaw) so that a stopped CMD can act on them; CMD then runs
  unmanaged until it exits (its session is closed and the token passes on).
daemon gone (or not running when CMD starts): by default (fail-open) CMD is
  continued and runs unmanaged, and the launcher looks for the daemon every
  second; once it is there, CMD waits for a grant again. With --fail-closed CMD
  stays stopped until the daemon is there.
launcher killed: CMD and everything it started are killed (a keeper process
  watches the launcher), never left running unmanaged. When CMD exits, what it
  left in its cgroup is killed and the cgroup removed.
exit status: CMD's, or 128+N if CMD died of signal N; 127 if CMD is not found,
  126 if it cannot be executed, 2 for a usage error (a malformed --endpoint too),
  1 if the daemon refused the session (or --cgroup require found no cgroup).
"""

TOP_DESCRIPTION = """\
A live view of the daemon, refreshed every --interval seconds (q quits). Per device:
the token's holder and queue; a strip of the last 60 s, one character a second,
showing who held the token longest in it (each session a letter, as in the session
table; '.' idle, '*' many sessions), and under it who else held it in that second
('+': two or more others); token waits p50/p99 over the last 512 grants;
counts of grants, preemptions (a higher class waited), quantum yields, enforcements
(holders stopped or revoked past their yield deadline) and suspensions; and per
session its class, state, grants, GPU time and device memory (used/declared, MiB).
While the daemon is away the view says so and keeps trying.

--once prints a single frame without escape codes and exits: 0, or 1 with one line
on stderr when the daemon cannot be reached.
"""


KEYS_GENERATE_DESCRIPTION = """\
Create the daemon's CURVE key pair and one key pair per client, as ZeroMQ
certificate files:
  DIR/server.key_secret         the daemon's secret (0600): stays on this node
  DIR/server.key                the daemon's public key: give it to every client
  DIR/allowed/NAME.key          public keys of the clients the daemon lets in
  DIR/clients/NAME.key_secret   a client's secret (0600): move it to that client
Refuses to overwrite existing files unless --force. To allow another client
later, copy its public .key file into DIR/allowed/ (or use --clients-only).
"""


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _quantum(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected CLASS=MS (e.g. training=200), got {text!r}")
    try:
        return name.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"quantum for {name!r} is not a number: {value!r}") from None


class Parser(argparse.ArgumentParser):
    """An argument parser that takes no abbreviations, and makes its subcommands' parsers
    the same: ``--quantum training=100`` must not pass for ``--quantum-ms``, nor a typo for
    whichever flag it happens to prefix. Its subcommands' parsers are kept in ``commands``,
    so that an unknown flag is reported by the subcommand it was given to (its usage, and
    the flag it was probably meant to be)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}

    def add_subparsers(self, **kwargs):
        action = super().add_subparsers(**kwargs)
        self.commands = action.choices  # name -> its parser, filled in as each is added
        return action

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.commands.get(getattr(parsed, "command", None), self)
            nested = getattr(parsed, "keys_action", None)  # `nodeagent keys generate`
            command = command.commands.get(nested, command)
            command.error(f"unrecognized arguments: {' '.join(extras)}{command.meant(extras)}")
        return parsed

    def meant(self, extras: list[str]) -> str:
        """``" (did you mean --quantum-ms?)"`` for the first unknown flag that resembles one of ours."""
        import difflib
        ours = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
        for extra in extras:
            if not extra.startswith("--"):
                continue
            given = extra.split("=", 1)[0]
            guesses = [flag for flag in ours if flag.startswith(given)] or \
                difflib.get_close_matches(given, ours, n=1, cutoff=0.6)
            if guesses:
                return f" (did you mean {guesses[0]}?)"
        return ""


def _add_setting_flags(serve: argparse.ArgumentParser) -> None:
    """A flag for each setting that declares one, with its declared help and default."""
    for s in settings():
        if s.flag is None:
            continue
        default = f" ({s.shown_default()})" if s.shown_default() else ""
        if dict in s.types:  # a table: each flag sets one class's entry
            serve.add_argument(s.flag, dest=s.attr, type=_quantum, action="append", default=[], metavar=s.metavar,
                               help=f"{s.help}, repeatable{default}".replace("%", "%%"))
            continue
        kind = {(int,): int, (int, float): float}.get(s.types)  # else a string: a word, or digits it parses
        serve.add_argument(s.flag, dest=s.attr, type=kind, choices=s.choices or None, metavar=s.metavar,
                           help=f"{s.help}{default}".replace("%", "%%"))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="nodeagent",
        description="Per-node GPU sharing daemon: processes take turns holding each device's "
                    "token in time slices; inference outranks training; weighted fair shares.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_VersionAction,
                        help="print nodeagent's version and the protocol it speaks, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground",
                           description="Run the daemon until SIGTERM or SIGINT. Exit status: 0 once stopped, "
                                       "2 for a bad setting, 74 when the state dir or its journal cannot be used "
                                       "(disk full, read-only, not a nodeagent journal, from a newer nodeagent), "
                                       "78 when an address to listen on cannot be bound (in use, not an address "
                                       "of this host, cluster keys missing), 1 for any other failure to start.")
    serve.add_argument("--config", metavar="FILE",
                       help=f"TOML settings file (default: {DEFAULT_CONFIG_PATH} if it exists); "
                            "flags override it; `nodeagent config-example` prints a commented one")
    _add_setting_flags(serve)

    sub.add_parser("config-example", help="print a commented config file with the defaults",
                   description="Print a commented nodeagent.toml holding every setting and its default.")

    status = sub.add_parser("status", help="show devices, sessions, token holders and queues",
                            description="Ask the daemon for a snapshot of devices and sessions.")
    status.add_argument("--endpoint", help="daemon endpoint (default: as for clients)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon (default: 5)")
    status.add_argument("--wait", type=positive_float, default=None, metavar="S",
                        help="if nothing listens yet, try again for up to S seconds (a script that has just "
                             "started `nodeagent serve`)")

    top = sub.add_parser("top", help="live view of holders, queues, recent token history, waits and memory",
                         description=TOP_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--endpoint", help="daemon endpoint (default: as for clients)")
    top.add_argument("--interval", type=positive_float, default=1.0, metavar="S",
                     help="seconds between refreshes (default: 1)")
    top.add_argument("--once", action="store_true",
                     help="print one frame to stdout, without escape codes, and exit (for scripts and tests)")
    top.add_argument("--timeout", type=positive_float, default=5.0,
                     help="seconds to wait for each status reply (default: 5)")

    run = sub.add_parser("run", help="run an unmodified program time-sliced by the daemon",
                         usage="nodeagent run [OPTIONS] -- CMD [ARGS...]", description=RUN_DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--workload", choices=["inference", "training", "best-effort"], default="training",
                     help="workload class of the session (default: training)")
    run.add_argument("--weight", type=positive_float, default=1.0, help="fair-share weight (default: 1)")
    run.add_argument("--device", type=int, metavar="D", help="device index (default: the daemon picks)")
    run.add_argument("--endpoint", help="daemon endpoint (default: as for clients)")
    run.add_argument("--name", help="session name shown by `nodeagent status` (default: CMD's name)")
    run.add_argument("--fail-closed", action="store_true",
                     help="keep CMD stopped while the daemon is away (default: fail-open, CMD runs)")
    run.add_argument("--cgroup", choices=["auto", "off", "require"],
                     help="hold CMD in a cgroup v2 of its own (frozen, killed as one: setsid cannot escape it): "
                          "auto uses one where it can be made, else the process group; off: the process group; "
                          "require: refuse to start CMD without one (default: $NODEAGENT_RUN_CGROUP, else auto)")
    run.add_argument("-v", "--verbose", action="store_true", help="log each grant and stop to stderr")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD [ARGS...]", help="the program to run")

    demo = sub.add_parser("demo", help="an inference and a training client sharing one device",
                          description="Start a daemon on the cpu backend (or use the one at "
                                      "NODEAGENT_ENDPOINT) and run an inference client and a training "
                                      "client that share device 0, printing who holds the token.")
    demo.add_argument("--seconds", type=float, default=6.0, help="how long the clients run (default: 6)")

    keys = sub.add_parser("keys", help="create the CURVE keys of the cluster endpoint",
                          description="Manage the CURVE keys that authenticate placement clients on the "
                                      "cluster endpoint ([cluster] keys_dir in the config).")
    keys_sub = keys.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    keys_gen = keys_sub.add_parser("generate", help="create the server key pair and client key pairs",
                                   description=KEYS_GENERATE_DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    keys_gen.add_argument("--dir", default=None, metavar="DIR",
                          help="keys directory (default: /etc/nodeagent/keys)")
    keys_gen.add_argument("--client", action="append", default=None, metavar="NAME",
                          help="a client to allow, repeatable (default: one named 'placement')")
    keys_gen.add_argument("--clients-only", action="store_true",
                          help="add clients to an existing keys directory; keep the server key")
    keys_gen.add_argument("--force", action="store_true",
                          help="replace existing key files (every client then needs the new keys)")

    bench = sub.add_parser("bench", help=f"run a benchmark from bench/ ({', '.join(BENCHMARKS)})",
                           description="Equivalent to python -m bench.NAME ARGS; bench/README.md says what "
                                       "each measures.")
    bench.add_argument("name", choices=BENCHMARKS, metavar="NAME", help=f"one of: {', '.join(BENCHMARKS)}")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")

    from nodeagent.k8s.cli import add_parser as add_k8s_device_plugin  # needs no grpc until it runs
    add_k8s_device_plugin(sub)
    return parser


class _VersionAction(argparse.Action):
    """``--version``: the line is made only when asked for; reading the installed version
    (importlib.metadata) cost every other command, `serve` and `status` too, ~35 ms of CPU."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())  # to stdout, as argparse's own "version" action
        parser.exit()


def version_line() -> str:
    from importlib.metadata import PackageNotFoundError, version
    from client_lib.protocol import PROTOCOL_VERSION
    try:
        installed = version("nodeagent")
    except PackageNotFoundError:  # run from a checkout that was never installed
        installed = "unknown (not installed)"
    return f"nodeagent {installed} (protocol {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]})"


EXIT_OUTPUT_CLOSED = 141  # as a shell reports a command that SIGPIPE ended: `nodeagent status | head -1`


def main(argv: list[str] | None = None) -> int:
    """Run one command. A reader that stops reading (``| head -1``) ends it quietly, not
    with a BrokenPipeError traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return code
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OUTPUT_CLOSED


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "config-example":
        from nodeagent.config import example_toml
        print(example_toml(), end="")
        return 0
    if args.command == "status":
        return _status(args)
    if args.command == "top":
        from nodeagent import top
        return top.run_once(args.endpoint, args.timeout) if args.once else \
            top.run_live(args.endpoint, args.interval, args.timeout)
    if args.command == "run":
        from nodeagent.launcher import main as run_main
        return run_main(args)
    if args.command == "demo":
        from nodeagent.demo import run_demo
        return run_demo(args.seconds)
    if args.command == "keys":
        return _keys(args)
    if args.command == "k8s-device-plugin":
        from nodeagent.k8s.cli import run as run_k8s_device_plugin
        return run_k8s_device_plugin(args)
    if args.command == "bench":
        return subprocess.call([sys.executable, "-m", f"bench.{args.name}", *args.args])
    return 2


class _JournaldFormatter(logging.Formatter):
    """``<N>`` syslog priority prefixes, so ``journalctl -p warning`` filters; journald adds the time."""

    _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self._PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):  # stderr goes to journald (systemd sets this)
        handler.setFormatter(_JournaldFormatter("%(name)s %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


class _Origins:
    """Where each setting of `serve` came from (a flag, the config file, NODEAGENT_ENDPOINT),
    so that an error names what the user typed rather than the setting's internal name."""

    def __init__(self) -> None:
        self.flags: dict[str, str] = {}  # key -> the flag that set it
        self.env: dict[str, str] = {}  # key -> the environment variable that set it
        self.file: str | None = None  # the config file, if one was read
        self.file_keys: set[str] = set()

    def name(self, key: str) -> str:
        """What to change to change ``key``: its flag, ``key in FILE``, or the variable."""
        if key in self.flags:
            return self.flags[key]
        if key in self.file_keys:
            return f"{key} in {self.file}"
        if key in self.env:
            return self.env[key]
        return next((s.flag for s in settings() if s.key == key and s.flag), key)

    def explain(self, exc) -> str:
        """The message of a ConfigError, naming the flag, file or variable the bad value came from."""
        key = exc.key
        if key in self.flags:
            return f"{self.flags[key]} {exc.problem}"
        if self.file is not None and (key in self.file_keys or key is None) and self.file not in str(exc):
            return f"{self.file}: {exc}"
        if key in self.env:
            return f"{self.env[key]} {exc.problem}"
        return str(exc)


def _config_from(args: argparse.Namespace):
    """Defaults, then the config file, then flags: (ServeConfig, _Origins).
    Raises ConfigError whose message names the flag, file or variable at fault."""
    from nodeagent.config import ConfigError, ServeConfig, load_file
    config, origins = ServeConfig(), _Origins()
    declared = settings(type(config))
    origins.env = {s.key: s.env for s in declared if s.env and os.environ.get(s.env)}
    path = args.config or DEFAULT_CONFIG_PATH
    if load_file(config, path, required=args.config is not None, applied=origins.file_keys):
        origins.file = path
    for s in declared:
        value = getattr(args, s.attr, None) if s.flag else None
        if dict in s.types:  # (class, value) pairs: one entry of the table each
            for name, entry in value or ():
                getattr(config, s.attr)[name] = entry
                origins.flags[f"{s.key}.{name}"] = s.flag
        elif value is not None:
            setattr(config, s.attr, value)
            origins.flags[s.key] = s.flag
    try:
        config.validate()
    except ConfigError as exc:
        raise ConfigError(origins.explain(exc), exc.key, exc.problem) from None
    return config, origins


def _address_problem(exc: OSError) -> str | None:
    """Why an address cannot be bound, when it is the address's fault (a restart would not help); else None."""
    if isinstance(exc, socket.gaierror):
        return f"the host name does not resolve ({exc.strerror})"
    if exc.errno == errno.EADDRINUSE:
        return "the address is in use (another program, or another nodeagent, listens there)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "it is not an address of this host"
    if exc.errno == errno.EACCES:
        return "permission denied"
    return None


def _start_metrics(server, config, origins: _Origins) -> str | None:
    """Serve /metrics if asked to; why it cannot be, as one line naming what to change, else None."""
    if config.metrics_port is None:
        return None
    addr, port = config.metrics_addr, config.metrics_port
    try:
        server.serve_metrics(port, addr)
    except OSError as exc:
        problem = _address_problem(exc)
        if problem is None:
            problem = exc.strerror or str(exc)
        at_fault = "metrics.port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "metrics.addr"
        shown = f"[{addr}]" if ":" in addr else addr
        return f"cannot serve metrics on {shown}:{port}: {problem}; change {origins.name(at_fault)}"
    return None


def _serve(args: argparse.Namespace) -> int:
    from nodeagent.config import ConfigError
    from nodeagent.devices import DeviceError, open_backend
    from nodeagent.runtime import AlreadyRunningError, InstanceLock, notify_systemd
    from nodeagent.daemon.cluster import ClusterError
    from nodeagent.daemon.server import AgentServer

    try:
        config, origins = _config_from(args)
    except ConfigError as exc:
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTING
    _setup_logging(config.log_level)
    from nodeagent import fdlimit
    fdlimit.raise_soft_limit()  # before anything opens descriptors; local.* limits fit in it
    try:
        backend, reason = open_backend(config.backend, cpu_devices=config.cpu_devices)
    except DeviceError as exc:
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        return 1
    logging.getLogger("nodeagent.cli").info("[serve] backend=%s (%s)", backend.name, reason)

    def give_up(code: int, message: str) -> int:
        print(f"nodeagent: error: {message}", file=sys.stderr)
        backend.close()
        return code

    from nodeagent.journal import Journal, JournalError
    # A state dir or journal it cannot use ends the start with one line and EXIT_STATE_UNUSABLE,
    # which the systemd unit does not restart on: a restart loop cannot free a disk.
    try:
        os.makedirs(config.state_dir, mode=0o750, exist_ok=True)
        state_lock = InstanceLock(os.path.join(config.state_dir, "nodeagent.lock"), "state dir")
        state_lock.acquire()
    except AlreadyRunningError as exc:
        return give_up(1, str(exc))
    except OSError as exc:
        return give_up(EXIT_STATE_UNUSABLE, f"state dir {config.state_dir} cannot be used: {exc.strerror}; free "
                                            "space or fix permissions there, or point --state-dir elsewhere")
    from nodeagent.mps import MpsError
    try:
        # The journal is opened by bind(), once every address is bound: a start that ends
        # at a bind (EXIT_ADDRESS_UNUSABLE) leaves no journal behind.
        server = AgentServer(config, backend,
                             open_journal=lambda: Journal(os.path.join(config.state_dir, "state.db")))
    except ConfigError as exc:
        return give_up(EXIT_BAD_SETTING, origins.explain(exc))
    # Metrics first: a port it cannot have then ends the start before the endpoint
    # exists, so no socket file is left behind and no client connects in between.
    problem = _start_metrics(server, config, origins)
    if problem is not None:
        return give_up(EXIT_ADDRESS_UNUSABLE, problem)
    try:
        endpoint = server.bind()  # removes what it bound (and the journal it opened) again if a later part fails
    except ClusterError as exc:  # names the setting; the address or the keys are at fault
        return give_up(EXIT_ADDRESS_UNUSABLE, str(exc))
    except JournalError as exc:  # not openable, or the boot counter or the restore could not be read or written
        return give_up(EXIT_STATE_UNUSABLE, str(exc))
    except (AlreadyRunningError, MpsError) as exc:
        return give_up(1, f"cannot listen on {config.endpoint}: {exc}")
    except OSError as exc:
        problem = _address_problem(exc)
        if problem is None:
            return give_up(1, f"cannot listen on {config.endpoint}: {exc.strerror or exc}")
        return give_up(EXIT_ADDRESS_UNUSABLE,
                       f"cannot listen on {config.endpoint}: {problem}; change {origins.name('endpoint')}")
    # Handlers only record the request and wake the loop (the wakeup fd does the waking).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _f: server.request_stop(signal.Signals(s).name))
    signal.signal(signal.SIGHUP, lambda _s, _f: server.request_reload())  # re-read the cluster's allowed keys
    signal.set_wakeup_fd(server.wake_fd, warn_on_full_buffer=False)
    print(f"nodeagent: ready endpoint={endpoint} journal={os.path.join(config.state_dir, 'state.db')} "
          f"backend={backend.name} devices={backend.count()} pid={os.getpid()}", file=sys.stderr, flush=True)
    notify_systemd("READY=1")
    try:
        reason = server.serve_forever()
    finally:
        signal.set_wakeup_fd(-1)
        backend.close()
    notify_systemd("STOPPING=1")
    logging.getLogger("nodeagent.cli").info("[serve] stopped reason=%s", reason)
    return 0


def _keys(args: argparse.Namespace) -> int:
    from nodeagent.keys import DEFAULT_KEYS_DIR, KeysError, KeysExistError, generate
    keys_dir = args.dir or DEFAULT_KEYS_DIR
    try:
        paths = generate(keys_dir, clients=args.client or ["placement"], overwrite=args.force,
                         server=not args.clients_only)
    except KeysExistError as exc:  # in the command's words: its flag, not the function's argument
        print(f"nodeagent: error: refusing to overwrite existing keys: {', '.join(exc.existing)} (add --force "
              "to replace them; every client then needs the new keys)", file=sys.stderr)
        return 1
    except (KeysError, ValueError, OSError) as exc:
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        return 1
    if paths.server_secret:
        print(f"wrote {paths.server_secret}  (daemon secret key; stays on this node)")
        print(f"wrote {paths.server_public}  (daemon public key; copy it to every placement client)")
    for name in paths.clients:
        print(f"wrote {paths.allowed[name]}  (client {name!r} is now allowed to connect)")
        print(f"wrote {paths.clients[name]}  (client {name!r} secret key; move it to that client, "
              "then delete it here)")
    print(f"set [cluster] keys_dir = \"{paths.keys_dir}\" in the daemon's config; "
          "restart the daemon to load new keys")
    return 0


def _status(args: argparse.Namespace) -> int:
    from client_lib import DaemonUnavailableError, NodeAgentError
    from client_lib.endpoint import client_endpoint
    from nodeagent.config import client_endpoint_problem
    from nodeagent.top import fetch  # a garbled reply too is one line
    problem = client_endpoint_problem(args.endpoint)
    if problem is not None:  # as `serve` refuses it: a typo, not a daemon that is away
        print(f"nodeagent: error: {problem}", file=sys.stderr)
        return EXIT_BAD_SETTING
    give_up = time.monotonic() + (args.wait or 0.0)
    while True:
        try:
            status = fetch(args.endpoint or client_endpoint(), args.timeout)
            break
        except NodeAgentError as exc:  # nothing listens yet: try again while --wait lasts
            if not isinstance(exc, DaemonUnavailableError) or time.monotonic() >= give_up:
                print(f"nodeagent: error: {exc}", file=sys.stderr)
                return 1
            time.sleep(0.05)
    print(json.dumps(msgspec.to_builtins(status), indent=2) if args.json else format_status(status))
    return 0


def format_status(status) -> str:
    from nodeagent.top import name_width, shown  # peers' names reach a terminal: no control characters
    gib = 1024 ** 3
    lines = [f"nodeagent pid {status.daemon_pid}  backend {status.backend}  up {status.uptime_s:.0f} s  "
             f"protocol {status.protocol[0]}.{status.protocol[1]}"]
    for d in status.devices:
        used = "?" if d.memory_used_bytes is None else f"{d.memory_used_bytes / gib:.1f}"
        util = "" if d.utilization_percent is None else f"  util {d.utilization_percent:.0f}%"
        names = {s.id: shown(s.name) for s in d.sessions}
        holder = f"{d.holder} ({names.get(d.holder, '?')})" if d.holder else "-"
        queue = ", ".join(f"{sid} ({names.get(sid, '?')})" for sid in d.queue) or "-"
        lines.append("")
        lines.append(f"device {d.index}  {d.name}  memory {used}/{d.memory_total_bytes / gib:.1f} GiB{util}")
        lines.append(f"  holder {holder}   queue {queue}")
        if d.sessions:
            wide = name_width(s.name for s in d.sessions)
            lines.append(f"  {'SESSION':<16}{'NAME':<{wide + 1}}{'WORKLOAD':<13}{'WEIGHT':>7}  {'STATE':<9}"
                         f"{'GPU-TIME':>10}{'GRANTS':>8}{'PID':>9}")
            for s in d.sessions:
                pid = f"{s.pid}" + ("" if s.pid_verified else "?")
                lines.append(f"  {s.id:<16}{shown(s.name)[:wide]:<{wide + 1}}{s.workload:<13}{s.weight:>7g}  "
                             f"{s.state:<9}"
                             f"{s.gpu_time_s:>9.2f}s{s.grants:>8}{pid:>9}")
                if s.managed_pgid is not None:  # nodeagent run: how the daemon would stop its program
                    how = (f"cgroup {shown(s.managed_cgroup)} (cgroup.freeze)" if s.managed_cgroup
                           else f"process group {s.managed_pgid} (SIGSTOP)")
                    lines.append(f"  {'':<16}launched program: {how}")
        else:
            lines.append("  no sessions")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
