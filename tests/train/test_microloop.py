"""One wait on the device per optimizer step, and non-finite micro-batches skipped as a check before each
backward would skip them: the same micro-batches, the same summed gradients, the same records; with the
gradients in the parameters (ZeRO 0) by recomputing the rare step that met one, with no hook; with them
in DeepSpeed's buffers (ZeRO 1-3) through the guard's hooks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dsgpt2.train.microloop import MicroLoop


class FakeEngine:
    """DeepSpeed's accumulation as the loop drives it: backward sums gradients (scaled by 1/accum),
    step applies them at a boundary the caller set."""

    def __init__(self, module: torch.nn.Module, accum: int, stage: int) -> None:
        self.module, self.accum, self.stage = module, accum, stage
        self.boundary: bool | None = None
        self.updates: list[torch.Tensor] = []
        self.backwards = 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    def fp16_enabled(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return False

    def zero_grad(self) -> None:
        self.module.weight.grad = None

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundary = is_boundary

    def backward(self, loss: torch.Tensor) -> None:
        self.backwards += 1
        (loss / self.accum).backward()

    def step(self) -> None:
        if self.boundary:
            self.updates.append(self.module.weight.grad.clone())
            self.module.weight.grad = None


def _run(accum: int, bad: set[int], steps: int, stage: int, guarded: bool = True) -> dict[str, Any]:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1, bias=False)
    engine = FakeEngine(module, accum, stage)
    loop = MicroLoop(engine, accum)
    assert (loop.guard is None) == (stage == 0)
    if not guarded:
        assert loop.guard is not None
        loop.guard.finite = None
        for h in loop.guard.handles:
            h.remove()
    xs = torch.randn(64, 4)
    drawn = iter(range(1, 65))
    events: list[tuple[str, int]] = []
    reads = []

    def forward(batch: Any) -> torch.Tensor:
        return (module(xs[batch.n - 1]) ** 2).sum()

    def draw() -> tuple[int, Any, torch.Tensor]:
        n = next(drawn)
        loss = forward(SimpleNamespace(n=n))
        if n in bad:  # NaN through the graph, as an overflow in the forward would give
            loss = loss * float("nan")
        return n, SimpleNamespace(n=n), loss

    kept = []
    for _ in range(steps):
        before = loop.host_reads
        micros = loop.step(draw, lambda n: events.append(("skip", n)), lambda: events.append(("kept", 0)),
                           forward=forward)  # fmt: skip
        reads.append(loop.host_reads - before)
        kept.append([m.number for m in micros])
    return {"updates": engine.updates, "kept": kept, "events": events, "reads": reads, "xs": xs,
            "weight": module.weight.detach().clone(), "recomputed": loop.recomputed,
            "hooks": sum(len(p._backward_hooks or {}) for p in module.parameters())}  # fmt: skip


def _reference(xs: torch.Tensor, weight: torch.Tensor, numbers: list[int], accum: int) -> torch.Tensor:
    """The gradient a check before each backward would have accumulated: the kept micro-batches only."""
    w = weight.clone().requires_grad_(True)
    for n in numbers:
        ((xs[n - 1] @ w.t()) ** 2).sum().div(accum).backward()
    return w.grad


STAGES = pytest.mark.parametrize("stage", [0, 1], ids=["zero0-recompute", "zero1-guard"])


@STAGES
def test_a_step_of_finite_losses_waits_on_the_device_once(stage: int) -> None:
    run = _run(accum=4, bad=set(), steps=3, stage=stage)
    assert run["reads"] == [1, 1, 1] and run["recomputed"] == 0
    assert run["kept"] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    for update, numbers in zip(run["updates"], run["kept"], strict=True):
        torch.testing.assert_close(update, _reference(run["xs"], run["weight"], numbers, 4), rtol=0, atol=0)


@STAGES
@pytest.mark.parametrize(
    ("bad", "kept"),
    [
        ({2}, [[1, 3, 4, 5], [6, 7, 8, 9]]),  # found at the step's wait: the first read
        ({4}, [[1, 2, 3, 5], [6, 7, 8, 9]]),  # the closing micro-batch itself
        ({1, 2, 3}, [[4, 5, 6, 7], [8, 9, 10, 11]]),  # several in a row
        ({3, 5, 6}, [[1, 2, 4, 7], [8, 9, 10, 11]]),  # found at two waits
        ({7}, [[1, 2, 3, 4], [5, 6, 8, 9]]),  # in the second step
    ],
)
def test_non_finite_micro_batches_are_skipped_in_order_and_add_nothing(
    bad: set[int], kept: list[list[int]], stage: int
) -> None:
    run = _run(accum=4, bad=bad, steps=2, stage=stage)
    assert run["kept"] == kept
    skipped = [n for what, n in run["events"] if what == "skip"]
    assert skipped == sorted(bad)
    # kept() and skipped() in micro-batch order: a run of bad ones is counted as a check per backward would.
    order = list(range(1, max(max(k) for k in kept) + 1))
    assert [("skip" if n in bad else "kept") for n in order] == [what for what, _ in run["events"]]
    for update, numbers in zip(run["updates"], run["kept"], strict=True):
        assert torch.isfinite(update).all()
        torch.testing.assert_close(update, _reference(run["xs"], run["weight"], numbers, 4), rtol=0, atol=0)
    assert all(r <= 1 + len(bad) for r in run["reads"])


def test_without_the_guard_a_non_finite_micro_batch_would_poison_the_step() -> None:
    run = _run(accum=4, bad={2}, steps=1, stage=1, guarded=False)
    assert not torch.isfinite(run["updates"][0]).all()


def test_at_zero_0_no_hook_runs_and_only_a_step_that_met_a_non_finite_loss_recomputes() -> None:
    clean = _run(accum=4, bad=set(), steps=3, stage=0)
    assert clean["hooks"] == 0 and clean["recomputed"] == 0
    # Micro-batch 3 found at the first step's wait (micro-batch 4's): 1 and 2 went backward before it,
    # and again after; 4's graph was let go, its forward run again after theirs.
    bad = _run(accum=4, bad={3}, steps=3, stage=0)
    assert bad["hooks"] == 0 and bad["recomputed"] == 3
    # The closing micro-batch itself: nothing accumulated is dropped, nothing recomputed.
    last = _run(accum=4, bad={4}, steps=3, stage=0)
    assert last["recomputed"] == 0


@STAGES
def test_one_micro_batch_per_step_reads_once_per_micro_batch(stage: int) -> None:
    run = _run(accum=1, bad={2}, steps=2, stage=stage)
    assert run["kept"] == [[1], [3]] and run["reads"] == [1, 2]


def test_a_model_with_dropout_is_guarded_even_at_zero_0() -> None:
    """Recomputing would draw other dropout masks: the same micro-batches, other gradients."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 1, bias=False), torch.nn.Dropout(0.1))
    assert MicroLoop(FakeEngine(module, 4, stage=0), 4).guard is not None
    module[1].p = 0.0
    assert MicroLoop(FakeEngine(module, 4, stage=0), 4).guard is None
