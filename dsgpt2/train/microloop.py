"""One optimizer step's micro-batches, with one wait on the device per step.

A non-finite loss must not reach the step: its gradients would join the accumulated ones, and no ZeRO
stage lets them be taken back out. Checking each loss before its backward costs a wait on the device
per micro-batch (~4 % on an H100). Here the micro-batches before the step's last go backward without
waiting: whether a loss was finite on every rank stays a flag on the device, and :class:`SkipGuard`'s
hooks turn a non-finite micro-batch's gradients into exact zeros before they are accumulated (whatever
NaN or inf the backward met on the way). The step's one wait reads the flags before the backward that
closes the step; a non-finite micro-batch found then is recorded as skipped, in order, and another is
drawn in its place, as a check before each backward would have done: the same micro-batches make the
step, their gradients summed in the same order (adding an exact zero changes no float).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class SkipGuard:
    """A hook on each trainable parameter's incoming gradient: while :attr:`finite` holds a device flag
    (shape (1,), 1.0 or 0.0), the gradient passes only where it is 1.0, else exact zeros take its place
    (``torch.where``: NaN in the unselected branch does not leak)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.finite: torch.Tensor | None = None
        self.handles = [p.register_hook(self._gate) for p in module.parameters() if p.requires_grad]

    def _gate(self, grad: torch.Tensor) -> torch.Tensor:
        if self.finite is None:
            return grad
        return torch.where(self.finite > 0, grad, 0.0)


def finite_on_every_rank(loss: torch.Tensor) -> torch.Tensor:
    """1.0 where ``loss`` is finite on every rank, else 0.0: a (1,) flag on the device, no wait."""
    import torch.distributed as dist

    flag = torch.isfinite(loss.detach()).all().reshape(1).to(torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag


@dataclass
class Micro:
    """A micro-batch that went backward: its number in the run, its batch, its loss (detached, still on
    the device), and its finiteness flag until the step's wait has read it."""

    number: int
    batch: Any
    loss: torch.Tensor
    flag: torch.Tensor | None


class MicroLoop:
    """Runs the micro-batches of one optimizer step on a DeepSpeed engine (see the module doc).

    ``host_reads`` counts the waits on the device (reads of the flags): one per step, one more for each
    non-finite micro-batch found.
    """

    def __init__(self, engine: Any, grad_accum: int) -> None:
        self.engine, self.grad_accum = engine, grad_accum
        self.guard = SkipGuard(engine.module)
        self.host_reads = 0

    def step(
        self,
        draw: Callable[[], tuple[int, Any, torch.Tensor]],
        skipped: Callable[[int], None],
        kept: Callable[[], None],
        before_update: Callable[[], None] = lambda: None,
    ) -> list[Micro]:
        """Draw micro-batches until ``grad_accum`` finite ones have gone backward, then step.

        ``draw()``: the next micro-batch's number, batch and loss. ``skipped(number)``/``kept()``: called
        in micro-batch order as each loss is known to be non-finite/finite. ``before_update()``: after
        the last backward, before the optimizer's update. Returns the step's micro-batches.
        """
        done: list[Micro] = []
        while True:
            number, batch, loss = draw()
            flag = finite_on_every_rank(loss)
            if len(done) < self.grad_accum - 1:
                self._backward(loss, flag, boundary=False)
                self.engine.step()
                done.append(Micro(number, batch, loss.detach(), flag))
                continue
            # The step's wait: the flags not read yet, in order, this micro-batch's last.
            waiting = [m for m in done if m.flag is not None]
            *earlier, finite = self._read([m.flag for m in waiting if m.flag is not None] + [flag])
            dropped = set()
            for m, ok in zip(waiting, earlier, strict=True):
                m.flag = None
                if ok:
                    kept()
                else:
                    skipped(m.number)
                    dropped.add(m.number)
            done = [m for m in done if m.number not in dropped]
            if not finite:
                skipped(number)
                continue
            kept()
            last = len(done) == self.grad_accum - 1
            self._backward(loss, None, boundary=last)
            done.append(Micro(number, batch, loss.detach(), None))
            if last:
                before_update()
                self.engine.step()
                return done
            self.engine.step()

    def _read(self, flags: list[torch.Tensor]) -> list[bool]:
        self.host_reads += 1
        return [v > 0 for v in torch.cat(flags).tolist()]

    def _backward(self, loss: torch.Tensor, flag: torch.Tensor | None, boundary: bool) -> None:
        """Backward under the boundary DeepSpeed is told; with ``flag``, through the guard."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.guard.finite = flag
        try:
            self.engine.backward(loss)
        finally:
            self.guard.finite = None
