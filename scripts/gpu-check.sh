#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one command that ends well inside 10 minutes:
#
#   bash scripts/gpu-check.sh [--dry-run] [OUT_DIR]          (OUT_DIR defaults to $OUT, else bench/out/gpu-check)
#
# 1. installs the wheels in .whl/ (scripts/gpu-wheels.sh fetched them on a networked machine) into a
#    private target and puts it on PYTHONPATH; 2. records the machine (env.txt, env.json: GPU, driver,
#    torch, and what the daemon relies on: pidfd_open, SO_PEERCRED, SIGSTOP, /dev/shm, page-locking);
# 3. pytest -m gpu; 4. bench.switch, bench.suspend, bench.reclaim, bench.llm_wake and bench.handoff on cuda,
#    bench.handoff on the host's cores, and bench.colocate (inference p99 and
#    training kept beside each other, per sharing mode: no daemon, MPS, nodeagent); with .whl/ray-site.tar.xz
#    (gpu-wheels.sh --ray) the Ray loan-node GPU test; 5. bench.mps_fault (a fault under MPS beside a healthy
#    service) and the MPS tests (30/70 split) last, as they
#    start an MPS control daemon. Each step has its own time
#    limit and the whole run a budget (GPU_CHECK_BUDGET_S, default 540 s): a hang costs one step, and
#    a failing step is recorded and the next one runs. Everything lands in ONE tarball,
#    OUT_DIR/gpu-check-<gpu>-<date>.tar.gz (a folder <gpu>-<date>/ to untar into bench/results/),
#    beside summary.json, summary.txt and switch.png; a short table is printed last.
#
# Without a CUDA device (or with --dry-run) it says so in one line and still installs the wheels and
# records the environment; each GPU step is listed with its command line, not run.
# Settings: PYTHON (default python3; .venv/bin/python when python3 has no torch), GPU_CHECK_WHEELS
# (default .whl), GPU_CHECK_SITE (the private target), GPU_CHECK_BUDGET_S, GPU_CHECK_STEPS (a comma-
# separated list of the GPU steps to run, shell patterns allowed, e.g. colocate,mps*,llm-wake: a short
# session's device time goes to the open issues' measurements first; the others are listed as not asked).
set -uo pipefail  # not -e: a failing step is recorded, and the next one runs
cd "$(dirname "$0")/.."
repo=$(pwd)
t_start=$SECONDS

dry=0
out_dir=""
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        -*) echo "gpu-check: unknown option $arg (try --help)" >&2; exit 2 ;;
        *) out_dir=$arg ;;
    esac
done
out_dir=${out_dir:-${OUT:-bench/out/gpu-check}}
mkdir -p "$out_dir" && out_dir=$(cd "$out_dir" && pwd)
budget_s=${GPU_CHECK_BUDGET_S:-540}
steps_wanted=${GPU_CHECK_STEPS:-}
reserve_s=20  # kept back for the summary and the tarball
wheels=${GPU_CHECK_WHEELS:-.whl}
site=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/nodeagent-gpu-site}
python=${PYTHON:-python3}
if ! "$python" -c "import torch" >/dev/null 2>&1 && [ -x .venv/bin/python ]; then
    python=.venv/bin/python
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
stage=$work/evidence
mkdir -p "$stage"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "gpu-check: $*"; }

