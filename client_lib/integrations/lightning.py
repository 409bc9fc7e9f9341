"""PyTorch Lightning: take turns at the device from ``Trainer.fit``.

    client = Client("trainer", workload="training")
    trainer = L.Trainer(callbacks=[NodeAgentCallback(client)])
    trainer.fit(model, loader)

A runnable example: ``examples/lightning_yield.py``. Built on ``lightning.pytorch`` when that package is
installed, else on ``pytorch_lightning``: use the same package for the Trainer.
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
    """Holds the token from ``on_fit_start`` (sanity-check validation included) to the end of training,
    calls ``client.yield_point()`` at the end of every training batch, and parks the LightningModule and
    the trainer's optimizers when the daemon suspends the session (options: :class:`TrainingTurns`)."""

    def __init__(self, client, *, hold_token: bool = True, park_state: bool = True) -> None:
        super().__init__()
        self.turns = TrainingTurns(client, hold_token=hold_token, park_state=park_state)

    def on_fit_start(self, trainer, pl_module) -> None:
        # The strategy has put the module on its device and built the optimizers; the
        # sanity-check validation (on the device) and the first step are still to come.
        # A suspend asked for before fit is honoured here, not after the first batch.
        self.turns.start([pl_module], trainer.optimizers)

    def on_train_start(self, trainer, pl_module) -> None:
        self.turns.add_optimizers(trainer.optimizers)  # a strategy that built them after on_fit_start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.turns.step_end()

    def on_train_end(self, trainer, pl_module) -> None:
        self.turns.end()

    def on_fit_end(self, trainer, pl_module) -> None:
        self.turns.end()  # a fit that never ran its training loop (max_steps=0) has no on_train_end

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.turns.end()
