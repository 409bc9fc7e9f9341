"""Device backends and the NVML wrapper: the real cpu backend, cuda against a scripted NVML library."""

from __future__ import annotations

import copy
import logging
import os
import pickle
import re
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from nodeagent.devices import (
    CpuBackend,
    CudaBackend,
    CudaUnavailable,
    DeviceError,
    DeviceInfo,
    DeviceLostError,
    DeviceProcess,
    open_backend,
)
from nodeagent.nvml import NA, Nvml, NvmlError, NvmlGpuLost, NvmlUnavailable

GIB = 1024**3


# --- a scripted NVML library ---------------------------------------------------


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    uuid: bytes  # old bindings return bytes; the wrapper must decode
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_gpu: int
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    mps_processes: list[tuple[int, int | None]] = field(default_factory=list)  # MPS clients


class FakeHandle:
    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvmlLib:
    """Stands in for pynvml; `errors` maps a function name to the NVML error code it raises."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_RESET_REQUIRED = 16
    NVML_ERROR_UNKNOWN = 999

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: int | None = None) -> None:
        self.gpus = gpus if gpus is not None else []
        self.init_error = init_error
        self.errors: dict[str, int] = {}
        self.init_calls = 0
        self.shutdown_calls = 0

    def _maybe_fail(self, func_name: str) -> None:
        if func_name in self.errors:
            raise FakeNVMLError(self.errors[func_name])

    def nvmlInit(self) -> None:
        self.init_calls += 1
        time.sleep(0.01)  # widen the window for concurrent first queries
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        self._maybe_fail("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._maybe_fail("nvmlDeviceGetHandleByIndex")
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> bytes:
        self._maybe_fail("nvmlDeviceGetUUID")
        return self.gpus[handle.index].uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        self._maybe_fail("nvmlDeviceGetName")
        return self.gpus[handle.index].name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> SimpleNamespace:
        self._maybe_fail("nvmlDeviceGetMemoryInfo")
        gpu = self.gpus[handle.index]
        used = gpu.memory_used_bytes
        return SimpleNamespace(total=gpu.memory_total_bytes, used=used, free=gpu.memory_total_bytes - used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> SimpleNamespace:
        self._maybe_fail("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=self.gpus[handle.index].utilization_gpu, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[SimpleNamespace]:
        self._maybe_fail("nvmlDeviceGetComputeRunningProcesses")
        processes = self.gpus[handle.index].processes
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeHandle) -> list[SimpleNamespace]:
        self._maybe_fail("nvmlDeviceGetMPSComputeRunningProcesses")
        processes = self.gpus[handle.index].mps_processes
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes]


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(b"GPU-aaaa", "NVIDIA H100 80GB HBM3", 80 * GIB, 3 * GIB, 37, [(1234, 2 * GIB), (5678, None)]),
        FakeGpu(b"GPU-bbbb", "NVIDIA H100 80GB HBM3", 80 * GIB, 0, 0),
    ]


# --- nvml wrapper --------------------------------------------------------------


def test_na_is_a_falsy_singleton_with_a_readable_repr():
    assert not NA
    assert repr(NA) == "NA"
    assert copy.deepcopy(NA) is NA
    assert pickle.loads(pickle.dumps(NA)) is NA


def test_nvml_initialises_lazily_and_once_across_threads():
    lib = FakeNvmlLib(two_gpus())
    nvml = Nvml(lib=lib)
    assert lib.init_calls == 0 and not nvml.initialized

    counts: list[int] = []
    def first_query() -> None:
        counts.append(nvml.query("nvmlDeviceGetCount"))

    threads = [threading.Thread(target=first_query) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert counts == [2] * 8
    assert lib.init_calls == 1


def test_query_decodes_bytes():
    nvml = Nvml(lib=FakeNvmlLib(two_gpus()))
    assert nvml.query("nvmlDeviceGetUUID", FakeHandle(1)) == "GPU-bbbb"


def test_unsupported_query_returns_na_and_logs_once(caplog):
    lib = FakeNvmlLib(two_gpus())
    lib.errors["nvmlDeviceGetUtilizationRates"] = lib.NVML_ERROR_NOT_SUPPORTED
    nvml = Nvml(lib=lib)
    with caplog.at_level(logging.DEBUG, logger="nodeagent.nvml"):
        assert nvml.query("nvmlDeviceGetUtilizationRates", FakeHandle(0)) is NA
        assert nvml.query("nvmlDeviceGetUtilizationRates", FakeHandle(1)) is NA
    logged = [r for r in caplog.records if "[nvml] not available" in r.getMessage()]
    assert len(logged) == 1
    assert "nvmlDeviceGetUtilizationRates" in logged[0].getMessage()


def test_no_permission_is_not_available():
    lib = FakeNvmlLib(two_gpus())
    lib.errors["nvmlDeviceGetMemoryInfo"] = lib.NVML_ERROR_NO_PERMISSION
    assert Nvml(lib=lib).query("nvmlDeviceGetMemoryInfo", FakeHandle(0)) is NA


@pytest.mark.parametrize("code_name", ["NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED"])
def test_a_lost_gpu_is_a_failure_not_a_missing_feature(code_name):
    lib = FakeNvmlLib(two_gpus())
    lib.errors["nvmlDeviceGetMemoryInfo"] = getattr(lib, code_name)
    with pytest.raises(NvmlGpuLost, match="nvmlDeviceGetMemoryInfo") as info:
        Nvml(lib=lib).query("nvmlDeviceGetMemoryInfo", FakeHandle(0))
    assert info.value.code == getattr(lib, code_name) and isinstance(info.value, NvmlError)


def test_function_missing_from_library_is_not_available():
    assert Nvml(lib=FakeNvmlLib()).query("nvmlDeviceGetFanSpeed_v2", FakeHandle(0)) is NA


def test_other_nvml_errors_raise_nvml_error():
    lib = FakeNvmlLib(two_gpus())
    lib.errors["nvmlDeviceGetName"] = lib.NVML_ERROR_UNKNOWN
    with pytest.raises(NvmlError, match="nvmlDeviceGetName") as info:
        Nvml(lib=lib).query("nvmlDeviceGetName", FakeHandle(0))
    assert info.value.code == lib.NVML_ERROR_UNKNOWN


def test_init_failure_raises_nvml_unavailable_with_the_reason():
    lib = FakeNvmlLib(init_error=FakeNvmlLib.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(NvmlUnavailable, match="nvmlInit failed: fake NVML error 12"):
        Nvml(lib=lib).query("nvmlDeviceGetCount")


def test_shutdown_releases_and_the_next_query_initialises_again():
    lib = FakeNvmlLib(two_gpus())
    nvml = Nvml(lib=lib)
    nvml.shutdown()  # never started: nothing to release
    assert lib.shutdown_calls == 0
    nvml.query("nvmlDeviceGetCount")
    nvml.shutdown()
    assert lib.shutdown_calls == 1 and not nvml.initialized
    nvml.query("nvmlDeviceGetCount")
    assert lib.init_calls == 2


# --- cuda backend against the fake -------------------------------------------


def test_cuda_backend_maps_nvml_values():
    backend = CudaBackend(Nvml(lib=FakeNvmlLib(two_gpus())))
    assert backend.name == "cuda" and backend.count() == 2
    assert backend.device(0) == DeviceInfo(
        index=0,
        uuid="GPU-aaaa",
        name="NVIDIA H100 80GB HBM3",
        backend="cuda",
        memory_total_bytes=80 * GIB,
        memory_used_bytes=3 * GIB,
        utilization_percent=37.0,
    )
    assert [info.uuid for info in backend.devices()] == ["GPU-aaaa", "GPU-bbbb"]


def test_cuda_values_are_live():
    lib = FakeNvmlLib(two_gpus())
    backend = CudaBackend(Nvml(lib=lib))
    lib.gpus[0].memory_used_bytes = 7 * GIB
    lib.gpus[0].utilization_gpu = 90
    info = backend.device(0)
    assert (info.memory_used_bytes, info.utilization_percent) == (7 * GIB, 90.0)


def test_cuda_unsupported_queries_give_none_not_a_crash():
    lib = FakeNvmlLib(two_gpus())
    backend = CudaBackend(Nvml(lib=lib))
    lib.errors["nvmlDeviceGetUtilizationRates"] = lib.NVML_ERROR_NOT_SUPPORTED
    lib.errors["nvmlDeviceGetMemoryInfo"] = lib.NVML_ERROR_NO_PERMISSION
    info = backend.device(0)
    assert info.utilization_percent is None
    assert info.memory_used_bytes is None
    assert info.memory_total_bytes == 80 * GIB  # the size seen at discovery


def test_cuda_processes_map_missing_memory_to_none():
    backend = CudaBackend(Nvml(lib=FakeNvmlLib(two_gpus())))
    assert backend.processes(0) == [DeviceProcess(1234, 2 * GIB), DeviceProcess(5678, None)]
    assert backend.processes(1) == []


def test_cuda_processes_unsupported_is_empty():
    lib = FakeNvmlLib(two_gpus())
    backend = CudaBackend(Nvml(lib=lib))
    lib.errors["nvmlDeviceGetComputeRunningProcesses"] = lib.NVML_ERROR_NOT_SUPPORTED
    lib.errors["nvmlDeviceGetMPSComputeRunningProcesses"] = lib.NVML_ERROR_NOT_SUPPORTED
    assert backend.processes(0) == []


def test_cuda_processes_include_mps_clients_each_once():
    gpus = two_gpus()
    # Under MPS the compute list holds the MPS server; its clients are in the MPS list.
    gpus[1].processes = [(900, 6 * GIB)]
    gpus[1].mps_processes = [(1001, 2 * GIB), (1002, None), (900, 1 * GIB)]
    backend = CudaBackend(Nvml(lib=FakeNvmlLib(gpus)))
    # 900, named by the MPS list too, is MPS's (with the larger use of the two lists).
    assert sorted(backend.processes(1), key=lambda p: p.pid) == [
        DeviceProcess(900, 6 * GIB, mps_client=True), DeviceProcess(1001, 2 * GIB, mps_client=True),
        DeviceProcess(1002, None, mps_client=True)]


@pytest.mark.parametrize("compute_lists_clients", [False, True])
def test_a_pid_in_the_mps_list_is_an_mps_client_whichever_list_also_shows_it(compute_lists_clients):
    """Issue 33, defect 5: a driver that lists MPS clients among the compute processes too (same
    use in both) had every client counted as "outside MPS", so no fault under MPS was acted on."""
    gpus = two_gpus()
    gpus[0].processes = [(900, 6 * GIB)] + ([(1001, 2 * GIB), (1002, None)] if compute_lists_clients else [])
    gpus[0].mps_processes = [(1001, 2 * GIB), (1002, None)]
    backend = CudaBackend(Nvml(lib=FakeNvmlLib(gpus)))
    assert sorted(backend.processes(0), key=lambda p: p.pid) == [
        DeviceProcess(900, 6 * GIB), DeviceProcess(1001, 2 * GIB, mps_client=True),
        DeviceProcess(1002, None, mps_client=True)]


def test_cuda_processes_without_the_mps_list_in_the_library_still_read_the_compute_list():
    lib = FakeNvmlLib(two_gpus())
    lib.nvmlDeviceGetMPSComputeRunningProcesses = None  # an older nvidia-ml-py: Nvml.query finds none
    backend = CudaBackend(Nvml(lib=lib))
    assert len(backend.processes(0)) == 2


@pytest.mark.parametrize("func", ["nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMemoryInfo"])
def test_cuda_lost_gpu_raises_device_lost_naming_it(func):
    lib = FakeNvmlLib(two_gpus())
    backend = CudaBackend(Nvml(lib=lib))
    lib.errors[func] = lib.NVML_ERROR_GPU_IS_LOST
    call = backend.processes if func.endswith("Processes") else backend.device
    with pytest.raises(DeviceLostError, match=r"GPU 0 \(GPU-aaaa\) is lost") as info:
        call(0)
    assert info.value.index == 0 and info.value.uuid == "GPU-aaaa" and isinstance(info.value, DeviceError)


def test_cuda_gpu_lost_at_discovery_is_a_device_error():
    lib = FakeNvmlLib(two_gpus())
    lib.errors["nvmlDeviceGetHandleByIndex"] = lib.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(DeviceLostError, match="GPU 0 .* is lost"):
        CudaBackend(Nvml(lib=lib))


def test_cuda_init_failure_is_an_actionable_device_error():
    lib = FakeNvmlLib(init_error=FakeNvmlLib.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(DeviceError) as info:
        CudaBackend(Nvml(lib=lib))
    message = str(info.value)
    assert message.startswith("cuda backend: NVML unavailable: nvmlInit failed: fake NVML error 12")
    assert message.endswith("install the NVIDIA driver or run with --backend cpu")


def test_cuda_zero_devices_is_a_device_error():
    with pytest.raises(CudaUnavailable, match="NVML found no GPU"):
        CudaBackend(Nvml(lib=FakeNvmlLib(gpus=[])))


def test_cuda_inaccessible_gpu_is_a_device_error():
    lib = FakeNvmlLib(two_gpus())
    lib.errors["nvmlDeviceGetHandleByIndex"] = lib.NVML_ERROR_NO_PERMISSION
    with pytest.raises(DeviceError, match="GPU 0 is not accessible"):
        CudaBackend(Nvml(lib=lib))


def test_cuda_real_nvml_failure_is_a_device_error():
    lib = FakeNvmlLib(two_gpus())
    backend = CudaBackend(Nvml(lib=lib))
    lib.errors["nvmlDeviceGetUtilizationRates"] = lib.NVML_ERROR_UNKNOWN
    with pytest.raises(DeviceError, match="nvmlDeviceGetUtilizationRates failed"):
        backend.device(0)


def test_cuda_bad_index_names_the_range():
    backend = CudaBackend(Nvml(lib=FakeNvmlLib(two_gpus())))
    with pytest.raises(DeviceError, match=r"no device 2; valid indices are 0\.\.1"):
        backend.device(2)
    with pytest.raises(DeviceError, match=r"valid indices are 0\.\.1"):
        backend.processes(-1)


def test_cuda_close_leaves_an_injected_nvml_open_and_refuses_later_calls():
    lib = FakeNvmlLib(two_gpus())
    nvml = Nvml(lib=lib)
    backend = CudaBackend(nvml)
    backend.close()
    backend.close()
    assert lib.shutdown_calls == 0 and nvml.initialized
    with pytest.raises(DeviceError, match="closed"):
        backend.device(0)


# --- cpu backend on this host ------------------------------------------------


def host_memory_total_bytes() -> int:
    """Read independently of the code under test."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_cpu_reports_the_hosts_real_memory():
    info = CpuBackend().device(0)
    assert info.backend == "cpu"
    assert info.memory_total_bytes == host_memory_total_bytes()
    assert info.memory_used_bytes is not None and 0 < info.memory_used_bytes < info.memory_total_bytes