record() {  # NAME STATUS RC SECONDS COMMAND
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$stage/steps.tsv"
}
printf 'step\tstatus\trc\tseconds\tcommand\n' >"$stage/steps.tsv"

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
    local cmdline left limit t0 rc status
    cmdline=$(printf '%q ' "$@")
    cmdline=${cmdline% }
    if ! step_wanted "$name"; then
        record "$name" not-asked - 0 "$cmdline"
        say "$name: not run (not in GPU_CHECK_STEPS)"
        return
    fi
    if [ "$dry" = 1 ]; then
        record "$name" planned - 0 "$cmdline"
        say "$name: not run (dry run): $cmdline"
        return
    fi
    left=$((budget_s - (SECONDS - t_start) - reserve_s))
    limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 15 ]; then
        record "$name" skipped-budget - 0 "$cmdline"
        say "$name: skipped, ${left}s of the budget left"
        return
    fi
    say "$name: running (limit ${limit}s)"
    t0=$SECONDS
    if [ "$stdout" = - ]; then
        timeout --kill-after=10 "$limit" "$@" >"$stage/$name.log" 2>&1
    else
        timeout --kill-after=10 "$limit" "$@" >"$stdout" 2>"$stage/$name.log"
    fi
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    record "$name" "$status" "$rc" "$((SECONDS - t0))" "$cmdline"
    say "$name: $status (rc $rc) in $((SECONDS - t0))s"
}

# ------------------------------------------------------------------ wheels

