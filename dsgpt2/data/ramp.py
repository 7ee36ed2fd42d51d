"""A batch-size ramp: fewer micro-batches per optimizer step at the start of a run, the full batch after.

``--batch_ramp N`` over a DeepSpeed config of ``gradient_accumulation_steps`` G: the first N optimizer
steps take from 1 up to G - 1 micro-batches each, in G - 1 stages of equal length, and every step from
step N + 1 on takes G (the modded-nanogpt speedrun's 8 → 16 → 24 sequences a step is micro-batch 8,
G = 3). The micro-batches are the ones the run reads anyway, in the same order: the ramp only groups
fewer of them into each early step. Each step's loss is the mean over its own micro-batches, so the
learning rate needs no rescaling.

Micro-batches are counted from the run's start (the stream's ``micro``), steps from 0 (the steps already
taken): the mixture's stages and the lineage's replay map one to the other here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from dsgpt2.errors import ConfigError


@dataclass(frozen=True)
class BatchRamp:
    """Micro-batches per optimizer step over a run (module doc). ``steps`` 0: no ramp. ``offset``: what
    the run's micro-batch count lags the ramp's own (:meth:`at`)."""

    grad_accum: int
    steps: int = 0
    offset: int = 0
    # The first step of each stage (stage j: j + 1 micro-batches a step), then the ramp's end.
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.grad_accum < 1 or self.steps < 0:
            raise ValueError(f"a batch ramp of {self.steps} steps to {self.grad_accum} micro-batches")
        stages = self.grad_accum - 1 if self.steps else 0
        starts = tuple(-(-j * self.steps // stages) for j in range(stages + 1)) if stages else ()
        object.__setattr__(self, "_starts", starts)

    @property
    def ramping(self) -> int:
        """The steps that take fewer than ``grad_accum`` micro-batches."""
        return self._starts[-1] if self._starts else 0

    def _stages(self) -> Iterator[tuple[int, int, int]]:
        """(first step, steps, micro-batches a step) of each stage that has steps."""
        for j, (start, end) in enumerate(itertools.pairwise(self._starts)):
            if end > start:
                yield start, end - start, j + 1

    def accum(self, step: int) -> int:
        """The micro-batches of optimizer step ``step + 1`` (``step`` steps taken)."""
        if step >= self.ramping:
            return self.grad_accum
        return 1 + step * (self.grad_accum - 1) // self.steps

    def micros_before(self, step: int) -> int:
        """The micro-batches the first ``step`` optimizer steps take."""
        done = sum(k * max(0, min(n, step - first)) for first, n, k in self._stages())
        return done + max(0, step - self.ramping) * self.grad_accum

    def step_of(self, micro: int) -> int:
        """The steps taken when the run's micro-batch ``micro + 1`` is read (``micro`` read before it)."""
        micro += self.offset
        for first, n, k in self._stages():
            if micro < n * k:
                return first + micro // k
            micro -= n * k
        return self.ramping + micro // self.grad_accum

    def at(self, step: int, micro: int) -> BatchRamp:
        """This ramp for a launch that starts with ``step`` steps taken and ``micro`` micro-batches read
        (a resume): its steps counted from there, whatever earlier launches read a step."""
        return replace(self, offset=self.micros_before(step) - micro)

    def describe(self, micro_batch: int, world: int) -> str:
        """The ramp in one line, in sequences a step (every rank's)."""
        first, full = micro_batch * world, micro_batch * world * self.grad_accum
        return (
            f"batch ramp: {first} sequences a step at first, {len(list(self._stages()))} stage(s) below the "
            f"full {full}, which step {self.ramping + 1} on take (--batch_ramp {self.steps})"
        )


def check_ramp(steps: int, grad_accum: int, deepspeed_config: object) -> BatchRamp:
    """The ramp ``--batch_ramp steps`` makes of a DeepSpeed config of ``grad_accum`` accumulation steps.

    Raises:
        ConfigError: a ramp asked of a config with nothing to accumulate.
    """
    if steps and grad_accum < 2:
        raise ConfigError(
            f"--batch_ramp {steps}: the ramp rises to the DeepSpeed config's gradient_accumulation_steps, "
            f"which is {grad_accum} in {deepspeed_config}; use a config that accumulates 2 or more "
            "micro-batches a step (the full batch), or --batch_ramp 0 for none (a resumed run takes its "
            "checkpoint's ramp unless told)"
        )
    return BatchRamp(grad_accum, steps)