def test_cpu_devices_have_distinct_uuids_stable_across_instances():
    first = CpuBackend(3).devices()
    again = CpuBackend(3).devices()
    uuids = [info.uuid for info in first]
    assert [info.index for info in first] == [0, 1, 2]
    assert len(set(uuids)) == 3
    assert uuids == [info.uuid for info in again]
    assert all(re.fullmatch(rf"CPU-[0-9a-f]{{8}}-{i}", uuid) for i, uuid in enumerate(uuids))
    assert re.fullmatch(rf"cpu:1 \(.+, {os.cpu_count()} cores\)", first[1].name)


def test_cpu_bad_index_names_the_range():
    backend = CpuBackend(2)
    with pytest.raises(DeviceError, match=r"cpu backend: no device 2; valid indices are 0\.\.1"):
        backend.device(2)
    with pytest.raises(DeviceError, match=r"valid indices are 0\.\.1"):
        backend.processes(-1)


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_cpu_count_below_one_is_rejected(count):
    with pytest.raises(DeviceError, match="device count must be an integer >= 1"):
        CpuBackend(count)


def test_cpu_has_no_device_processes():
    assert CpuBackend(2).processes(1) == []


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="utilisation needs /proc/stat")
def test_cpu_utilization_is_none_first_then_a_percentage():
    backend = CpuBackend(2)
    assert [info.utilization_percent for info in backend.devices()] == [None, None]
    deadline = time.perf_counter() + 0.1
    while time.perf_counter() < deadline:  # keep one core busy for a few clock ticks
        pass
    utilizations = [info.utilization_percent for info in backend.devices()]
    assert utilizations[0] == utilizations[1]  # one sample for the whole host
    assert isinstance(utilizations[0], float) and 0.0 < utilizations[0] <= 100.0


