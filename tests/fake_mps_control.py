#!/usr/bin/env python3
"""A stand-in for ``nvidia-cuda-mps-control``, for tests on machines without a GPU.

It mimics the parts of the real program that ``nodeagent.mps`` relies on:

``fake_mps_control.py -d``
    Daemonizes (double fork, the launcher exits 0 at once), writes its pid to
    ``$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid``, logs to
    ``$CUDA_MPS_LOG_DIRECTORY/control.log`` and serves commands on the UNIX
    socket ``$CUDA_MPS_PIPE_DIRECTORY/control``, as the real daemon does.
``fake_mps_control.py``
    The front end: sends the command lines read from stdin to the daemon,
    prints its answers, and exits 1 with "Cannot find MPS control daemon
    process" when none listens.

Commands: ``get_server_list``, ``start_server -uid N`` (records a fake server
id), ``set_default_active_thread_percentage N``,
``get_default_active_thread_percentage`` (prints ``N.0`` like the real one),
``set_default_device_pinned_mem_limit DEV NNN{M|G}``,
``get_default_device_pinned_mem_limit DEV``, ``quit``.

Misbehaviour on cue, read by the daemon when started:

* ``FAKE_MPS_FAIL_START=1``: the daemonized child logs an error and exits
  before it listens or writes its pid;
* ``FAKE_MPS_IGNORE_QUIT=1``: ``quit`` is read and ignored;
* ``FAKE_MPS_IGNORE_SIGTERM=1``: SIGTERM is ignored too;
* ``FAKE_MPS_HANG=1``: connections are accepted and never answered.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"


def pipe_dir() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")


def log_dir() -> str:
    return os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(os.path.join(log_dir(), "control.log"), "a") as f:
        f.write(f"[{stamp} Control {os.getpid():6d}] {message}\n")


def client() -> int:
    commands = sys.stdin.read()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.path.join(pipe_dir(), SOCKET))
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    with sock:
        sock.sendall(commands.encode())
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    sys.stdout.write(answer.decode())
    return 0


def already_running() -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(os.path.join(pipe_dir(), SOCKET))
            return True
        except OSError:
            return False


def start_daemon() -> int:
    if already_running():
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    if os.fork():  # the launcher returns as soon as the daemon is detached, like the real one
        os.wait()
        return 0
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.chdir("/")
    try:
        serve()
    finally:
        os._exit(0)


def serve() -> None:
    control = os.path.join(pipe_dir(), SOCKET)
    pid_file = os.path.join(pipe_dir(), PID_FILE)
    if os.environ.get("FAKE_MPS_FAIL_START") == "1":
        log("Failed to start control daemon (FAKE_MPS_FAIL_START=1)")
        os._exit(1)
    ignore_quit = os.environ.get("FAKE_MPS_IGNORE_QUIT") == "1"
    hang = os.environ.get("FAKE_MPS_HANG") == "1"

    def cleanup() -> None:
        for path in (control, pid_file):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def on_sigterm(signum, frame) -> None:
        log("Received SIGTERM, exiting")
        cleanup()
        os._exit(0)

    if os.environ.get("FAKE_MPS_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, on_sigterm)

    try:
        os.unlink(control)  # a stale socket of a daemon that was killed
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(control)
    server.listen(16)
    with open(pid_file + ".tmp", "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(pid_file + ".tmp", pid_file)
    log(f"Starting control daemon using socket {control}")
    log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={pipe_dir()}")

    state = {"percentage": 100.0, "limits": {}, "servers": []}
    while True:
        conn, _ = server.accept()
        if hang:
            continue  # keep the connection open and never answer
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            replies, quit_asked = [], False
            for line in data.decode().splitlines():
                line = line.strip()
                if not line:
                    continue
                log(f"Cmd:{line}")
                if line == "quit":
                    quit_asked = True
                    continue
                reply = run_command(line, state)
                if reply:
                    replies.append(reply)
            conn.sendall("".join(r + "\n" for r in replies).encode())
        if quit_asked:
            if ignore_quit:
                log("quit ignored (FAKE_MPS_IGNORE_QUIT=1)")
                continue
            log("Exiting")
            cleanup()
            return


def run_command(line: str, state: dict) -> str:
    words = line.split()
    name, args = words[0], words[1:]
    if name == "get_server_list":
        return "\n".join(str(s) for s in state["servers"])
    if name == "start_server" and len(args) == 2 and args[0] == "-uid":
        state["servers"].append(os.getpid() + 1000 + len(state["servers"]))
        return ""
    if name == "set_default_active_thread_percentage" and len(args) == 1:
        try:
            value = float(args[0])
        except ValueError:
            value = -1.0
        if not 0 < value <= 100:
            return f"Invalid active thread percentage {args[0]}"
        state["percentage"] = value
        return f"{value:.1f}"
    if name == "get_default_active_thread_percentage" and not args:
        return f"{state['percentage']:.1f}"
    if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
        if not re.fullmatch(r"[0-9]+[MG]", args[1]):
            return f"Invalid memory limit {args[1]}"
        state["limits"][args[0]] = args[1]
        return ""
    if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
        return state["limits"].get(args[0], "0")
    return f"Unrecognized command: {line}"


if __name__ == "__main__":
    sys.exit(start_daemon() if sys.argv[1:] == ["-d"] else client())
