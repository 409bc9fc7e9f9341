"""PyTorch Lightning: take turns at the device from ``Trainer.fit``.

    client = Client("trainer", workload="training")
    trainer = L.Trainer(callbacks=[NodeAgentCallback(client)])
    trainer.fit(model, loader)

Built on ``lightning.pytorch`` when that package is installed, else on
``pytorch_lightning``: use the same package for the Trainer.
"""

from __future__ import annotations

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError as exc:
        raise ImportError("client_lib.integrations.lightning needs PyTorch Lightning: "
                          "pip install lightning (or pytorch-lightning)") from exc

from client_lib.integrations import TrainingTurns


class NodeAgentCallback(pl.Callback):
    """Holds the token during training, calls ``client.yield_point()`` at the
    end of every training batch, and parks the LightningModule and the
    trainer's optimizers when the daemon suspends the session (see
    :class:`client_lib.integrations.TrainingTurns` for the options)."""

    def __init__(self, client, *, hold_token: bool = True, park_state: bool = True) -> None:
        super().__init__()
        self.turns = TrainingTurns(client, hold_token=hold_token, park_state=park_state)

    def on_train_start(self, trainer, pl_module) -> None:
        # Not on_fit_start: the optimizers exist only once the strategy is set up.
        self.turns.start([pl_module], trainer.optimizers)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.turns.step_end()

    def on_train_end(self, trainer, pl_module) -> None:
        self.turns.end()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.turns.end()
