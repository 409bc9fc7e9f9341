"""``nodeagent k8s-device-plugin``: its options and its run. Importing this module needs
neither grpcio nor protobuf (``nodeagent --help`` must work without the k8s extra); the
run imports them and says in one line how to install them when they are missing."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys

from nodeagent.cli import EXIT_BAD_SETTING, _setup_logging, positive_float

DEFAULT_RESOURCE = "nodeagent.io/gpu"
DEFAULT_SHARES = 4
_RESOURCE_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+"
                          r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")

DESCRIPTION = """\
A Kubernetes device plugin for the nodeagent daemon on this node. It registers with
the kubelet (device plugin API v1beta1) and advertises each device the daemon reports
as --shares devices of the resource --resource-name, with ids <uuid>::<n>. A pod that
asks for k of them gets, from Allocate: the daemon's socket directory mounted
read-only, NODEAGENT_ENDPOINT, CUDA_VISIBLE_DEVICES=<uuid>, NODEAGENT_DEVICE (the
daemon's index), NODEAGENT_DEVICE_UUID, NODEAGENT_SHARES and NODEAGENT_MEMORY_MB (k
shares' memory declaration), and on a GPU NVIDIA_VISIBLE_DEVICES (or CDI names).

health: a device's shares are Unhealthy (kept in the node's capacity, given to no new
  pod) while the daemon does not answer, while the device is DRAINING or lent to a
  borrower (--lent), and when NVML reports it lost, which only the daemon's events
  tell (--events); otherwise Healthy. The daemon is asked every --poll-interval-s and
  at once after an event.
kubelet restarts: the plugin watches --kubelet-dir; when kubelet.sock is made anew (or
  its own socket goes) it serves on a fresh socket and registers again.
signals: SIGTERM and SIGINT stop it: its socket is removed and it exits 0.
exit status: 0 once stopped, 2 for a bad setting, 1 when it cannot start (grpcio
  missing, its socket served by another process).
"""


def _shares(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be 1..1000, got {value}")
    return value


def _memory(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of MiB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _resource(text: str) -> str:
    if not _RESOURCE_RE.match(text) or len(text) > 253:
        raise argparse.ArgumentTypeError(f"expected DOMAIN/NAME such as {DEFAULT_RESOURCE}, got {text!r}")
    domain = text.split("/", 1)[0]
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise argparse.ArgumentTypeError(f"{domain} is Kubernetes' own domain; extended resources need another")
    return text


def _socket_name(text: str) -> str:
    if not text or "/" in text or text in (".", "..") or text == "kubelet.sock":
        raise argparse.ArgumentTypeError(f"expected a file name (no '/'), not kubelet.sock, got {text!r}")
    return text


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``k8s-device-plugin`` subcommand to ``nodeagent``'s subparsers."""
    cmd = sub.add_parser("k8s-device-plugin", help="serve the daemon's devices to the kubelet as shares",
                         description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                         allow_abbrev=False)
    cmd.add_argument("--endpoint", metavar="ipc://PATH",
                     help="the daemon's socket (default: $NODEAGENT_ENDPOINT, else as for clients: "
                          "ipc:///run/nodeagent/agent.sock where that directory exists)")
    cmd.add_argument("--resource-name", type=_resource, default=DEFAULT_RESOURCE, metavar="DOMAIN/NAME",
                     help=f"the extended resource pods ask for (default: {DEFAULT_RESOURCE})")
    cmd.add_argument("--shares", type=_shares, default=DEFAULT_SHARES, metavar="N",
                     help=f"devices advertised per daemon device, 1..1000 (default: {DEFAULT_SHARES})")
    cmd.add_argument("--memory-mb-per-share", type=_memory, default=None, metavar="auto|MIB",
                     help="device memory one share declares (NODEAGENT_MEMORY_MB = this x the shares a container "
                          "got on its device); auto: what the daemon admits on the device divided by --shares; "
                          "0: declare none (default: auto)")
    cmd.add_argument("--lent", choices=["unhealthy", "healthy"], default="unhealthy",
                     help="shares of a device the daemon has lent to a borrower: unhealthy (no new pods: the "
                          "device admits only the borrower's training sessions) or healthy (for inference pods, "
                          "which a lent device still admits) (default: unhealthy)")
    cmd.add_argument("--kubelet-dir", default=None, metavar="DIR",
                     help="the kubelet's device plugin directory, holding kubelet.sock "
                          "(default: /var/lib/kubelet/device-plugins)")
    cmd.add_argument("--socket-name", type=_socket_name, default="nodeagent.sock", metavar="NAME",
                     help="this plugin's socket, a file in --kubelet-dir (default: nodeagent.sock)")
    cmd.add_argument("--host-socket-dir", metavar="DIR",
                     help="the daemon's socket directory on the host, mounted into pods (default: the directory "
                          "of --endpoint, for a plugin that sees it at the host's path)")
    cmd.add_argument("--container-socket-dir", metavar="DIR",
                     help="where pods see that directory; NODEAGENT_ENDPOINT points into it (default: "
                          "the directory of --endpoint)")
    cmd.add_argument("--gpu-access", choices=["env", "cdi", "none"], default="env",
                     help="how a pod is given its GPUs: env sets NVIDIA_VISIBLE_DEVICES=<uuid> for the NVIDIA "
                          "container runtime, cdi names nvidia.com/gpu=<uuid> CDI devices, none gives nothing "
                          "(another mechanism does); nothing either way for a cpu daemon (default: env)")
    cmd.add_argument("--poll-interval-s", type=positive_float, default=2.0, metavar="S",
                     help="how often the daemon is asked for its devices, 0.05..60 (default: 2)")
    cmd.add_argument("--events", metavar="tcp://HOST:PORT",
                     help="the daemon's events endpoint ([cluster] events_endpoint): needed to see a GPU that "
                          "NVML reports lost, and to act on lends and drains at once (default: none)")
    cmd.add_argument("--events-client-key", metavar="FILE",
                     help="this plugin's CURVE key pair (a .key_secret from `nodeagent keys generate --client "
                          "NAME`, whose public key is in the daemon's allowed/); with --events")
    cmd.add_argument("--events-server-key", metavar="FILE",
                     help="the daemon's public key (keys_dir/server.key); with --events")
    cmd.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                     help="(default: info)")
    return cmd


