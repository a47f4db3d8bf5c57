"""How Cyclic DP keeps ``loss_fn(model, batch)`` as the one contract while running a model one stage at a
time.

The strategy first calls ``loss_fn`` with a :class:`Recorder` standing in for the model, which captures the
model call's arguments (the inputs of the first stage) and stops; at the last stage's forward it calls
``loss_fn`` again with a :class:`Replay`, which returns the last stage's output, so the loss is computed on
the last stage's graph by the user's own code.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Captured(Exception):
    """Raised by :class:`Recorder` to stop ``loss_fn`` at the model call, carrying its arguments."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("model call captured")
        self.args, self.kwargs = args, kwargs


class Recorder:
    """Stands in for the model while ``loss_fn`` runs: records the model call's arguments, then stops it."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise Captured(args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class Replay(Recorder):
    """Stands in for the model at the last stage: returns the last stage's output for the recorded call."""

    def __init__(self, module: nn.Module, output: Any) -> None:
        super().__init__(module)
        self._output = output
        self._calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        if self._calls > 1:
            raise RuntimeError("cdp: loss_fn must call the model exactly once per micro-batch")
        return self._output




def capture_call(module: nn.Module, batch: Any, loss_fn: Any) -> tuple[tuple, dict]:
    """The arguments ``loss_fn(model, batch)`` calls the model with (the stage inputs), without running it."""
    try:
        loss_fn(Recorder(module), batch)
    except Captured as got:
        return got.args, got.kwargs
    raise RuntimeError("cdp: loss_fn(model, batch) must call model(...) once; it returned without calling it")