# --- choosing a backend ------------------------------------------------------


def nvml_works_here() -> bool:
    nvml = Nvml()
    try:
        return bool(nvml.query("nvmlDeviceGetCount"))
    except (NvmlUnavailable, NvmlError):
        return False
    finally:
        nvml.shutdown()


def test_auto_falls_back_to_cpu_and_says_why():
    lib = FakeNvmlLib(init_error=FakeNvmlLib.NVML_ERROR_LIBRARY_NOT_FOUND)
    backend, reason = open_backend("auto", cpu_devices=2, nvml=Nvml(lib=lib))
    assert (backend.name, backend.count()) == ("cpu", 2)
    assert reason == (
        "auto: no NVIDIA GPU (NVML: nvmlInit failed: fake NVML error 12), using cpu with 2 device(s)"
    )


def test_auto_picks_cuda_when_nvml_sees_gpus():
    backend, reason = open_backend("auto", nvml=Nvml(lib=FakeNvmlLib(two_gpus())))
    assert backend.name == "cuda"
    assert reason == "auto: NVML found 2 device(s)"


def test_auto_on_this_host_without_a_driver_picks_cpu():
    if nvml_works_here():
        pytest.skip("NVML works on this host; the cpu fallback is covered with a fake library")
    backend, reason = open_backend("auto")
    assert backend.name == "cpu"
    assert reason.startswith("auto: no NVIDIA GPU (NVML: ") and reason.endswith("using cpu with 1 device(s)")


