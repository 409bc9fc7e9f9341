"""An LLM server under the token: it sleeps (weights and KV cache parked in host
memory, device memory freed) while its GPU is lent to training, and wakes in
milliseconds, its CUDA graphs intact, when the placement layer takes it back.

The model is a small decoder-only transformer written here in torch (no
download, no transformers): token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, greedy decoding over a static KV cache. On
cuda the decode step (one token: attention over the whole static cache,
masked past the current position; argmax; the next position) is captured once
in a CUDA graph and replayed per token.

Serving: one request at a time over a unix stream socket (``--socket``), one
JSON object per line each way:

    {"op": "generate", "prompt": [17, 4, 99], "max_new_tokens": 8}
        -> {"ok": true, "tokens": [...], "ttft_ms": 3.1, "total_ms": 9.8}
    {"op": "stats"}   -> {"ok": true, "session": ..., "wakes": [...], ...}   (what the server did so far)
    {"op": "quit"}    -> {"ok": true}, and the server exits

``ttft_ms`` runs from reading the request to the first token on the host
(prefill and the token wait included). Once listening the server prints one
line, ``ready {json}``, with its session, socket and start-up phases.

Sleeping and waking. The server is a ``Client(workload="inference")`` session
and computes each request under the token (``client.slice()``). Between
requests it waits on its socket and on the daemon at once
(``client.wait_event``); when the daemon asks it to give up the device
(``suspend_session``: a training job granted the whole GPU; or the placement
layer lending the device, ``PlacementClient.lend(..., suspend=[session])``),
``client.yield_point()`` runs the ``Yielder``'s park: weights and KV cache are
copied into a pinned host buffer and their device memory unmapped, their
virtual addresses kept (``keep_addresses``), so the captured graph stays
valid. It then waits for ``resume_session`` (the placement layer's
``PlacementClient.reclaim(..., resume=[session])``: the device back from the
borrower and the service woken in one call), maps new memory at the same
addresses, copies back, verifies, and serves on: the graph replays unchanged.
Requests that arrive while it sleeps wait in the socket and are served on waking.

    nodeagent serve &
    python examples/llm_server.py --socket /tmp/llm.sock --weights-mb 1024       # random weights of ~1 GiB
    python examples/llm_server.py --write-weights /tmp/lm.pt --weights-mb 1024   # or: weights in a file ...
    python examples/llm_server.py --socket /tmp/llm.sock --weights /tmp/lm.pt     # ... served from it

``--no-daemon`` serves without a session (no token, no sleeping): what a plain
server would be, the cold-start baseline of ``bench.llm_wake``. On cpu (``--device
cpu``, what ``auto`` picks without CUDA) the same code runs in host memory,
eager, with nothing to keep at an address.

Order matters, as for any client: the ``Client`` comes before anything touches
CUDA (an MPS share in the welcome is read when CUDA starts), and the
``Yielder`` takes the weights and the KV cache before the graph is captured
(it moves them once into address ranges of its own; a graph captured before
would read the old addresses).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

_T_START = time.perf_counter()

import torch  # noqa: E402  (after the clock: import time is a phase of the cold start)

_T_IMPORTED = time.perf_counter()

# ------------------------------------------------------------------ the model


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    max_seq: int  # the KV cache's length: prompt plus new tokens
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def param_count(self) -> int:
        d = self.d_model
        fixed = 2 * self.vocab * d + self.max_seq * d + 2 * d  # embeddings, head, final norm
        return fixed + self.n_layers * (12 * d * d + 13 * d)

    def weight_bytes(self) -> int:
        return self.param_count() * self.torch_dtype.itemsize

    def kv_cache_bytes(self, batch: int = 1) -> int:
        return 2 * self.n_layers * batch * self.max_seq * self.d_model * self.torch_dtype.itemsize

    @classmethod
    def sized(cls, weights_mb: float, dtype: str = "float32", max_seq: int = 512) -> ModelConfig:
        """About ``weights_mb`` MiB of weights: the widest of a few shapes that fits two layers, then
        as many layers as make up the rest."""
        itemsize = getattr(torch, dtype).itemsize
        target = weights_mb * (1 << 20) / itemsize
        shapes = [(64, 512), (128, 2048), (256, 4096), (512, 8192), (1024, 32000), (2048, 32000), (4096, 32000)]
        chosen = shapes[0]
        for d, vocab in shapes:
            if cls(vocab, d, 2, max(2, d // 64), max_seq, dtype).param_count() <= target:
                chosen = (d, vocab)
        d, vocab = chosen
        one = cls(vocab, d, 1, max(2, d // 64), max_seq, dtype).param_count()
        per_layer = 12 * d * d + 13 * d
        layers = max(1, round((target - (one - per_layer)) / per_layer))
        return cls(vocab, d, layers, max(2, d // 64), max_seq, dtype)


class KVCache:
    """Keys and values of every layer for ``batch`` sequences of up to ``max_seq`` tokens:
    two tensors of [layers, batch, heads, max_seq, head_dim], allocated once. Nothing keeps a
    view of them between calls (a view held elsewhere would keep the Yielder from moving them)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, batch: int = 1) -> None:
        shape = (cfg.n_layers, batch, cfg.n_heads, cfg.max_seq, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=cfg.torch_dtype, device=device)
        self.v = torch.zeros(shape, dtype=cfg.torch_dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        d, f = cfg.d_model, {"device": device, "dtype": cfg.torch_dtype}
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.ln1, self.ln2 = torch.nn.LayerNorm(d, **f), torch.nn.LayerNorm(d, **f)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d, **f), torch.nn.Linear(d, d, **f)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d, **f), torch.nn.Linear(4 * d, d, **f)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v  # each [batch, heads, t, head_dim]

    def _finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = att.shape
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    def prefill(self, x: torch.Tensor, layer: int, cache: KVCache) -> torch.Tensor:
        """The prompt's tokens at positions 0..t-1; their keys and values go into the cache."""
        q, k, v = self._qkv(x)
        t = x.shape[1]
        cache.k[layer, :, :, :t].copy_(k)
        cache.v[layer, :, :, :t].copy_(v)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(future, float("-inf")).float().softmax(-1).to(v.dtype) @ v
        return self._finish(x, att)

    def step(self, x: torch.Tensor, layer: int, cache: KVCache, pos: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor:
        """One token at position ``pos`` (a device tensor, so the step can be captured in a graph):
        attention over the whole static cache, masked past ``pos``."""
        q, k, v = self._qkv(x)
        keys, values = cache.k[layer], cache.v[layer]
        keys.index_copy_(2, pos, k)
        values.index_copy_(2, pos, v)
        scores = (q @ keys.transpose(-1, -2)) * self.head_dim ** -0.5
        att = scores.masked_fill(positions > pos, float("-inf")).float().softmax(-1).to(v.dtype) @ values
        return self._finish(x, att)


class TinyLM(torch.nn.Module):
    """A decoder-only transformer: embeddings, ``n_layers`` pre-norm blocks, a final norm, an
    untied output head, made on ``device`` in the config's dtype."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        f = {"device": device, "dtype": cfg.torch_dtype}
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.d_model, **f)
        self.pos_embed = torch.nn.Embedding(cfg.max_seq, cfg.d_model, **f)
        self.blocks = torch.nn.ModuleList(Block(cfg, device) for _ in range(cfg.n_layers))
        self.ln_f = torch.nn.LayerNorm(cfg.d_model, **f)
        self.head = torch.nn.Linear(cfg.d_model, cfg.vocab, bias=False, **f)

    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits for the token after ``tokens`` [batch, t]; fills the cache's first t positions."""
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos_embed(torch.arange(t, device=tokens.device))
        for i, block in enumerate(self.blocks):
            x = block.prefill(x, i, cache)
        return self.head(self.ln_f(x[:, -1]))

    def step(self, token: torch.Tensor, pos: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits for the token after ``token`` [batch, 1] at position ``pos`` [1]."""
        x = self.embed(token) + self.pos_embed(pos)
        for i, block in enumerate(self.blocks):
            x = block.step(x, i, cache, pos, positions)
        return self.head(self.ln_f(x[:, -1]))


def random_model(cfg: ModelConfig, device: torch.device, seed: int = 0) -> TinyLM:
    """The model with seeded random weights, made on ``device`` (drawn in fp32, then cast)."""
    model = TinyLM(cfg, device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norms
                p.fill_(1.0)
            else:  # embeddings at unit scale, so that the next token depends on the current one
                std = 1.0 if "embed" in name else 0.02
                p.copy_(torch.empty(p.shape, device=device).normal_(0.0, std, generator=g))
    return model.requires_grad_(False).eval()


def write_weights(path: str, cfg: ModelConfig, device: torch.device, seed: int = 0) -> int:
    """A weights file (torch.save of the config and the state dict, on the host); returns its bytes."""
    model = random_model(cfg, device, seed)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    del model
    torch.save({"config": dataclasses.asdict(cfg), "state_dict": state}, path)
    return os.path.getsize(path)


def load_model(path: str, device: torch.device) -> TinyLM:
    """The model of a weights file: made on ``device`` and filled from the file, which is mapped
    rather than read (torch.load(mmap=True)). Not on the meta device: its first use imports
    seconds of torch's decompositions, which no server needs."""
    blob = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    cfg = ModelConfig(**blob["config"])
    model = TinyLM(cfg, device)
    model.load_state_dict(blob["state_dict"])  # copies: the mapped file is not the model's memory
    return model.requires_grad_(False).eval()


# ------------------------------------------------------------------- engine


class Engine:
    """Greedy generation over a static KV cache, the decode step in a CUDA graph where it can be.

    ``client``: the session whose suspends park the state (None: never parked by a daemon, though
    :attr:`yielder` may still be driven by hand, as the tests do). ``keep_addresses`` and ``vmm``
    go to the :class:`client_lib.torch.Yielder`; ``park=False`` makes none. ``graphs``: capture
    the decode step (default: on cuda, if the Yielder keeps addresses or there is none)."""

    def __init__(self, model: TinyLM, device: torch.device, *, client=None, park: bool = True,
                 keep_addresses: bool | str = "auto", vmm=None, graphs: bool | None = None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.device = device
        self.phases_ms: dict[str, float] = {}
        t0 = time.perf_counter()
        self.cache = KVCache(self.cfg, device)
        # Small static tensors of the decode step (token in, position, tokens out): they stay on the
        # device when parked (a few KiB), at their addresses.
        self.positions = torch.arange(self.cfg.max_seq, device=device)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.out = torch.zeros(1, self.cfg.max_seq, dtype=torch.long, device=device)
        self.yielder = None
        if park:
            from client_lib.torch import Yielder
            # Made empty, then given everything, then reserve(): one move into regions, one pinned buffer.
            self.yielder = Yielder(client, keep_addresses=keep_addresses, vmm=vmm)
            self.yielder.register_state(model)
            self.yielder.register_state(self.cache.k)
            self.yielder.register_state(self.cache.v)
            self.yielder.reserve()
        self.phases_ms["yielder_ms"] = (time.perf_counter() - t0) * 1000.0
        if graphs is None:
            graphs = device.type == "cuda" and (self.yielder is None or self.yielder.keeps_addresses)
        if graphs and self.yielder is not None and not self.yielder.keeps_addresses:
            raise ValueError("graphs=True needs a Yielder that keeps addresses (a park would move the state "
                             f"the graph reads): {self.yielder.address_note}")
        self.graph: Any = None
        self.captures = 0
        t0 = time.perf_counter()
        self.generate([1, 2, 3], 4)  # warm-up: kernels chosen, workspaces made
        if graphs:
            self._capture()
        _synchronize(device)
        self.phases_ms["warmup_ms"] = (time.perf_counter() - t0) * 1000.0

    def _decode(self) -> torch.Tensor:
        """One decode step over the static tensors: the next token goes into ``out`` and ``token``."""
        logits = self.model.step(self.token, self.pos, self.positions, self.cache)
        nxt = logits.argmax(-1, keepdim=True)
        self.out.index_copy_(1, self.pos + 1, nxt)
        self.token.copy_(nxt)
        self.pos.add_(1)
        return nxt

    def _capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):
                self._decode()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            self._decode()
        self.graph = graph
        self.captures += 1

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int,
                 started: float | None = None) -> tuple[list[int], float]:
        """Greedy continuation of ``prompt``: (``max_new_tokens`` token ids, ms from ``started``
        (a ``time.perf_counter()``; default: now) to the first one on the host)."""
        t = len(prompt)
        if t < 1 or max_new_tokens < 1 or t + max_new_tokens > self.cfg.max_seq:
            raise ValueError(f"need 1 <= len(prompt) and 1 <= max_new_tokens and len(prompt) + max_new_tokens "
                             f"<= {self.cfg.max_seq}; got {t} and {max_new_tokens}")
        if not all(isinstance(i, int) and 0 <= i < self.cfg.vocab for i in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.cfg.vocab})")
        if self.yielder is not None and self.yielder.parked:
            raise RuntimeError("the model is parked; unpark it first")
        t0 = time.perf_counter() if started is None else started
        tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
        first = self.model.prefill(tokens, self.cache).argmax(-1, keepdim=True)  # [1, 1]
        first_id = int(first.item())  # on the host: the first token
        ttft_ms = (time.perf_counter() - t0) * 1000.0
        if max_new_tokens == 1:
            return [first_id], ttft_ms
        self.out[:, t:t + 1].copy_(first)
        self.token.copy_(first)
        self.pos.fill_(t)
        for _ in range(max_new_tokens - 1):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._decode()
        return self.out[0, t:t + max_new_tokens].tolist(), ttft_ms

    def addresses(self) -> list[int]:
        """Where the weights and the KV cache are on the device (what the graph reads)."""
        return [p.data_ptr() for p in self.model.parameters()] + [self.cache.k.data_ptr(), self.cache.v.data_ptr()]

    def describe(self) -> dict:
        y = self.yielder
        return {
            "device": str(self.device),
            "config": dataclasses.asdict(self.cfg),
            "weight_bytes": sum(p.nbytes for p in self.model.parameters()),
            "kv_cache_bytes": self.cache.nbytes,
            "graphs": self.graph is not None,
            "parks": y is not None,
            "keeps_addresses": bool(y and y.keeps_addresses),
            "address_note": y.address_note if y is not None else "no Yielder (--no-daemon)",
            "host_buffer_bytes": 0 if y is None or y.host_buffer is None else y.host_buffer.numel(),
            "host_buffer_pinned": bool(y is not None and y.host_buffer is not None and y.host_buffer.is_pinned()),
            # What the CUDA driver read for MPS when this process made its context (bench.mps_evidence).
            "pid": os.getpid(),
            "mps_env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")},
            "mem_total_bytes": torch.cuda.mem_get_info(self.device)[1] if self.device.type == "cuda" else None,
        }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------- server


