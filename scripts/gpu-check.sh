#!/usr/bin/env bash
# What a lent GPU machine runs, as two profiles of one device call each (each fits 540 s, the
# install of the carried wheels included), ordered by what is still unproven:
#
#   bash scripts/gpu-check.sh --profile colocate [--dry-run] [OUT_DIR]
#   bash scripts/gpu-check.sh --profile rest [--dry-run] [OUT_DIR]
#   bash scripts/gpu-check.sh --plan --profile NAME     the plan only: each step and its cap, the fixed
#                                                       costs and the budget (nothing installed or run)
#
#   colocate  bench.colocate: an inference service beside a trainer, every mode at both loads (45 and
#             30.4 req/s, 600 requests a cell), the baselines in the same run, each MPS mode's evidence
#   rest      LLM sleep and wake (outside MPS and as an MPS client), MPS fault isolation (and the
#             30/70 MPS tests), pytest -m gpu, park with addresses kept (beside a pinned cudaMemcpy),
#             NCCL park, switch, suspend, reclaim, the Ray loan (with .whl/ray-site.tar.xz)
#
# Every benchmark's daemon runs on the cuda backend. Each step has a cap and the profile a budget
# (GPU_CHECK_BUDGET_S, default 540 s) that holds the fixed costs too (the wheels' install, the
# environment probe, the summary): a step starts only when its whole cap fits what is left, else it
# is recorded skipped-budget by name; nothing is cut mid-measurement (tests/bench/test_gpu_check.py holds
# each profile's caps to its budget). A failing step is recorded and the next one runs.
#
# Output: OUT_DIR/<gpu>-<date>/ (OUT_DIR defaults to $OUT, else bench/out/gpu-check), a folder to
# copy into bench/results/ as it is: every step's JSON and log, env.txt/env.json, steps-PROFILE.tsv,
# summary-PROFILE.json/.txt and README.md (bench.gpu_summary: each figure beside its goal and its
# in-run baseline). The two profiles' folders of one machine go into one folder; then
# `python -m bench.gpu_summary --readme bench/results/<gpu>-<date>` writes its README from both.
#
# Without a CUDA device (or with --dry-run) it installs the wheels, records the environment and lists
# each step with its cap and command line, not run. Settings: PYTHON (default python3; .venv/bin/python
# when python3 has no torch), GPU_CHECK_WHEELS (default .whl), GPU_CHECK_SITE (the private target),
# GPU_CHECK_BUDGET_S, GPU_CHECK_STEPS (comma-separated shell patterns: only those steps run, the
# others are listed as not asked), GPU_CHECK_TREE (the commit the tree is, for the README),
# GPU_CHECK_FORCE=1 (tests: run the steps even without a GPU, to exercise the budget).
set -uo pipefail  # not -e: a failing step is recorded, and the next one runs
cd "$(dirname "$0")/.."
repo=$(pwd)
t_start=$SECONDS

# The fixed costs every profile pays, as caps (the 2026-11-23 runs: wheels 1 s, probe 5 s).
WHEELS_CAP_S=20
ENV_CAP_S=${GPU_CHECK_ENV_CAP_S:-30}  # tests on a loaded 2-core VM give the probe more
RESERVE_S=15  # the summary, the README and the copy out
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
PROFILES="colocate rest"

dry=0
plan_only=0
profile=""
out_dir=""
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry=1 ;;
        --plan) plan_only=1 ;;
        --profile) profile=${2:-}; shift ;;
        --profile=*) profile=${1#--profile=} ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        -*) echo "gpu-check: unknown option $1 (try --help)" >&2; exit 2 ;;
        *) out_dir=$1 ;;
    esac
    shift
done
case " $PROFILES " in
    *" $profile "*) ;;
    *) echo "gpu-check: choose a profile: --profile colocate or --profile rest${profile:+ (not $profile)}" >&2
       exit 2 ;;
esac
budget_s=$BUDGET_S
steps_wanted=${GPU_CHECK_STEPS:-}
wheels=${GPU_CHECK_WHEELS:-.whl}
site=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/nodeagent-gpu-site}
python=${PYTHON:-python3}
# Whether torch is installed, found without importing it (an import is seconds of CPU; the probe imports it).
has_torch='import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'
if [ "$plan_only" = 0 ] && ! "$python" -c "$has_torch" >/dev/null 2>&1 && [ -x .venv/bin/python ]; then
    python=.venv/bin/python
