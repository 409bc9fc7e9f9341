"""examples/llm_server.py: an LLM server that sleeps through a lend and wakes with the same outputs,
and bench.llm_wake, which times that wake against a cold start.

On cpu: the example end to end under a real daemon (cluster endpoint, CURVE, a PlacementClient
lending the device with the server put to sleep and reclaiming it with the server woken, and a
plain suspend_session/resume_session), and the engine in process over host memory mapped as CUDA's
VMM maps device memory (tests.host_vmm.HostVmm), where the addresses are kept. On a GPU: the
decode step captured in a CUDA graph replays bit-identically after a park while another process
filled the freed memory with garbage.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from bench.llm_wake import SERVER, ServerProc, ask  # noqa: E402
from client_lib import resume_session, suspend_session  # noqa: E402
from client_lib.placement import ClientKeys, PlacementClient  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.cluster_nodes import write_cluster_config  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TINY = ["--weights-mb", "1", "--max-seq", "64", "--threads", "1", "--device", "cpu"]
PROMPT = [3, 141, 59, 26, 5]


def example():
    """examples/llm_server.py as a module (examples/ is not a package)."""
    if "llm_server" not in sys.modules:
        spec = importlib.util.spec_from_file_location("llm_server", SERVER)
        module = importlib.util.module_from_spec(spec)
        sys.modules["llm_server"] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules["llm_server"]


def _env(endpoint: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if endpoint:
        env["NODEAGENT_ENDPOINT"] = endpoint
    return env


def _waiting_request(server: ServerProc, box: dict) -> threading.Thread:
    def run() -> None:
        box["reply"] = ask(server.socket, {"op": "generate", "prompt": PROMPT, "max_new_tokens": 4}, timeout=60)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------- cpu


def test_the_server_sleeps_through_a_lend_wakes_at_the_reclaim_and_answers_the_same(workdir, start_daemon):
    node = write_cluster_config(workdir, protect_s=0.0)
    daemon = start_daemon()
    server = ServerProc(TINY, workdir, "llm", _env(daemon.endpoint))
    try:
        session = server.ready["session"]
        assert session.startswith("s-") and server.ready["parks"] and not server.ready["graphs"]
        assert "no device address to keep" in server.ready["address_note"]  # cpu: parked in place
        before = server.ask({"op": "generate", "prompt": PROMPT, "max_new_tokens": 24})
        assert len(before["tokens"]) == 24 and len(set(before["tokens"])) > 1 and before["ttft_ms"] > 0
        assert f"[session] open session={session} name=examples/llm_server " in daemon.log()
        assert "workload=inference" in daemon.log()

        with PlacementClient({"n1": node.endpoint}, keys=ClientKeys.load(node.client_secret),
                             server_keys={"n1": node.server_public}, timeout_ms=10_000) as pc:
            # Lent to a training job: the server is put to sleep in the same call.
            lent = pc.lend("n1", 0, "job-7", suspend=[session], deadline_ms=30_000)
            assert lent.state == "LENT"
            ours = [s for s in pc.inventory()["n1"].reply.devices[0].sessions if s.id == session]
            assert ours and ours[0].suspended == "suspended"
            box: dict = {}
            waiting = _waiting_request(server, box)
            waiting.join(0.5)
            assert waiting.is_alive() and not box  # asleep: the request waits in the socket
            # Reclaimed: the device comes back and the server wakes, in one call.
            reclaimed = pc.reclaim("n1", 0, deadline_ms=5_000, resume=[session])
            assert reclaimed.changed and reclaimed.outcomes == {}  # no borrower session was there
            waiting.join(60)
            assert box["reply"]["ok"] and box["reply"]["tokens"] == before["tokens"][:4]

        assert server.ask({"op": "generate", "prompt": PROMPT, "max_new_tokens": 24})["tokens"] == before["tokens"]
        # A training job granted the whole device: the daemon's plain suspend and resume.
        result = suspend_session(session, deadline_ms=30_000, endpoint=daemon.endpoint)
        assert result.outcome == "suspended" and result.bytes_parked > 0
        resume_session(session, endpoint=daemon.endpoint)
        assert server.ask({"op": "generate", "prompt": PROMPT, "max_new_tokens": 24})["tokens"] == before["tokens"]

        stats = server.ask({"op": "stats"})
        wakes = stats["wakes"]
        assert len(wakes) == 2 and stats["served"] == 4
        state_bytes = stats["weight_bytes"] + stats["kv_cache_bytes"]
        for wake in wakes:  # the weights and the KV cache, every byte, parked and brought back
            assert wake["bytes_copied"] == wake["bytes_parked"] == state_bytes
            assert wake["park_ms"] > 0 and wake["unpark_ms"] > 0
            assert not wake["addresses_kept"]  # on cpu storages are freed and grown back elsewhere
        assert "[suspend] suspended session=" + session in daemon.log()
    finally:
        server.stop()
    assert server.proc.wait(30) == 0, server.log_tail()


def test_the_engine_keeps_its_addresses_across_a_park_and_generates_the_same():
    from tests.host_vmm import HostVmm

    torch.set_num_threads(1)
    m = example()
    cfg = m.ModelConfig.sized(1, "float32", max_seq=64)
    host = HostVmm()
    engine = m.Engine(m.random_model(cfg, torch.device("cpu"), seed=1), torch.device("cpu"), keep_addresses=True,
                      vmm=host)
    assert engine.yielder.keeps_addresses and engine.describe()["keeps_addresses"]
    # Every weight and both halves of the KV cache moved into regions before anything ran.
    assert all(host.region_at(p.untyped_storage().data_ptr()) for p in engine.model.parameters())
    assert host.region_at(engine.cache.k.untyped_storage().data_ptr()) is not None
    seen, buffer = engine.addresses(), engine.yielder.host_buffer.data_ptr()
    before, _ = engine.generate(PROMPT, 30)
    for _ in range(2):
        engine.yielder.park()
        assert not host.handles  # every region's memory given back; its addresses stay reserved
        with pytest.raises(RuntimeError, match="parked"):
            engine.generate(PROMPT, 3)
        engine.yielder.unpark()
        assert engine.addresses() == seen
        assert engine.generate(PROMPT, 30)[0] == before
        assert engine.yielder.verify_ms > 0  # the restore was checked against the park's checksums
        assert engine.yielder.host_buffer.data_ptr() == buffer  # kept: a second sleep allocates nothing


def test_the_decode_step_gives_what_recomputing_the_whole_sequence_gives():
    """The static-cache step (attention over the whole cache, masked past the position) is the model."""
    torch.set_num_threads(1)
    m = example()
    cfg = m.ModelConfig.sized(1, "float32", max_seq=64)
    model = m.random_model(cfg, torch.device("cpu"), seed=3)
    got, _ = m.Engine(model, torch.device("cpu"), park=False).generate(PROMPT, 12)
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model.prefill(torch.tensor([seq]), m.KVCache(cfg, torch.device("cpu"))).argmax(-1)))
    assert got == seq[len(PROMPT):]


def test_a_weights_file_serves_what_the_random_weights_it_holds_serve(tmp_path):
    torch.set_num_threads(1)
    m = example()
    cfg = m.ModelConfig.sized(1, "float32", max_seq=64)
    path = str(tmp_path / "lm.pt")
    assert m.write_weights(path, cfg, torch.device("cpu"), seed=5) > cfg.weight_bytes()
    loaded = m.load_model(path, torch.device("cpu"))
    assert loaded.cfg == cfg
    direct = m.Engine(m.random_model(cfg, torch.device("cpu"), seed=5), torch.device("cpu"), park=False)
    from_file = m.Engine(loaded, torch.device("cpu"))  # parked in place: the file's memory is not the model's
    assert from_file.generate(PROMPT, 10)[0] == direct.generate(PROMPT, 10)[0]
    from_file.yielder.park()
    from_file.yielder.unpark()
    assert from_file.generate(PROMPT, 10)[0] == direct.generate(PROMPT, 10)[0]
    with pytest.raises(ValueError, match="len\\(prompt\\) \\+ max_new_tokens <= 64"):
        direct.generate(PROMPT, 60)


@pytest.mark.slow
def test_the_bench_reports_every_field_with_tiny_sizes():
    done = subprocess.run([sys.executable, "-m", "bench.llm_wake", "--json", "--device", "cpu", "--weights-mb", "1",
                           "--max-seq", "64", "--prompt-tokens", "4", "--new-tokens", "8", "--cycles", "2",
                           "--cold-repeats", "1", "--threads", "1"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout)
    for key in ("cold_ttft_ms", "warm_ttft_ms", "wake_ttft_ms", "wake_ms", "park_ms", "speedup", "sleep_call_ms",
                "wake_call_ms", "wake_server_ttft_ms", "bytes_parked", "bytes_copied", "weight_bytes",
                "kv_cache_bytes", "verify_ms", "checksum_ms"):
        assert r[key] is not None and r[key] >= 0, key
    assert r["benchmark"] == "llm_wake" and r["backend"] == "cpu" and r["endpoint_kind"] == "own daemon"
    assert len(r["wake_ttft_samples_ms"]) == len(r["wake_samples_ms"]) == 2 and len(r["cold_samples_ms"]) == 1
    assert r["speedup"] == pytest.approx(r["cold_ttft_ms"] / r["wake_ttft_ms"], rel=0.01)
    assert r["outputs_identical"] and r["asleep_while_lent"]
    assert r["bytes_copied"] == r["weight_bytes"] + r["kv_cache_bytes"]
    assert {"import_ms", "load_ms", "warmup_ms", "start_ms"} <= set(r["cold_phases_ms"])
    assert set(r["goals"]) == {"first_token_speedup", "wake_ms"}
    assert r["goals_apply"] is False and r["all_goals_met"] is False and "goals are for a GPU" in r["note"]
    assert "first token" in done.stderr and "(cpu: the goals are for a GPU)" in done.stderr


# --------------------------------------------------------------------- gpu


@pytest.mark.gpu
@cuda
def test_the_captured_decode_graph_replays_bit_identically_after_a_park_while_another_process_used_the_memory():
    from tests.host_vmm import fill_freed_memory_from_another_process

    m = example()
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = m.ModelConfig.sized(256, "bfloat16", max_seq=512)
    engine = m.Engine(m.random_model(cfg, device, seed=2), device, keep_addresses=True)
    assert engine.graph is not None and engine.captures == 1 and engine.yielder.keeps_addresses
    seen, state_bytes = engine.addresses(), cfg.weight_bytes() + engine.cache.nbytes
    buffer = engine.yielder.host_buffer
    assert buffer.is_pinned() and buffer.numel() >= state_bytes
    before, _ = engine.generate(PROMPT, 64)
    for _ in range(2):  # the host buffer is kept: the second park allocates nothing
        free_before = torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        parked = engine.yielder.park()
        park_ms = (time.perf_counter() - t0) * 1000
        freed = torch.cuda.mem_get_info(device)[0] - free_before
        filled = fill_freed_memory_from_another_process()
        t0 = time.perf_counter()
        engine.yielder.unpark()
        unpark_ms = (time.perf_counter() - t0) * 1000
        after, _ = engine.generate(PROMPT, 64)
        print(f"\n[llm] {state_bytes >> 20} MiB of weights and KV cache: "
              f"park {park_ms:.1f} ms freed {freed >> 20} MiB; another process filled {filled >> 20} MiB; unpark "
              f"{unpark_ms:.1f} ms (verify {engine.yielder.verify_ms:.2f} ms); graph replays identical: "
              f"{after == before}")
        assert freed >= state_bytes - (8 << 20) and filled > parked
        assert engine.addresses() == seen and engine.captures == 1  # the graph captured before, replayed
        assert after == before
        assert engine.yielder.host_buffer.data_ptr() == buffer.data_ptr()  # kept and pinned across sleeps
