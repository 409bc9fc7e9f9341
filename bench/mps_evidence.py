"""Whether the processes of an MPS step really ran under MPS, with the priority and memory limit set.

A client that cannot reach the MPS server runs without it, silently, and a daemon whose
``mps.devices = "auto"`` failed to start MPS only logs a warning: a benchmark that says "MPS"
must show it. Every MPS step of ``bench.colocate``, ``bench.mps_fault`` and ``bench.llm_wake``
records, into its JSON, :func:`collect`'s evidence:

* ``servers``: the MPS control daemon's ``get_server_list``, and per server its
  ``get_client_list`` (the pids of the clients connected to it);
* ``nvml``: NVML's compute processes and MPS clients on the device (pid and used bytes);
* ``clients``: per role (``trainer``, ``inference``, ...), the pid, whether the control daemon
  and NVML list it as a client, and what the CUDA driver read when it created its context: the
  ``CUDA_MPS_*`` variables of the process as it reported them then (a process's own setting
  after exec, as the client library does from the daemon's welcome, is not in
  ``/proc/PID/environ``), its ``CUDA_MPS_CLIENT_PRIORITY`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``,
  and the device memory ``cudaMemGetInfo`` gave it as total (a pinned limit shows there). MPS
  itself reports no client's priority: the environment it read is the evidence.

:func:`verify` compares that with what the step meant to set, and names every difference in one
line each; a step fails the mode by name when the list is not empty. Pure but for :func:`collect`'s
default readers (the control program, NVML), which tests replace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Callable, Mapping

PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
MEM_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
_COMMAND_TIMEOUT_S = 5.0
_LIST_MAX = 256  # pids kept per list: a bounded JSON whatever the device holds


def client_report(device=None) -> dict:
    """In a client, after its CUDA context exists: what the driver read (see the module docstring)."""
    report = {"pid": os.getpid(), "mps_env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}}
    try:
        import torch
        if torch.cuda.is_available() and (device is None or getattr(device, "type", "cuda") == "cuda"):
            free, total = torch.cuda.mem_get_info(device)
            report["mem_total_bytes"] = int(total)
    except Exception as exc:  # evidence, not a reason to fail the worker
        report["mem_total_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return report


def control_command(pipe_dir: str, binary: str | None = None) -> Callable[[str], str]:
    """``text`` sent to the MPS control daemon whose pipe directory is ``pipe_dir``; its stdout."""
    program = binary or shutil.which("nvidia-cuda-mps-control")

    def command(text: str) -> str:
        if program is None:
            raise OSError("nvidia-cuda-mps-control is not on PATH")
        env = {**os.environ, PIPE_ENV: pipe_dir}
        run = subprocess.run([program], input=text + "\n", capture_output=True, text=True, env=env,
                             timeout=_COMMAND_TIMEOUT_S)
        if run.returncode != 0:
            raise OSError(f"{text!r}: exit {run.returncode}: {(run.stderr or run.stdout).strip()[:200]}")
        return run.stdout

    return command


def nvml_lists(gpu: int | str = 0) -> tuple[list[dict], list[dict]]:
    """NVML's (compute processes, MPS clients) on ``gpu`` (an index or a UUID), each {pid, used_bytes}."""
    from nodeagent.nvml import NA, Nvml
    nvml = Nvml()
    try:
        handle = (nvml.query("nvmlDeviceGetHandleByUUID", gpu) if isinstance(gpu, str)
                  else nvml.query("nvmlDeviceGetHandleByIndex", gpu))
        out = []
        for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
            running = nvml.query(name, handle)
            out.append([] if running is NA else [
                {"pid": int(p.pid), "used_bytes": getattr(p, "usedGpuMemory", None)} for p in running][:_LIST_MAX])
        return out[0], out[1]
    finally:
        nvml.shutdown()


def _pids(text: str) -> list[int]:
    return [int(word) for word in text.split() if word.isdigit()][:_LIST_MAX]