fi
if [ "$plan_only" = 1 ]; then
    stage='$OUT_DIR/<gpu>-<date>'  # shown in the plan's command lines
else
    out_dir=${out_dir:-${OUT:-bench/out/gpu-check}}
    mkdir -p "$out_dir" && out_dir=$(cd "$out_dir" && pwd)
    work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
    stage=$work/evidence
    mkdir -p "$stage"
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "gpu-check: $*"; }

record() {  # NAME STATUS RC SECONDS CAP COMMAND
    [ "$plan_only" = 1 ] || printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$stage/steps.tsv"
}
[ "$plan_only" = 1 ] || printf 'step\tstatus\trc\tseconds\tcap\tcommand\n' >"$stage/steps.tsv"

step_wanted() {  # NAME: in GPU_CHECK_STEPS (every step when it is unset)
    local pattern
    [ -z "$steps_wanted" ] && return 0
    for pattern in ${steps_wanted//,/ }; do
        # shellcheck disable=SC2053  # a pattern, on purpose
        [[ $1 == $pattern ]] && return 0
    done
    return 1
}

run_step() {  # NAME CAP_S STDOUT(file, or - for the log) COMMAND...
    local name=$1 cap=$2 stdout=$3
    shift 3
    local cmdline left t0 rc status
    cmdline=$(printf '%q ' "$@")
    cmdline=${cmdline% }
    if [ "$plan_only" = 1 ]; then
        echo "step $name cap $cap s: $cmdline"
        return
    fi
    if ! step_wanted "$name"; then
        record "$name" not-asked - 0 "$cap" "$cmdline"
        say "$name: not run (not in GPU_CHECK_STEPS)"
        return
    fi
    if [ "$dry" = 1 ]; then
        record "$name" planned - 0 "$cap" "$cmdline"
        say "$name: cap $cap s: not run (dry run): $cmdline"
        return
    fi
    left=$((budget_s - (SECONDS - t_start) - RESERVE_S))
    if [ "$cap" -gt "$left" ]; then  # it could be cut mid-measurement: not started
        record "$name" skipped-budget - 0 "$cap" "$cmdline"
        say "$name: skipped-budget (cap $cap s, ${left}s of the budget left)"
        return
    fi
    say "$name: running (cap ${cap}s, ${left}s of the budget left)"
    t0=$SECONDS
    if [ "$stdout" = - ]; then
        timeout --kill-after=10 "$cap" "$@" >"$stage/$name.log" 2>&1
    else
        timeout --kill-after=10 "$cap" "$@" >"$stdout" 2>"$stage/$name.log"
    fi
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    record "$name" "$status" "$rc" "$((SECONDS - t0))" "$cap" "$cmdline"
    say "$name: $status (rc $rc) in $((SECONDS - t0))s"
}

# ------------------------------------------------------------------ wheels

install_wheels() {
    local t0=$SECONDS found
    found=$(ls "$wheels"/*.whl 2>/dev/null | wc -l)
    if [ "$found" -eq 0 ]; then
        record wheels missing - 0 "$WHEELS_CAP_S" "no wheels in $wheels/"
        say "wheels: none in $wheels/ (run scripts/gpu-wheels.sh on a networked machine and carry .whl)"
        return
    fi
    rm -rf "$site"
    local platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    for n in 17 24 26 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    # The tags of the GPU machine's Python (3.12) named outright, so that the same step checks the
    # wheels here too, whatever this interpreter is.
    timeout "$WHEELS_CAP_S" "$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
        --target "$site" "$wheels"/*.whl >"$stage/wheels.log" 2>&1
    local rc=$?
    ls "$site" >>"$stage/wheels.log" 2>&1
    if [ $rc -ne 0 ]; then
        record wheels failed $rc $((SECONDS - t0)) "$WHEELS_CAP_S" "pip install --target $site $wheels/*.whl"
        say "wheels: pip install failed (rc $rc), see wheels.log"
        return
    fi
    if "$python" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
        export PYTHONPATH="$repo:$site${PYTHONPATH#"$repo"}"
        record wheels ok 0 $((SECONDS - t0)) "$WHEELS_CAP_S" "pip install --target $site $wheels/*.whl"
        say "wheels: $found installed into $site (on PYTHONPATH)"
    else
        record wheels unpacked 0 $((SECONDS - t0)) "$WHEELS_CAP_S" "pip install --target $site $wheels/*.whl"
        say "wheels: $found unpacked into $site for Python 3.12; this is $("$python" -V 2>&1): its own packages are used"
    fi
}

install_ray() {  # .whl/ray-site.tar.xz (scripts/gpu-wheels.sh --ray): Ray, trimmed, for the Ray GPU test
    local bundle=$wheels/ray-site.tar.xz t0=$SECONDS
    [ -f "$bundle" ] || return 0
    if ! timeout "$WHEELS_CAP_S" tar -xJf "$bundle" -C "$site" >>"$stage/wheels.log" 2>&1; then
        record ray-wheels failed 1 $((SECONDS - t0)) "$WHEELS_CAP_S" "tar -xJf $bundle -C $site"
        return
    fi
    # pip --target wrote the console script for the interpreter that built it: point it at ours.
    sed -i "1s|.*|#!$(command -v "$python")|" "$site/bin/ray" && export PATH="$site/bin:$PATH"
    record ray-wheels ok 0 $((SECONDS - t0)) "$WHEELS_CAP_S" "tar -xJf $bundle -C $site"
    # Its version from its metadata, not an import (seconds of CPU; the ray-gpu step imports it).
    say "ray: unpacked into $site ($("$python" -c 'import importlib.metadata as m; print(m.version("ray"))' 2>&1 | tail -n1))"
}

# ------------------------------------------------------------------ environment

probe_env() {
    local t0=$SECONDS probe_rc=1
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "uname: $(uname -a)"
        echo "cpus: $(nproc)"
        free -m 2>&1 | head -n 2
        df -h /dev/shm 2>&1 | tail -n 1
        echo "memlock limit: $(ulimit -l)"
        echo "mps control: $(command -v nvidia-cuda-mps-control || echo 'not on PATH')"
        echo "--- nvidia-smi -L"
        nvidia-smi -L 2>&1 || true
        echo "--- nvidia-smi --query-gpu"
        nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,compute_cap,pcie.link.gen.max,pcie.link.width.max \
            --format=csv 2>&1 || true
        echo "--- python probe"
        echo "tree: ${GPU_CHECK_TREE:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
        timeout "$ENV_CAP_S" "$python" - "$stage/env.json" "${GPU_CHECK_TREE:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" <<'PY' 2>&1
import json, os, platform, signal, socket, struct, sys, time
info, path = {"python": sys.version.split()[0], "executable": sys.executable, "tree": sys.argv[2]}, sys.argv[1]

def probe(name, fn):
    try:
        info[name] = fn()
    except Exception as exc:  # every probe may fail on some machine: record it and go on
        info[name] = f"error: {type(exc).__name__}: {exc}"

def torch_info():
    import torch
    out = {"version": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if out["available"]:
        p = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), count=torch.cuda.device_count(),
                   capability=list(torch.cuda.get_device_capability(0)), memory_bytes=p.total_memory,
                   multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32)
        torch.ones(1, device="cuda").sum().item()
    return out

def module_info(name):
    import importlib
    m = importlib.import_module(name)
    return {"version": getattr(m, "__version__", "?"), "file": m.__file__}

def driver():
    import pynvml
    pynvml.nvmlInit()
    try:
        d = pynvml.nvmlSystemGetDriverVersion()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        return {"driver": d.decode() if isinstance(d, bytes) else d, "count": pynvml.nvmlDeviceGetCount(),
                "uuid0": uuid.decode() if isinstance(uuid, bytes) else uuid}
    finally:
        pynvml.nvmlShutdown()

def cudart():  # which libcudart the engine clears errors through (ctxpool.hostmem)
    import torch
    if not torch.cuda.is_available():
        return "no CUDA"
    from ctxpool import hostmem
    lib = hostmem._torch_cudart()
    return lib._name if lib is not None else None

def page_lock():  # cudaHostRegister/Unregister in place, as the engine pins model weights
    import mmap, torch
    if not torch.cuda.is_available():
        return "no CUDA"
    from ctxpool import hostmem
    from ctxpool.hostmem import PinRegistry
    buf = mmap.mmap(-1, 4 << 20)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    pins = PinRegistry()
    locked = pins.pin("probe", [(base, base + (4 << 20))])
    out = {"locked_bytes": locked, "unlocked_bytes": pins.unpin("probe")}
    # Two facts the engine relies on (the first GPU run taught both): torch's is_pinned() asks about
    # a tensor's storage, and a copy whose source runs past a registration's end fails.
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    pins.pin("half", [(base, base + (2 << 20))])
    out["is_pinned_storage_registered"] = whole[4096:8192].is_pinned()
    out["is_pinned_asks_the_storage_not_the_data"] = whole[(2 << 20) + 4096:].is_pinned()
    try:
        whole[(2 << 20) - 4096:(2 << 20) + 4096].to("cuda")
        torch.cuda.synchronize()
        out["copy_straddling_registration_end"] = "ok"
    except Exception as exc:
        out["copy_straddling_registration_end"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        hostmem._clear_cuda_last_error()
    pins.unpin("half")
    del whole
    return out

def pidfd():
    fd = os.pidfd_open(os.getpid())
    os.close(fd)
    return "ok"

def peercred():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid, uid, gid = struct.unpack("3i", a.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    a.close(), b.close()
    return {"pid_matches": pid == os.getpid(), "uid": uid}

def sigstop():  # the daemon stops hogs with SIGSTOP and reads their state from /proc
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.2)
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        os.kill(pid, signal.SIGCONT)
        return {"state_after_sigstop": state}
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

def nspid():
    with open("/proc/self/status") as f:
        return [line.split(":", 1)[1].split() for line in f if line.startswith("NSpid")]

def shm():
    st = os.statvfs("/dev/shm")
    from client_lib import tensors
    seg = tensors.create_segment(1 << 20, "na-probe", reserve=True)
    seg.close(), seg.unlink()
    return {"size_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize, "fallocate": "ok"}

probe("torch", torch_info)
probe("nvml", driver)
for name in ("zmq", "msgspec", "prometheus_client", "pynvml"):
    probe(name, lambda name=name: module_info(name))
probe("libcudart", cudart)
probe("page_lock", page_lock)
probe("pidfd_open", pidfd)
probe("so_peercred", peercred)
probe("sigstop", sigstop)
probe("nspid", nspid)
probe("dev_shm", shm)
info["kernel"] = platform.release()
with open(path, "w") as f:
    json.dump(info, f, indent=2)
for key, value in info.items():
    print(f"{key}: {value}")
PY
        probe_rc=$?
    } >"$stage/env.txt" 2>&1
    local status=ok
    case $probe_rc in 0) ;; 124|137) status=timeout ;; *) status=failed ;; esac
    record env "$status" "$probe_rc" $((SECONDS - t0)) "$ENV_CAP_S" "environment probe"
}

# ------------------------------------------------------------------ the profiles
#
# Each step: NAME CAP_S STDOUT COMMAND. The caps are what a step may take on an H100/H200, from the
# runs of 2026-11-23 and -27 with room; with the fixed costs they must fit BUDGET_S
# (tests/bench/test_gpu_check.py adds them up from `--plan`).

plan_colocate() {
    # Issue 30's measurement: the baselines (alone, no daemon, MPS priority) and the default first,
    # then the other nodeagent modes; bench.colocate starts a mode only when it fits its own budget.
    run_step colocate 470 "$stage/colocate.json" "$python" -m bench.colocate --device cuda --requests 600 \
        --modes alone,mps-priority,corun,no-daemon,corun-pause,corun-free,mps,corun-nomps --budget-s 455 --json
}

plan_rest() {
    run_step llm-wake 60 "$stage/llm-wake.json" "$python" -m bench.llm_wake --device cuda --mps off --json
    run_step llm-wake-mps 55 "$stage/llm-wake-mps.json" "$python" -m bench.llm_wake --device cuda --mps on \
        --cold-repeats 1 --json
    run_step mps-fault 45 "$stage/mps-fault.json" "$python" -m bench.mps_fault --json
    run_step mps 30 - env NODEAGENT_RESULTS_DIR="$stage" "$python" -m pytest -m gpu -p no:cacheprovider -q -rs \
        -o timeout=20 --junitxml="$stage/mps.xml" tests/daemon/test_mps.py tests/daemon/test_mps_daemon.py
    run_step pytest-gpu 65 - env NODEAGENT_RESULTS_DIR="$stage" "$python" -m pytest -m gpu -p no:cacheprovider -q \
        -rs -o timeout=60 --junitxml="$stage/pytest-gpu.xml" --ignore=tests/daemon/test_mps.py \
        --ignore=tests/daemon/test_mps_daemon.py --ignore=tests/client_lib/test_nccl_park.py --ignore=tests/ray/test_ray_gpu.py tests
    run_step park-keep-addresses 45 "$stage/park-keep-addresses.json" "$python" -m bench.suspend --device cuda \
        --state-mb 1024 --repeats 3 --keep-addresses --no-daemon --json  # a restart of 1 GiB is 10 s of it
    run_step nccl-park 20 - "$python" -m pytest -m gpu -p no:cacheprovider -q -rs -s -o timeout=20 \
        --junitxml="$stage/nccl-park.xml" tests/client_lib/test_nccl_park.py
    local plot=(--plot "$stage/switch.png")
    [ "$plan_only" = 0 ] && ! "$python" -c "import matplotlib" >/dev/null 2>&1 && plot=()
    run_step switch 40 "$stage/switch.json" "$python" -m bench.switch --backend cuda --repeats 3 --cold-repeats 1 \
        --json "${plot[@]}"
    run_step suspend 35 "$stage/suspend.json" "$python" -m bench.suspend --device cuda --state-mb 256,1024 \
        --repeats 3 --json
    run_step reclaim 30 "$stage/reclaim.json" "$python" -m bench.reclaim --device cuda --repeats 3 --state-mb 256 \
        --json
    if [ "$plan_only" = 1 ] || [ -f "$wheels/ray-site.tar.xz" ]; then  # a loan raylet given the GPU by UUID
        run_step ray-gpu 45 - "$python" -m pytest -m gpu -p no:cacheprovider -q -rs -s -o timeout=45 \
            --junitxml="$stage/ray-gpu.xml" tests/ray/test_ray_gpu.py
    else
        record ray-gpu not-carried - 0 45 "no $wheels/ray-site.tar.xz (scripts/gpu-wheels.sh --ray)"
        say "ray-gpu: not run (no $wheels/ray-site.tar.xz)"
    fi
}

if [ "$plan_only" = 1 ]; then
    echo "plan $profile: budget $budget_s s; fixed: wheels cap $WHEELS_CAP_S s, env cap $ENV_CAP_S s, reserve $RESERVE_S s"
    "plan_$profile"
    exit 0
fi

# ------------------------------------------------------------------ run

install_wheels
[ "$profile" = rest ] && install_ray
probe_env
torch_line=$("$python" - "$stage/env.json" <<'PY' 2>/dev/null
import json, sys
t = json.load(open(sys.argv[1])).get("torch")
print(f"cuda {t['device']}" if isinstance(t, dict) and t.get("available") else
      f"torch {t.get('version')} cuda {t.get('cuda')}, no device" if isinstance(t, dict) else f"torch: {t}")
PY
)
if [ "${GPU_CHECK_FORCE:-0}" = 1 ] && [ "$dry" = 0 ]; then  # tests: the steps run (and fail) without a GPU
    say "GPU_CHECK_FORCE=1: running the steps whatever this machine has (${torch_line:-no torch})"
elif [ "${torch_line#cuda }" = "$torch_line" ] && [ "$dry" = 0 ]; then
    say "no CUDA device here (${torch_line:-no torch}): dry run, wheels and environment only"
    dry=1
elif [ "$dry" = 1 ]; then
    say "dry run (--dry-run): wheels and environment only"
fi
say "profile $profile: budget ${budget_s}s, $((SECONDS - t_start))s spent on the wheels and the probe"
"plan_$profile"
if [ "$dry" = 0 ]; then
    nvidia-smi >"$stage/nvidia-smi-after-$profile.txt" 2>&1 || true  # memory still held, processes left behind
fi

# ------------------------------------------------------------------ summary and the folder

cp "$stage/steps.tsv" "$stage/steps-$profile.tsv"
tag=$("$python" -m bench.gpu_summary "$stage" --profile "$profile" $([ "$dry" = 1 ] && echo --dry-run) 2>"$stage/summary.log")
if [ -z "$tag" ]; then
    tag="unknown-$(date -u +%Y-%m-%d)"
    say "the summary failed ($(tail -n1 "$stage/summary.log" 2>/dev/null)); copying what there is"
fi
rm -f "$stage/steps.tsv"
mkdir -p "$out_dir/$tag"
cp -r "$stage"/. "$out_dir/$tag/"
rm -rf "$work"
say "evidence: $out_dir/$tag/ ($(du -sh "$out_dir/$tag" | cut -f1)); commit it as bench/results/$tag/"
say "  (with the other profile's folder copied in: python -m bench.gpu_summary --readme bench/results/$tag)"
echo
cat "$out_dir/$tag/summary-$profile.txt" 2>/dev/null
"$python" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" \
    "$out_dir/$tag/summary-$profile.json" 2>/dev/null