install_wheels() {
    local t0=$SECONDS found
    found=$(ls "$wheels"/*.whl 2>/dev/null | wc -l)
    if [ "$found" -eq 0 ]; then
        record wheels missing - 0 "no wheels in $wheels/"
        say "wheels: none in $wheels/ (run scripts/gpu-wheels.sh on a networked machine and carry .whl)"
        return
    fi
    rm -rf "$site"
    local platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    for n in 17 24 26 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    # The tags of the GPU machine's Python (3.12) named outright, so that the same step checks the
    # wheels here too, whatever this interpreter is.
    "$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
        --target "$site" "$wheels"/*.whl >"$stage/wheels.log" 2>&1
    local rc=$?
    ls "$site" >>"$stage/wheels.log" 2>&1
    if [ $rc -ne 0 ]; then
        record wheels failed $rc $((SECONDS - t0)) "pip install --target $site $wheels/*.whl"
        say "wheels: pip install failed (rc $rc), see wheels.log"
        return
    fi
    if "$python" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
        export PYTHONPATH="$repo:$site${PYTHONPATH#"$repo"}"
        record wheels ok 0 $((SECONDS - t0)) "pip install --target $site $wheels/*.whl"
        say "wheels: $found installed into $site (on PYTHONPATH)"
    else
        record wheels unpacked 0 $((SECONDS - t0)) "pip install --target $site $wheels/*.whl"
        say "wheels: $found unpacked into $site for Python 3.12; this is $("$python" -V 2>&1): its own packages are used"
    fi
}

install_ray() {  # .whl/ray-site.tar.xz (scripts/gpu-wheels.sh --ray): Ray, trimmed, for the Ray GPU test
    local bundle=$wheels/ray-site.tar.xz t0=$SECONDS
    [ -f "$bundle" ] || return 0
    if ! tar -xJf "$bundle" -C "$site" >>"$stage/wheels.log" 2>&1; then
        record ray-wheels failed 1 $((SECONDS - t0)) "tar -xJf $bundle -C $site"
        return
    fi
    # pip --target wrote the console script for the interpreter that built it: point it at ours.
    sed -i "1s|.*|#!$(command -v "$python")|" "$site/bin/ray" && export PATH="$site/bin:$PATH"
    record ray-wheels ok 0 $((SECONDS - t0)) "tar -xJf $bundle -C $site"
    say "ray: unpacked into $site ($("$python" -c 'import ray; print(ray.__version__)' 2>&1 | tail -n1))"
}

# ------------------------------------------------------------------ environment

probe_env() {
    local t0=$SECONDS
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
        timeout 120 "$python" - "$stage/env.json" <<'PY' 2>&1
import json, os, platform, signal, socket, struct, sys, time
info, path = {"python": sys.version.split()[0], "executable": sys.executable}, sys.argv[1]

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
    } >"$stage/env.txt" 2>&1
    record env ok 0 $((SECONDS - t0)) "environment probe"
}

# ------------------------------------------------------------------ run

install_wheels
install_ray
probe_env
torch_line=$("$python" - "$stage/env.json" <<'PY' 2>/dev/null
import json, sys
t = json.load(open(sys.argv[1])).get("torch")
print(f"cuda {t['device']}" if isinstance(t, dict) and t.get("available") else
      f"torch {t.get('version')} cuda {t.get('cuda')}, no device" if isinstance(t, dict) else f"torch: {t}")
PY
)
if [ "${torch_line#cuda }" = "$torch_line" ] && [ "$dry" = 0 ]; then
    say "no CUDA device here (${torch_line:-no torch}): dry run, wheels and environment only"
    dry=1
elif [ "$dry" = 1 ]; then
    say "dry run (--dry-run): wheels and environment only"
fi

run_step pytest-gpu 170 - env NODEAGENT_RESULTS_DIR="$stage" "$python" -m pytest -m gpu -p no:cacheprovider -q -rs -o timeout=90 \
    --junitxml="$stage/pytest-gpu.xml" --ignore=tests/test_mps.py --ignore=tests/test_mps_daemon.py tests
plot=(--plot "$stage/switch.png")
"$python" -c "import matplotlib" >/dev/null 2>&1 || plot=()  # the numbers matter more than the chart
run_step switch 200 "$stage/switch.json" "$python" -m bench.switch --backend cuda --repeats 5 --cold-repeats 2 \
    --json "${plot[@]}"
run_step suspend 100 "$stage/suspend.json" "$python" -m bench.suspend --device cuda --state-mb 256,1024 --repeats 5 --json
run_step reclaim 90 "$stage/reclaim.json" "$python" -m bench.reclaim --device cuda --repeats 5 --state-mb 256 --json
run_step llm-wake 120 "$stage/llm-wake.json" "$python" -m bench.llm_wake --device cuda --json
run_step handoff 80 "$stage/handoff.json" "$python" -m bench.handoff --sessions 8 --handoffs 2000 --work-device cuda --json
# The handoff on the host's cores, no GPU work: back to back and with a 200 us slice.
for hold in 0 200; do
    run_step "handoff-hold$hold" 75 "$stage/handoff-hold$hold.json" \
        "$python" -m bench.handoff --sessions 2,64 --handoffs 3000 --hold-us "$hold" --json
done
# Issue 20's question: an inference service (ResNet-50, batch 8 and 64) beside a ResNet-50 trainer, per
# sharing mode, baselines in the same run; 5 s phases and the modes that answer it keep it inside 240 s.
run_step colocate 240 "$stage/colocate.json" "$python" -m bench.colocate --device cuda --phase-s 5 \
    --modes alone,no-daemon,mps-priority,exclusive,corun,corun-nomps,corun-pause,corun-free --json
if [ -f "$wheels/ray-site.tar.xz" ]; then  # a loan raylet given the GPU by UUID (nodeagent_ray, docs/cluster.md)
    run_step ray-gpu 120 - "$python" -m pytest -m gpu -p no:cacheprovider -q -rs -s -o timeout=110 \
        --junitxml="$stage/pytest-ray-gpu.xml" tests/test_ray_gpu.py
fi
# Issue 21's last measurement: a client's fault under MPS beside a healthy service, fault to its next good request.
run_step mps-fault 120 "$stage/mps-fault.json" "$python" -m bench.mps_fault --json
run_step mps 120 - env NODEAGENT_RESULTS_DIR="$stage" "$python" -m pytest -m gpu -p no:cacheprovider -q -rs \
    -o timeout=90 --junitxml="$stage/pytest-mps.xml" tests/test_mps.py tests/test_mps_daemon.py
if [ "$dry" = 0 ]; then
    nvidia-smi >"$stage/nvidia-smi-after.txt" 2>&1 || true  # memory still held, processes left behind
fi

# ------------------------------------------------------------------ summary and tarball

tag=$("$python" - "$stage" "$dry" "$out_dir" <<'PY'
import csv, json, os, re, sys, time
import xml.etree.ElementTree as ET

stage, dry, out_dir = sys.argv[1], sys.argv[2] == "1", sys.argv[3]

def load(name):
    try:
        with open(os.path.join(stage, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

def junit(name):
    try:
        root = ET.parse(os.path.join(stage, name)).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    total["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                             if c.find("failure") is not None or c.find("error") is not None]
    return total

env = load("env.json") or {}
torch_env = env.get("torch") if isinstance(env.get("torch"), dict) else {}
gpu = torch_env.get("device") if torch_env.get("available") else None
slug = re.sub(r"[^a-z0-9]+", "-", (gpu or "nogpu").lower()).strip("-")
slug = re.sub(r"^nvidia-", "", slug)
tag = f"{slug}-{time.strftime('%Y-%m-%d', time.gmtime())}"

with open(os.path.join(stage, "steps.tsv")) as f:
    steps = list(csv.DictReader(f, delimiter="\t"))

def headline(step):
    name = step["step"]
    if name == "env":
        nvml = env.get("nvml") if isinstance(env.get("nvml"), dict) else {}
        return (f"{gpu}, driver {nvml.get('driver', '?')}, torch {torch_env.get('version')} (cuda {torch_env.get('cuda')})"
                if gpu else f"no CUDA device; torch {torch_env.get('version', '?')}, python {env.get('python')}")
    if name == "wheels":
        return step["command"]
    if name in ("pytest-gpu", "mps", "ray-gpu"):
        j = junit({"pytest-gpu": "pytest-gpu.xml", "mps": "pytest-mps.xml", "ray-gpu": "pytest-ray-gpu.xml"}[name])
        text = (f"{j['passed']} passed, {j['failures'] + j['errors']} failed, {j['skipped']} skipped"
                if j else "no junit report")
        mps = load("mps_30_70.json") if name == "mps" else None
        if mps:
            text += f"; 70/30 throughput ratio {mps['throughput_ratio']:.2f} (ideal {mps['expected_ratio']:.2f})"
        return text
    r = load(f"{name}.json")
    if not r:
        return ""
    if name == "switch":
        parts = []
        for model, m in r["models"].items():
            parts.append(f"{model}: ready {m['ready_ms']:.1f} pipelined {m['pipelined_ms']:.1f} sequential "
                         f"{m['sequential_ms']:.1f} pinned+sync {m['pinned_sync_ms']:.1f} pageable "
                         f"{m['warm_pageable_ms']:.1f} cold {m['cold_ms']:.0f} ms, overhead "
                         f"{100 * m['overhead_ratio']:.3f}%" + (f", swap eff {m['swap_efficiency']}"
                                                                 if "swap_efficiency" in m else ""))
        return "; ".join(parts)
    if name == "suspend":
        return ", ".join(f"{k} MiB {v['speedup']}x (verified {v['verified']})" for k, v in r["sizes"].items())
    if name == "reclaim":
        return (f"cooperative {r['reclaim_cooperative_ms']} ms (park {r['park_ms']} ms), "
                f"enforced {r['reclaim_enforced_ms']} ms (deadline {r['deadline_ms']} ms)")
    if name == "llm-wake":
        return (f"first token after a wake {r['wake_ttft_ms']} ms vs cold {r['cold_ttft_ms']:.0f} ms "
                f"({r['speedup']}x), wake {r['wake_ms']} ms for {r['weight_bytes'] / 2**30:.2f} GiB; identical "
                f"{r['outputs_identical']}, addresses kept {r['addresses_kept']}, goals met {r['all_goals_met']}")
    if name == "handoff":
        return (f"p50 {r['handoff_p50_us']} us p99 {r['handoff_p99_us']} us, raw RTT p50 "
                f"{r['baseline_rtt_p50_us']} us (ratio {r['ratio_p50']})")
    if name == "colocate":  # per load: p99 / alone and training kept, per mode that ran
        parts = []
        for load_name, spec in r["loads"].items():
            cells = []
            for mode, e in r["modes"].items():
                if e["status"] == "ok" and mode != "alone":
                    cell = e["loads"][load_name]
                    cells.append(f"{mode} {cell['p99_over_alone']:.2f}x"
                                 + (f"/{cell['kept']:.0%}" if cell["kept"] is not None else ""))
            parts.append(f"{load_name} ({spec['model']} b{spec['batch']}, {spec['rate_per_s'] or 0:.0f}/s) "
                         "p99 vs alone/kept: " + ", ".join(cells))
        if r["failed"]:
            parts.append("failed: " + ", ".join(r["failed"]))
        return "; ".join(parts) + ("; interrupted" if r.get("interrupted") else "")
    if name.startswith("handoff-"):
        return "; ".join(
            f"{n} sessions p50 {b['handoff_p50_us']} us ({b['ratio_pipe_p50']}x pipe) p99 {b['handoff_p99_us']} us"
            for n, b in r["by_sessions"].items())
    return ""

def last_words(step):
    """Where a step failed: the last line of its log."""
    try:
        with open(os.path.join(stage, f"{step['step']}.log"), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def result(step):
    try:
        text = headline(step)
    except (KeyError, TypeError, ValueError) as exc:  # a result without the keys expected
        text = f"(unreadable result: {type(exc).__name__}: {exc})"
    if step["status"] in ("failed", "timeout"):
        text = f"{text}; {last_words(step)}" if text else last_words(step)
    return text


rows = [{"step": s["step"], "status": s["status"], "rc": s["rc"], "seconds": int(s["seconds"] or 0),
         "result": result(s), "command": s["command"]} for s in steps]
summary = {
    "tag": tag,
    "dry_run": dry,
    "device": gpu,
    "environment": env,
    "steps": rows,
    "results": {name: load(f"{name}.json") for name in ("switch", "suspend", "reclaim", "llm-wake", "handoff",
                                                    "mps_30_70",
                                                    "colocate",
                                                    *(f"handoff-hold{h}" for h in (0, 200)))},
    "pytest": {"gpu": junit("pytest-gpu.xml"), "mps": junit("pytest-mps.xml"), "ray_gpu": junit("pytest-ray-gpu.xml")},
    "ok": all(r["status"] in ("ok", "planned", "unpacked", "not-asked") for r in rows),
}
lines = [f"gpu-check {tag}" + (" (dry run: nothing ran on a GPU)" if dry else ""),
         f"{'step':<22} {'status':<14} {'secs':>5}  result"]
lines += [f"{r['step']:<22} {r['status']:<14} {r['seconds']:>5}  {r['result'][:400]}" for r in rows]
text = "\n".join(lines) + "\n"
for name, content in (("summary.json", json.dumps(summary, indent=2) + "\n"), ("summary.txt", text)):
    for folder in (stage, out_dir):
        with open(os.path.join(folder, name), "w") as f:
            f.write(content)
print(tag)
PY
)
if [ -z "$tag" ]; then
    tag="unknown-$(date -u +%Y-%m-%d)"
    say "the summary failed; packing what there is"
fi
[ -f "$stage/switch.png" ] && cp "$stage/switch.png" "$out_dir/switch.png"
tar -czf "$out_dir/gpu-check-$tag.tar.gz" -C "$work" --transform "s,^evidence,$tag," evidence
rm -rf "$work"
say "evidence: $out_dir/gpu-check-$tag.tar.gz ($(du -h "$out_dir/gpu-check-$tag.tar.gz" | cut -f1)); commit it with:"
say "  tar -xzf gpu-check-$tag.tar.gz -C bench/results/   # -> bench/results/$tag/"
echo
cat "$out_dir/summary.txt" 2>/dev/null
"$python" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$out_dir/summary.json" 2>/dev/null
