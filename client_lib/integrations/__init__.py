"""Callbacks that make a framework's training loop take turns at the device.

Each module imports its framework, and only that one; it raises an
ImportError that says what to install when the framework is missing:

    from client_lib.integrations.lightning import NodeAgentCallback         # PyTorch Lightning
    from client_lib.integrations.huggingface import NodeAgentTrainerCallback  # transformers.Trainer

Both hold the token for the whole fit, call ``client.yield_point()`` after
every optimizer step, and park the model and its optimizers in host memory
when the daemon asks for the whole device (:class:`client_lib.torch.Yielder`).
Open the Client before anything touches the GPU: settings the daemon hands
over in the welcome (an MPS share) reach CUDA only at context creation.
"""

from __future__ import annotations

from typing import Iterable


class TrainingTurns:
    """What every callback does, apart from its framework's hook names:
    :meth:`start` once the model and optimizers exist, :meth:`step_end` after
    each optimizer step, :meth:`end` when training stops.

    ``hold_token``: hold the device's token for the whole fit (as
    ``with client.slice():`` does), so ``yield_point()`` also hands it over in
    turns. ``park_state``: on a suspend, park the model and optimizers in host
    memory (otherwise only the token is given up and the memory stays)."""

    def __init__(self, client, *, hold_token: bool = True, park_state: bool = True) -> None:
        self.client = client
        self.hold_token = hold_token
        self.park_state = park_state
        self.yielder = None
        self._slice = None

    def start(self, modules: Iterable, optimizers: Iterable) -> None:
        if self.park_state:
            from client_lib.torch import Yielder  # torch only once a framework runs
            self.yielder = Yielder(self.client, modules=list(modules), optimizers=list(optimizers))
        if self.hold_token and self._slice is None:
            self._slice = self.client.slice()
            self._slice.__enter__()

    def step_end(self) -> None:
        self.client.yield_point()

    def end(self) -> None:
        if self._slice is not None:
            held, self._slice = self._slice, None
            held.__exit__(None, None, None)  # releases the token
        if self.yielder is not None:
            self.client.set_suspend_handlers(None, None)
            self.yielder = None