def _settings_problem(args: argparse.Namespace) -> str | None:
    events = (args.events, args.events_client_key, args.events_server_key)
    if any(events) and not all(events):
        return "--events, --events-client-key and --events-server-key go together: give all three or none"
    if args.events and not args.events.startswith("tcp://"):
        return f"--events must be tcp://HOST:PORT, got {args.events!r}"
    if not 0.05 <= args.poll_interval_s <= 60:
        return f"--poll-interval-s must be 0.05..60, got {args.poll_interval_s:g}"
    for flag, value in (("--host-socket-dir", args.host_socket_dir),
                        ("--container-socket-dir", args.container_socket_dir), ("--kubelet-dir", args.kubelet_dir)):
        if value is not None and not os.path.isabs(value):
            return f"{flag} must be an absolute path, got {value!r}"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _settings_problem(args)
    from client_lib.endpoint import client_endpoint, ipc_path
    endpoint = args.endpoint or client_endpoint()
    socket_path = ipc_path(endpoint)
    if problem is None and socket_path is None:
        problem = (f"the daemon's endpoint must be ipc://PATH (a socket to mount into pods), got {endpoint!r}; "
                   "set --endpoint")
    if problem is not None:
        print(f"nodeagent: error: {problem}", file=sys.stderr)
        return EXIT_BAD_SETTING
    # gRPC's core logs to stderr on its own (a peer going away at a kubelet restart is routine):
    # errors only, so that what the plugin says is its own one-line log.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        import grpc  # noqa: F401
        from google.protobuf import __version__ as _  # noqa: F401
        from nodeagent.k8s import plugin, shares, watch
    except ImportError as exc:
        print(f"nodeagent: error: the k8s device plugin needs grpcio and protobuf ({exc}): "
              "pip install 'nodeagent[k8s]'", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # the generated stubs want a newer grpcio
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        return 1
    _setup_logging(args.log_level)
    log = logging.getLogger("nodeagent.k8s")

    socket_dir = os.path.dirname(socket_path)
    container_dir = args.container_socket_dir or socket_dir
    allocation = shares.AllocationSettings(
        endpoint="ipc://" + os.path.join(container_dir, os.path.basename(socket_path)),
        host_socket_dir=args.host_socket_dir or socket_dir, container_socket_dir=container_dir,
        gpu_access=args.gpu_access)
    policy = shares.SharePolicy(shares=args.shares, memory_mb_per_share=args.memory_mb_per_share, lent=args.lent)
    events = None
    if args.events:
        events = watch.EventsSource(args.events, args.events_client_key, args.events_server_key)
    else:
        log.warning("[k8s] no --events: a GPU that NVML reports lost stays advertised as healthy")
    from nodeagent.k8s.app import DevicePlugin
    device_plugin = DevicePlugin(
        endpoint=endpoint, policy=policy, allocation=allocation, poll_interval_s=args.poll_interval_s,
        events=events, runner=plugin.RunnerSettings(kubelet_dir=args.kubelet_dir or plugin.KUBELET_DIR,
                                                    socket_name=args.socket_name, resource_name=args.resource_name))
    stopped_by: list[str] = []

    def on_signal(signum, _frame) -> None:  # only records and wakes the loop
        stopped_by.append(signal.Signals(signum).name)
        device_plugin.request_stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    try:
        device_plugin.start()
    except ValueError as exc:  # a key file that does not load
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        device_plugin.close()
        return EXIT_BAD_SETTING
    log.info("[k8s] started resource=%s shares=%d daemon=%s kubelet_dir=%s events=%s", args.resource_name,
             args.shares, endpoint, device_plugin.runner.settings.kubelet_dir, args.events or "-")
    code = 0
    try:
        device_plugin.run()
    except plugin.PluginError as exc:
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        code = 1
    finally:
        device_plugin.close()
    if code == 0:
        log.info("[k8s] stopped reason=%s", stopped_by[0] if stopped_by else "-")
    return code
