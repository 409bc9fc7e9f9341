"""Hugging Face ``transformers.Trainer``: take turns at the device.

    client = Client("trainer", workload="training")
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[NodeAgentTrainerCallback(client)])
    trainer.train()

The Trainer needs ``accelerate`` besides ``transformers``. A runnable example:
``examples/hf_trainer_yield.py``.
"""

from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("client_lib.integrations.huggingface needs transformers (and accelerate, "
                      "which its Trainer uses): pip install transformers accelerate") from exc

from client_lib.integrations import TrainingTurns


class NodeAgentTrainerCallback(TrainerCallback):
    """Holds the token during ``train()``, calls ``client.yield_point()`` after every optimizer step
    (not between gradient-accumulation micro-steps), and parks the model and optimizer when the daemon
    suspends the session (options: :class:`client_lib.integrations.TrainingTurns`). The Trainer has
    no exception hook: if ``train()`` raises, the token is given back when the client closes."""

    def __init__(self, client, *, hold_token: bool = True, park_state: bool = True) -> None:
        self.turns = TrainingTurns(client, hold_token=hold_token, park_state=park_state)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # The model is on its device and the optimizer exists; the first step is next. A
        # suspend asked for before train() is honoured here.
        self.turns.start([model] if model is not None else [], [optimizer] if optimizer is not None else [])

    def on_step_end(self, args, state, control, **kwargs):
        self.turns.step_end()

    def on_train_end(self, args, state, control, **kwargs):
        self.turns.end()
