"""PyTorch Lightning taking turns at its device through nodeagent.

``NodeAgentCallback`` (``client_lib.integrations.lightning``) holds the
device's token from the start of ``Trainer.fit``, calls ``yield_point()``
after every training batch, and, when the daemon asks for the whole device,
parks the LightningModule and its optimizers in host memory until the resume.
A tiny random model trains for a few steps; start a daemon first:

    nodeagent serve &
    python examples/lightning_yield.py --steps 2000   # suspend it from another shell:
    python -c "import client_lib as c; print(c.suspend_session('SESSION'))"   # the id it printed
    python -c "import client_lib as c; c.resume_session('SESSION')"

Needs ``pip install lightning`` (or ``pytorch-lightning``). ``NODEAGENT_ENDPOINT``
picks another daemon; on a cpu daemon the model trains on the CPU.
"""

from __future__ import annotations

import argparse
import logging

import torch

from client_lib import Client

try:  # the package the callback is built on
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from client_lib.integrations.lightning import NodeAgentCallback


class TinyClassifier(pl.LightningModule):
    """A two-layer MLP on random data: small enough to train in seconds anywhere."""

    def __init__(self, features: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes))
        self.last_loss = float("nan")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" banner

    # The session before anything touches CUDA: the welcome may carry an MPS share.
    with Client("examples/lightning_yield", workload="training") as client:
        device = client.cuda_device  # "cuda:N" on a GPU daemon, "cpu" on a cpu one
        accelerator, devices = ("cpu", 1) if device == "cpu" else ("cuda", [torch.device(device).index])
        torch.manual_seed(0)
        n = args.steps * args.batch_size
        data = torch.utils.data.TensorDataset(torch.randn(n, 32), torch.randint(0, 4, (n,)))
        model = TinyClassifier()
        print(f"session {client.session_id} on {device}; suspend it with "
              f"client_lib.suspend_session({client.session_id!r})", flush=True)
        trainer = pl.Trainer(max_steps=args.steps, accelerator=accelerator, devices=devices,
                             callbacks=[NodeAgentCallback(client)], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch_size))
        suspended = "never suspended" if client.last_suspend is None else \
            f"last suspend parked {client.last_suspend[0] / 2**20:.1f} MiB"
        print(f"lightning_yield: session {client.session_id} trained {trainer.global_step} steps on {device}, "
              f"loss {model.last_loss:.4f}, {suspended}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
