"""Whether a run learns: a step whose loss is finite and whose gradient is all zeros ends the run.

A loss cut off from the weights, or a compiled graph whose backward lost its gradients (the chunked loss
under ``torch.compile`` on torch 2.11 once gave zeros where 2.13 gave the eager gradients), trains nothing
at full speed and says nothing. The trainer reads the gradient norm where it reads it anyway (logged
steps) and at each launch's first step, and asks :func:`check_learns`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dsgpt2.errors import NoGradient


def grad_norm(module: Any) -> float:
    """The 2-norm of the gradients held on the parameters (after the boundary's all-reduce)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def check_learns(step: int, losses: list[torch.Tensor], norm: float | None, compiled: bool) -> None:
    """Raise :class:`NoGradient` where step ``step``'s micro-batch ``losses`` (on the device) are finite and
    not all zero while its gradient ``norm`` is 0. A step that predicts nothing (context-only blocks) has a
    zero loss and rightly no gradient. The norm is the same on every rank: every rank stops."""
    if norm is None or norm != 0.0:
        return
    loss = float(torch.stack([x.float() for x in losses]).mean())
    if math.isfinite(loss) and loss != 0.0:
        raise no_gradient(step, f"its loss was {loss:.4f} and its gradient norm 0", compiled)


def no_gradient(step: int, what: str, compiled: bool) -> NoGradient:
    """The one line that stops a run whose step ``step`` learns nothing (``what``: how it showed)."""
    how = (
        "the model is compiled: train with --no_compile, or on a torch release `make test-floor` proves"
        if compiled
        else "the model is not compiled (--no_compile): the loss is cut off from the model's weights"
    )
    return NoGradient(
        f"step {step} learns nothing: {what}, under torch {torch.__version__}; {how}. Stopped before any "
        "checkpoint of it"
    )
