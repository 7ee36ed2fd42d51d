"""One optimizer step's micro-batches, with one wait on the device per step.

A non-finite loss must not reach the step: its gradients would join the accumulated ones. Checking each
loss before its backward costs a wait on the device per micro-batch (~4 % on an H100). Here the
micro-batches before the step's last go backward without waiting, and the step's one wait reads, before
the backward that closes the step, whether each of its losses was finite on every rank. A non-finite
micro-batch found then is recorded as skipped, in order, and another is drawn in its place, as a check
before each backward would have done: the same micro-batches make the step, their gradients summed in
the same order. What happened to the non-finite one's gradients depends on where the engine keeps
what it has accumulated:

- in the parameters' ``.grad`` (ZeRO 0 without DeepSpeed's fp16/bf16 optimizer: fp32, or torch
  autocast): nothing is done per micro-batch. On the rare step that met a non-finite loss the
  accumulated gradients are dropped and the step's finite micro-batches, kept on the host, go forward
  and backward again (there is no dropout, so they give the same gradients). The common step's host
  work is the plain loop's: a non-finite loss costs a step's recomputation, a guard costs every step.
- in DeepSpeed's own buffers (ZeRO 1-3, its fp16/bf16 optimizers: they reduce or copy each gradient as
  it arrives, where it cannot be taken back out): :class:`SkipGuard`'s hooks turn a non-finite
  micro-batch's gradients into exact zeros before they are accumulated, from a flag that stays on the
  device until the step's wait (adding an exact zero changes no float). Those engines run their own
  hooks per parameter per micro-batch already.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def gradients_in_params(engine: Any) -> bool:
    """Whether everything ``engine`` accumulates between optimizer steps is in the parameters' ``.grad``:
    ZeRO 0 and neither DeepSpeed's fp16 nor its bf16 optimizer (fp32, or the ``torch_autocast`` section)."""
    stage = engine.zero_optimization_stage()
    return stage == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()


def recomputable(engine: Any) -> bool:
    """Whether a step that met a non-finite loss can be recomputed instead of guarded: the gradients are
    the parameters' own (:func:`gradients_in_params`) and no dropout draws other masks the second time
    (the presets have none; a ``--model_config`` or ``--init_from`` config may)."""
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in engine.module.modules())
    return gradients_in_params(engine) and not dropout


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


def finite_on_every_rank(losses: torch.Tensor) -> torch.Tensor:
    """Per loss of ``losses`` (a scalar or a vector), 1.0 where it is finite on every rank, else 0.0:
    (k,) flags on the device, no wait."""
    import torch.distributed as dist

    flag = torch.isfinite(losses.detach().reshape(-1)).to(torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag


@dataclass
class Micro:
    """A micro-batch that went backward: its number in the run, its batch, its loss (detached, still on
    the device), its finiteness flag (guarded engines only) and whether the step's wait has read it."""

    number: int
    batch: Any
    loss: torch.Tensor
    flag: torch.Tensor | None = None
    read: bool = False


class MicroLoop:
    """Runs the micro-batches of one optimizer step on a DeepSpeed engine (see the module doc).

    ``host_reads`` counts the waits on the device (reads of the flags): one per step, one more for each
    non-finite micro-batch found. ``recomputed`` counts the micro-batches that went forward and backward
    again after a non-finite one (unguarded engines only).
    """

    def __init__(self, engine: Any, grad_accum: int) -> None:
        self.engine, self.grad_accum = engine, grad_accum
        self.guard = None if recomputable(engine) else SkipGuard(engine.module)
        self.host_reads = 0
        self.recomputed = 0

    def step(
        self,
        draw: Callable[[], tuple[int, Any, torch.Tensor]],
        skipped: Callable[[int], None],
        kept: Callable[[], None],
        *,
        before_update: Callable[[], None] = lambda: None,
        forward: Callable[[Any], torch.Tensor] | None = None,
        accum: int | None = None,
    ) -> list[Micro]:
        """Draw micro-batches until ``accum`` (default ``grad_accum``) finite ones have gone backward,
        then step.

        ``draw()``: the next micro-batch's number, batch and loss. ``skipped(number)``/``kept()``: called
        in micro-batch order as each loss is known to be non-finite/finite. ``before_update()``: after
        the last backward, before the optimizer's update. ``forward(batch)``: a kept micro-batch's loss
        again (unguarded engines recompute with it after a non-finite loss). Returns the step's
        micro-batches.
        """
        if accum is not None and accum != self.engine.gradient_accumulation_steps():
            # A step of a batch ramp (dsgpt2.data.ramp): DeepSpeed divides each loss by this number.
            e = self.engine
            e.set_train_batch_size(accum * e.train_micro_batch_size_per_gpu() * e.dp_world_size)
        accum = accum or self.grad_accum
        done: list[Micro] = []
        while True:
            number, batch, loss = draw()
            if len(done) < accum - 1:
                flag = None if self.guard is None else finite_on_every_rank(loss)
                self._backward(loss, flag, boundary=False)
                self.engine.step()
                done.append(Micro(number, batch, loss.detach(), flag))
                continue
            # The step's wait: the flags not read yet, in order, this micro-batch's last.
            waiting = [m for m in done if not m.read]
            *earlier, finite = self._read(waiting, loss)
            dropped = set()
            for m, ok in zip(waiting, earlier, strict=True):
                m.read, m.flag = True, None
                if ok:
                    kept()
                else:
                    skipped(m.number)
                    dropped.add(m.number)
            done = [m for m in done if m.number not in dropped]
            if dropped and self.guard is None:
                # This micro-batch's graph is let go first (the recomputation would hold two sets of
                # activations at once), and its forward run again after the kept ones.
                loss = loss.detach()
                self._recompute(done, forward)
                if finite:
                    loss = self._forward_again(batch, forward)
            if not finite:
                skipped(number)
                continue
            kept()
            last = len(done) == accum - 1
            self._backward(loss, None, boundary=last)
            done.append(Micro(number, batch, loss.detach(), read=True))
            if last:
                before_update()
                self.engine.step()
                return done
            self.engine.step()

    def _read(self, waiting: list[Micro], loss: torch.Tensor) -> list[bool]:
        self.host_reads += 1
        if self.guard is None:
            flags = finite_on_every_rank(torch.stack([m.loss for m in waiting] + [loss.detach()]))
        else:
            flags = torch.cat([m.flag for m in waiting if m.flag is not None] + [finite_on_every_rank(loss)])
        return [v > 0 for v in flags.tolist()]

    def _recompute(self, kept: list[Micro], forward: Callable[[Any], torch.Tensor] | None) -> None:
        """Drop what the step has accumulated, then the kept micro-batches forward and backward again,
        in order: the gradients they alone give."""
        self.engine.zero_grad()
        for m in kept:
            self._backward(self._forward_again(m.batch, forward), None, boundary=False)
            self.engine.step()

    def _forward_again(self, batch: Any, forward: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
        if forward is None:
            raise ValueError("an unguarded engine needs forward= to recompute after a non-finite loss")
        self.recomputed += 1
        return forward(batch)

    def _backward(self, loss: torch.Tensor, flag: torch.Tensor | None, boundary: bool) -> None:
        """Backward under the boundary DeepSpeed is told; with ``flag``, through the guard."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        if self.guard is None:
            self.engine.backward(loss)
            return
        self.guard.finite = flag
        try:
            self.engine.backward(loss)
        finally:
            self.guard.finite = None