def test_explicit_cuda_on_this_host_without_a_driver_is_actionable():
    if nvml_works_here():
        pytest.skip("NVML works on this host")
    with pytest.raises(DeviceError, match="install the NVIDIA driver or run with --backend cpu"):
        open_backend("cuda")


def test_explicit_cpu_uses_the_requested_count():
    backend, reason = open_backend("cpu", cpu_devices=3)
    assert (backend.name, backend.count()) == ("cpu", 3)
    assert reason == "cpu: requested, 3 device(s)"


def test_unknown_kind_names_the_valid_kinds():
    with pytest.raises(DeviceError, match="valid kinds are auto, cuda, cpu"):
        open_backend("rocm")


# --- real hardware -----------------------------------------------------------


@pytest.mark.gpu
def test_real_cuda_backend():
    try:
        backend = CudaBackend()
    except DeviceError as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    with backend:
        assert backend.count() >= 1
        for info in backend.devices():
            assert info.backend == "cuda"
            assert info.uuid.startswith(("GPU-", "MIG-"))
            assert info.memory_total_bytes > 0
            assert info.memory_used_bytes is None or 0 <= info.memory_used_bytes <= info.memory_total_bytes
            assert info.utilization_percent is None or 0.0 <= info.utilization_percent <= 100.0
            assert all(process.pid > 0 for process in backend.processes(info.index))