class Server:
    """The socket loop: requests one at a time under the token, parking on the daemon's word."""

    def __init__(self, engine: Engine, client, path: str, info: dict) -> None:
        self.engine = engine
        self.client = client
        self.path = path
        self.info = info
        self.wakes: list[dict] = []
        self.served = 0
        self._conns: dict[int, tuple[socket.socket, bytearray]] = {}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self._stop = False

    def run(self) -> None:
        try:
            while not self._stop:
                fds = [self.listener.fileno(), *self._conns]
                if self.client is None:
                    ready = [fd for fd, _ in _poll(fds, 1000)]
                else:
                    ready = self.client.wait_event(1.0, fds)  # the daemon's notices, or a request
                    if self.client.suspend_requested:
                        self._sleep()
                        continue  # what arrived meanwhile is read now
                for fd in ready:
                    if fd == self.listener.fileno():
                        self._accept()
                    elif fd in self._conns:
                        self._read(fd)
        finally:
            for conn, _ in self._conns.values():
                conn.close()
            self.listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _sleep(self) -> None:
        """Asked for the device: park (Yielder), tell the daemon, wait for the resume, unpark."""
        engine, before, seen = self.engine, self.engine.addresses(), self.client.last_suspend
        self.client.yield_point()  # runs the whole suspend: park, "suspended", wait, unpark, "resumed"
        if self.client.last_suspend is seen:
            return  # called off (resumed) before we parked: nothing happened
        bytes_parked, park_ms, unpark_ms = self.client.last_suspend
        y = engine.yielder
        self.wakes.append({
            "bytes_parked": bytes_parked, "bytes_copied": y.bytes_copied, "park_ms": round(park_ms, 3),
            "unpark_ms": round(unpark_ms, 3), "checksum_ms": round(y.checksum_ms, 3),
            "verify_ms": round(y.verify_ms, 3), "addresses_kept": engine.addresses() == before,
            "captures": engine.captures,
        })
        print(f"[llm] woke: parked {bytes_parked / 2**20:.1f} MiB in {park_ms:.1f} ms, back in {unpark_ms:.1f} ms",
              file=sys.stderr, flush=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            conn.setblocking(False)
            self._conns[conn.fileno()] = (conn, bytearray())

    def _read(self, fd: int) -> None:
        conn, buf = self._conns[fd]
        try:
            data = conn.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            del self._conns[fd]
            conn.close()
            return
        buf += data
        while b"\n" in buf and not self._stop:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            reply = self._handle(line)
            try:
                conn.setblocking(True)
                conn.sendall(json.dumps(reply).encode() + b"\n")
                conn.setblocking(False)
            except OSError:
                self._conns.pop(fd, None)
                conn.close()
                return

    def _handle(self, line: bytes) -> dict:
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "generate":
                return self._generate(req)
            if op == "stats":
                return {"ok": True, **self.info, **self.engine.describe(), "served": self.served,
                        "wakes": self.wakes, "captures": self.engine.captures}
            if op == "quit":
                self._stop = True
                return {"ok": True}
            return {"ok": False, "error": f"unknown op {op!r} (generate, stats, quit)"}
        except (ValueError, TypeError, AttributeError) as exc:
            return {"ok": False, "error": str(exc)}

    def _generate(self, req: dict) -> dict:
        t0 = time.perf_counter()
        prompt, n = req.get("prompt"), req.get("max_new_tokens", 16)
        if not isinstance(prompt, list) or not isinstance(n, int):
            raise ValueError("generate takes prompt (a list of token ids) and max_new_tokens (an integer)")
        if self.client is not None and self.client.suspend_requested:
            self._sleep()  # asked just now: sleep first (acquire would, but unrecorded), then serve
        # Under the token: the result is on the host before the slice ends.
        with self.client.slice() if self.client is not None else contextlib.nullcontext():
            tokens, ttft_ms = self.engine.generate(prompt, n, started=t0)
        self.served += 1
        return {"ok": True, "tokens": tokens, "ttft_ms": round(ttft_ms, 3),
                "total_ms": round((time.perf_counter() - t0) * 1000.0, 3)}


def _poll(fds: list[int], timeout_ms: int) -> list[tuple[int, int]]:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return poller.poll(timeout_ms)


def ask(path: str, request: dict, timeout: float = 60.0) -> dict:
    """One request to a server at ``path`` and its reply (for scripts and tests)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"the server at {path} closed the connection without answering")
            data += chunk
    return json.loads(data)


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=os.path.join(tempfile.gettempdir(), f"llm-server-{os.getuid()}.sock"),
                    help="unix socket to serve on (default: %(default)s)")
    ap.add_argument("--weights", help="a weights file (--write-weights makes one); default: random weights")
    ap.add_argument("--weights-mb", type=float, default=None,
                    help="size of random weights in MiB (default: 1024 on cuda, 16 on cpu)")
    ap.add_argument("--max-seq", type=int, default=None, help="KV cache length (default: 1024 on cuda, 256 on cpu)")
    ap.add_argument("--dtype", default=None, help="of random weights: bfloat16 (default on cuda) or float32 (cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto: cuda when there is one")
    ap.add_argument("--write-weights", metavar="PATH", help="write random weights (--weights-mb) to PATH and exit")
    ap.add_argument("--no-daemon", action="store_true", help="no session: serve without the token, never sleep")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly, also on cuda")
    ap.add_argument("--keep-addresses", choices=["auto", "on", "off"], default="auto",
                    help="park keeping device addresses (auto: where possible; graphs need it)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--name", default="examples/llm_server")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # a loaded machine's cores: tiny ops on many threads crawl

    phases: dict[str, float] = {"import_ms": (_T_IMPORTED - _T_START) * 1000.0}
    t0 = time.perf_counter()
    client = None
    if not args.no_daemon and not args.write_weights:
        from client_lib import Client  # the session before CUDA starts (an MPS share is read then)
        client = Client(args.name, workload="inference")
    phases["session_ms"] = (time.perf_counter() - t0) * 1000.0
    if args.device == "auto":
        cuda = torch.cuda.is_available()
        args.device = (client.cuda_device if client is not None else "cuda") if cuda else "cpu"
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    t0 = time.perf_counter()
    if args.weights:
        model = load_model(args.weights, device)
    else:
        cfg = ModelConfig.sized(args.weights_mb or (1024 if on_cuda else 16),
                                args.dtype or ("bfloat16" if on_cuda else "float32"),
                                args.max_seq or (1024 if on_cuda else 256))
        if args.write_weights:
            size = write_weights(args.write_weights, cfg, device, args.seed)
            print(json.dumps({"weights": args.write_weights, "file_bytes": size, "config": dataclasses.asdict(cfg),
                              "weight_bytes": cfg.weight_bytes()}), flush=True)
            return 0
        model = random_model(cfg, device, args.seed)
    _synchronize(device)
    phases["load_ms"] = (time.perf_counter() - t0) * 1000.0

    keep = {"auto": "auto", "on": True, "off": False}[args.keep_addresses]
    engine = Engine(model, device, client=client, park=client is not None, keep_addresses=keep,
                    graphs=False if args.no_graphs else None)
    phases.update(engine.phases_ms)
    phases["start_ms"] = (time.perf_counter() - _T_START) * 1000.0
    info = {"session": client.session_id if client is not None else None, "socket": args.socket,
            "pid": os.getpid(), "phases_ms": {k: round(v, 3) for k, v in phases.items()}}
    server = Server(engine, client, args.socket, info)
    print("ready " + json.dumps({**info, **engine.describe()}), flush=True)
    try:
        server.run()
    finally:
        if client is not None:
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
