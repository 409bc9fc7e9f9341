"""Callbacks that make a framework's training loop take turns at the device: one module per
framework (:mod:`client_lib.integrations.huggingface`, :mod:`client_lib.integrations.lightning`),
each importing only its own and saying what to install when it is missing.
"""

from __future__ import annotations

from typing import Iterable


class TrainingTurns:
    """What every callback does, apart from its framework's hook names (:meth:`start`, :meth:`step_end`,
    :meth:`end`). ``hold_token``: hold the token for the whole fit (as ``with client.slice():`` does),
    so ``yield_point()`` also hands it over in turns. ``park_state``: on a suspend, park the model and
    optimizers in host memory (otherwise only the token is given up and the memory stays). ``pace``:
    place a :class:`client_lib.torch.Pacer` on the modules (co-run pause points)."""

    def __init__(self, client, *, hold_token: bool = True, park_state: bool = True, pace: bool = True) -> None:
        self.client = client
        self.hold_token = hold_token
        self.park_state = park_state
        self.pace = pace
        self.yielder = None
        self.pacer = None
        self._slice = None
        self._optimizers: list = []

    def start(self, modules: Iterable, optimizers: Iterable) -> None:
        """Once the model is on its device and the optimizers exist, before the first
        step: set up parking, then take the token, which first honours a suspend asked
        for before training began (without the token: a yield point does)."""
        self._optimizers = list(optimizers)
        modules = list(modules)
        if self.park_state and self.yielder is None:
            from client_lib.torch import Yielder  # torch only once a framework runs
            self.yielder = Yielder(self.client, modules=modules, optimizers=self._optimizers)
        if self.pace and self.pacer is None:
            from client_lib.torch import Pacer
            self.pacer = Pacer(self.client, modules, self._optimizers)
        if self.hold_token:
            if self._slice is None:
                self._slice = self.client.slice()
                self._slice.__enter__()  # acquire() handles a pending suspend before it asks for the token
        else:
            self.client.yield_point()

    def add_optimizers(self, optimizers: Iterable) -> None:
        """Park optimizers that did not exist at :meth:`start` too (a framework that builds them later)."""
        for optimizer in optimizers:
            if not any(optimizer is known for known in self._optimizers):
                self._optimizers.append(optimizer)
                if self.yielder is not None:
                    self.yielder.register_state(optimizer)

    def step_end(self) -> None:
        self.client.yield_point()

    def end(self) -> None:
        if self._slice is not None:
            held, self._slice = self._slice, None
            held.__exit__(None, None, None)  # releases the token
        if self.yielder is not None:
            self.client.set_suspend_handlers(None, None)
            self.yielder = None
        if self.pacer is not None:
            self.pacer.close()
            self.pacer = None