@pytest.mark.gpu
def test_real_nvml_lists_a_process_with_a_context_and_the_watcher_finds_it_under_us():
    """What the memory watcher relies on, on the lent machine: NVML lists a CUDA process with
    its memory, under a pid that translates to ours, whose parent chain reaches this process."""
    import queue
    import subprocess
    import sys

    from nodeagent.daemon.memory_watch import DeviceReading, MemoryWatcher

    try:
        backend = CudaBackend()
    except DeviceError as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    code = ("import sys, time, torch; x = torch.ones(64 << 20, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); print('ready', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        watcher = MemoryWatcher(backend, 1.0, queue.SimpleQueue(), lambda: None)
        deadline = time.monotonic() + 10
        while True:
            readings = [r for r in watcher.read_once() if isinstance(r, DeviceReading)]
            found = [p for r in readings for p in r.processes if p.pid == child.pid]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert found, f"NVML pids {[p.pid for i in range(backend.count()) for p in backend.processes(i)]}; " \
                      f"{watcher._translator.describe()}"
        assert os.getpid() in found[0].ancestors
        assert found[0].used_memory_bytes is None or found[0].used_memory_bytes >= 64 << 20
    finally:
        child.kill()
        child.wait()
        backend.close()


# --- Xid events -------------------------------------------------------------------


class XidNvmlLib(FakeNvmlLib):
    """The scripted library with NVML's event calls: ``pending`` holds (device index, xid)."""

    nvmlEventTypeXidCriticalError = 8
    NVML_ERROR_TIMEOUT = 10

    def __init__(self, gpus: list[FakeGpu]) -> None:
        super().__init__(gpus)
        self.pending: list[tuple[int, int]] = []
        self.registered: list[int] = []
        self.freed = 0

    def nvmlEventSetCreate(self) -> object:
        self._maybe_fail("nvmlEventSetCreate")
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: object) -> None:
        assert event_types == self.nvmlEventTypeXidCriticalError and event_set == "event-set"
        self._maybe_fail("nvmlDeviceRegisterEvents")
        self.registered.append(handle.index)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0  # never blocks the watcher
        self._maybe_fail("nvmlEventSetWait_v2")
        if not self.pending:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT)
        index, xid = self.pending.pop(0)
        return SimpleNamespace(device=FakeHandle(index), eventType=self.nvmlEventTypeXidCriticalError,
                               eventData=xid)

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.freed += 1