def collect(clients: Mapping[str, dict], *, command: Callable[[str], str] | None = None,
            nvml: Callable[[], tuple[list[dict], list[dict]]] | None = None) -> dict:
    """The evidence for ``clients`` (role -> :func:`client_report`'s dict). ``command``: the MPS
    control daemon's (default: the one named by the clients' pipe directory); ``nvml``: NVML's two
    lists (default: device 0's). A reader that fails is recorded as an error, never raised."""
    evidence: dict = {"servers": None, "nvml": None, "clients": {}, "errors": []}
    if command is None:
        pipe = next((c.get("mps_env", {}).get(PIPE_ENV) for c in clients.values()
                     if c.get("mps_env", {}).get(PIPE_ENV)), None)
        command = control_command(pipe) if pipe else None
    if command is not None:
        try:
            servers = _pids(command("get_server_list"))
            evidence["servers"] = {str(pid): _pids(command(f"get_client_list {pid}")) for pid in servers}
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            evidence["errors"].append(f"MPS control: {exc}"[:300])
    else:
        evidence["errors"].append("MPS control: no client names a pipe directory (CUDA_MPS_PIPE_DIRECTORY)")
    try:
        compute, mps = (nvml or nvml_lists)()
        evidence["nvml"] = {"compute": compute, "mps": mps}
    except Exception as exc:  # NVML missing or failing: recorded, and verify says what is unproven
        evidence["errors"].append(f"NVML: {type(exc).__name__}: {exc}"[:300])
    server_clients = {pid for pids in (evidence["servers"] or {}).values() for pid in pids}
    nvml_clients = {p["pid"] for p in (evidence["nvml"] or {}).get("mps", [])}
    for role, report in clients.items():
        env = report.get("mps_env", {})
        pid = report.get("pid")
        evidence["clients"][role] = {
            "pid": pid,
            "listed_by_mps_server": pid in server_clients if evidence["servers"] is not None else None,
            "listed_by_nvml_as_mps_client": pid in nvml_clients if evidence["nvml"] is not None else None,
            "priority": env.get(PRIORITY_ENV), "pinned_mem_limit": env.get(MEM_LIMIT_ENV),
            "pipe_directory": env.get(PIPE_ENV), "mem_total_bytes": report.get("mem_total_bytes"),
        }
    return evidence


def under_mps(entry: dict) -> bool | None:
    """Whether a client ran under MPS by the evidence: True if the server or NVML lists it, False if
    the sources that answered do not, None if none answered."""
    seen = [entry["listed_by_mps_server"], entry["listed_by_nvml_as_mps_client"]]
    if True in seen:
        return True
    return False if False in seen else None


def verify(evidence: dict, expect: Mapping[str, dict]) -> list[str]:
    """What differs from ``expect`` (role -> {"mps": bool, "priority": str | None, "mem_limit": str |
    None}), one line each; [] when every client ran as meant."""
    problems = []
    for role, want in expect.items():
        entry = evidence["clients"].get(role)
        if entry is None:
            problems.append(f"{role}: no report from the process")
            continue
        seen = under_mps(entry)
        if want.get("mps"):
            if seen is None:
                problems.append(f"{role} (pid {entry['pid']}): nothing could say whether it ran under MPS ("
                                + "; ".join(evidence["errors"] or ["no source answered"]) + ")")
            elif not seen:
                problems.append(f"{role} (pid {entry['pid']}) did not run under MPS: neither the MPS server's "
                                "client list nor NVML's MPS list names it")
        elif seen:
            problems.append(f"{role} (pid {entry['pid']}) ran under MPS where the mode sets none")
        if want.get("mps"):
            for key, label in (("priority", PRIORITY_ENV), ("mem_limit", MEM_LIMIT_ENV)):
                got = entry["priority" if key == "priority" else "pinned_mem_limit"]
                if got != want.get(key):
                    problems.append(f"{role}: {label} was {got!r} at its context's creation, not {want.get(key)!r}")
    return problems
