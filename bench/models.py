"""Benchmark models with random weights, shaped like the classics (torchvision is not installable here).

- ``resnet50``: bottleneck blocks [3, 4, 6, 3], widths as ResNet-50 (25.6 M parameters)
- ``resnet152``: bottleneck blocks [3, 8, 36, 3] (60.2 M parameters)
- ``bert-base``: 12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522, with the pooler
  (109.5 M parameters); input: token ids
- ``tiny-cnn``: three conv/BatchNorm blocks and a classifier (for tests and as a filler model)
- ``gpt-small``: a decoder-only transformer (pre-norm, causal attention, tied embeddings): 6 layers,
  hidden 768, 12 heads, FFN 3072, vocab 32000 (67.9 M parameters); input: token ids; output: logits
- ``tiny-gpt``, ``tiny-bert``: the same shapes at hidden 64, 2 layers (for tests on the cpu)

Also the child side of ``bench.switch``'s cold start, run as
``python -m bench.models cold --model NAME --weights FILE ...``: it imports
torch, builds the model (on the meta device, then ``load_state_dict(...,
assign=True)`` from the file: no random init to pay for), moves it to the
device, runs one batch, and prints ``ready <monotonic_ns> <output checksum>``
once the output is ready.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------------ ResNet


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet layout with bottleneck blocks."""

    def __init__(self, blocks: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._stage(64, blocks[0], 1)
        self.layer2 = self._stage(128, blocks[1], 2)
        self.layer3 = self._stage(256, blocks[2], 2)
        self.layer4 = self._stage(512, blocks[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _stage(self, planes: int, count: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride,
                                                 bias=False), nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, count)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _randomise_batchnorm(model: nn.Module, generator: torch.Generator) -> None:
    """Non-trivial running statistics, so a buffer that failed to travel changes the output."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=generator) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=generator) * 0.5 + 0.75)


# -------------------------------------------------------------------------- BERT


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        context = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        return self.norm(x + self.dense(context.transpose(1, 2).reshape(b, s, h)))


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attention = SelfAttention(hidden, heads)
        self.intermediate = nn.Linear(hidden, ffn)
        self.output = nn.Linear(ffn, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.norm(x + self.output(F.gelu(self.intermediate(x))))


class Bert(nn.Module):
    """BERT-base's encoder and pooler; returns (sequence output, pooled [CLS])."""

    def __init__(self, layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072,
                 vocab: int = 30522, max_positions: int = 512) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, ffn) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type(torch.zeros_like(input_ids))
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x)
        return x, torch.tanh(self.pooler(x[:, 0]))


# ---------------------------------------------------------------------- decoder


class DecoderLayer(nn.Module):
    """Pre-norm: causal self-attention, then the MLP, each on a residual."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(context.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Gpt(nn.Module):
    """A GPT-2-like decoder: token and position embeddings, pre-norm layers, tied output head."""

    def __init__(self, layers: int = 6, hidden: int = 768, heads: int = 12, ffn: int = 3072, vocab: int = 32000,
                 max_positions: int = 1024) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.word.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


# ------------------------------------------------------------------------- small


class TinyCnn(nn.Module):
    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        blocks, channels = [], 3
        for i in range(3):
            blocks += [nn.Conv2d(channels, width << i, 3, padding=1, bias=False), nn.BatchNorm2d(width << i),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            channels = width << i
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


# ---------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    kind: str  # "image" or "tokens"
    params_note: str
    vocab: int = 30522  # token ids of a "tokens" model are drawn below this


MODELS: dict[str, ModelSpec] = {
    "resnet50": ModelSpec("resnet50", lambda: ResNet([3, 4, 6, 3]), "image", "25.6 M"),
    "resnet152": ModelSpec("resnet152", lambda: ResNet([3, 8, 36, 3]), "image", "60.2 M"),
    "bert-base": ModelSpec("bert-base", Bert, "tokens", "109.5 M"),
    "tiny-cnn": ModelSpec("tiny-cnn", TinyCnn, "image", "23 k"),
    "gpt-small": ModelSpec("gpt-small", Gpt, "tokens", "67.9 M", vocab=32000),
    "tiny-gpt": ModelSpec("tiny-gpt", lambda: Gpt(layers=2, hidden=64, heads=4, ffn=256, vocab=1024,
                                                  max_positions=512), "tokens", "0.2 M", vocab=1024),
    "tiny-bert": ModelSpec("tiny-bert", lambda: Bert(layers=2, hidden=64, heads=4, ffn=256, vocab=1024,
                                                     max_positions=512), "tokens", "0.2 M", vocab=1024),
}


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def build(name: str, seed: int = 0) -> nn.Module:
    """The model with random weights from ``seed`` (the same weights every time), in eval mode."""
    s = spec(name)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = s.build()
    if s.kind == "image":
        _randomise_batchnorm(model, generator)
    return model.eval()


def example_input(name: str, batch: int, input_size: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    """The batch every path of the benchmark feeds to ``name`` (host memory)."""
    generator = torch.Generator().manual_seed(seed)
    if spec(name).kind == "tokens":
        return torch.randint(0, spec(name).vocab, (batch, seq_len), generator=generator)
    return torch.randn(batch, 3, input_size, input_size, generator=generator)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def checksum(output) -> float:
    """A float summarising an output (a tensor or a tuple of them) for comparing across processes."""
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    return float(sum(t.double().sum().item() for t in tensors))


# ------------------------------------------------------------------ cold start


def _cold(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.models cold", allow_abbrev=False)
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--input-size", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with torch.device("meta"):
        model = spec(args.model).build()
    model.load_state_dict(torch.load(args.weights, mmap=True, weights_only=True), assign=True)
    model = model.eval().to(device)
    x = example_input(args.model, args.batch, args.input_size, args.seq_len).to(device)
    with torch.no_grad():
        out = model(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ready_ns = time.monotonic_ns()
    print(f"ready {ready_ns} {checksum(out)!r}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "cold":
        raise SystemExit(_cold(sys.argv[2:]))
    for name in MODELS:
        m = build(name)
        print(f"{name}: {param_count(m) / 1e6:.2f} M parameters, "
              f"{sum(t.numel() * t.element_size() for t in m.state_dict().values()) / 1e6:.1f} MB", flush=True)