def test_xid_events_are_read_per_device_and_only_the_context_faults_end_contexts():
    from nodeagent.devices import DeviceFault

    lib = XidNvmlLib(two_gpus())
    backend = CudaBackend(Nvml(lib=lib))
    assert backend.faults() == [] and lib.registered == [0, 1]  # every device registered, none pending
    lib.pending = [(1, 31), (0, 79), (1, 13)]
    faults = backend.faults()
    assert faults == [DeviceFault(1, 31), DeviceFault(0, 79), DeviceFault(1, 13)]
    assert [f.ends_contexts for f in faults] == [True, False, True]
    lib.pending = [(0, 43)] * 100  # a storm: a bounded number per read, the rest the next time
    assert len(backend.faults()) == 64 and len(backend.faults()) == 36
    backend.close()
    assert lib.freed == 1


def test_without_xid_events_faults_reads_nothing_and_a_failing_read_stops_reading():
    lib = XidNvmlLib(two_gpus())
    lib.errors["nvmlEventSetCreate"] = lib.NVML_ERROR_NOT_SUPPORTED
    assert CudaBackend(Nvml(lib=lib)).faults() == []
    lib = XidNvmlLib(two_gpus())
    backend = CudaBackend(Nvml(lib=lib))
    backend.faults()
    lib.errors["nvmlEventSetWait_v2"] = lib.NVML_ERROR_UNKNOWN
    lib.pending = [(0, 31)]
    assert backend.faults() == [] and backend.faults() == []  # said once in the log, then not asked again
