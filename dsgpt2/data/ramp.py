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

import bisect
from dataclasses import dataclass, field

from dsgpt2.errors import ConfigError


@dataclass(frozen=True)
class BatchRamp:
    """Micro-batches per optimizer step over a run (module doc). ``steps`` 0: no ramp."""

    grad_accum: int
    steps: int = 0
    _ends: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.grad_accum < 1 or self.steps < 0:
            raise ValueError(f"a batch ramp of {self.steps} steps to {self.grad_accum} micro-batches")
        ends, total = [], 0
        for step in range(self.ramping):
            total += self.accum(step)
            ends.append(total)
        object.__setattr__(self, "_ends", tuple(ends))

    @property
    def ramping(self) -> int:
        """The steps that take fewer than ``grad_accum`` micro-batches."""
        return self.steps if self.grad_accum > 1 else 0

    def accum(self, step: int) -> int:
        """The micro-batches of optimizer step ``step + 1`` (``step`` steps taken)."""
        if step >= self.ramping:
            return self.grad_accum
        return 1 + step * (self.grad_accum - 1) // self.steps

    def micros_before(self, step: int) -> int:
        """The micro-batches the first ``step`` optimizer steps take."""
        if step <= 0:
            return 0
        ramped = min(step, self.ramping)
        done = self._ends[ramped - 1] if ramped else 0
        return done + (step - ramped) * self.grad_accum

    def step_of(self, micro: int) -> int:
        """The steps taken when micro-batch ``micro + 1`` is read (``micro`` read before it)."""
        if self.ramping and micro < self._ends[-1]:
            return bisect.bisect_right(self._ends, micro)
        return self.ramping + (micro - self.micros_before(self.ramping)) // self.grad_accum

    def describe(self, micro_batch: int, world: int) -> str:
        """The ramp in one line, in sequences a step (every rank's)."""
        first, full = micro_batch * world, micro_batch * world * self.grad_accum
        return (
            f"batch ramp: {first} sequences a step at first, rising in {self.grad_accum - 1} stage(s) to "
            f"{full} from step {self.ramping + 1} (--batch_ramp {self.steps})"
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
            "micro-batches a step (the full batch), or leave --batch_ramp out"
        )
    return BatchRamp(grad_accum, steps)
