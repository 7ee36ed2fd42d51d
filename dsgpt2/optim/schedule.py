"""Learning-rate schedules dsgpt2 owns: cosine and WSD (warmup-stable-decay).

``deepspeed`` (the default) leaves the schedule to the DeepSpeed config's ``scheduler``. The others
are pure functions of the step (:func:`lr_at`), so a resumed run, or one whose ``--train_iters``
grew, computes its learning rate from the step alone:

- cosine: linear warmup to the peak, then half a cosine down to ``peak × min_lr_ratio`` at
  ``--train_iters``. Another ``--train_iters`` on resume redraws the curve over the new length,
  so the learning rate jumps to where the new curve is at that step.
- wsd: linear warmup, the peak held, then a linear decay over the last ``decay_fraction`` of
  ``--train_iters``. Extending ``--train_iters`` before the decay has begun continues at the
  peak without a jump (the point of WSD: decide the length late); once it has begun, the
  decay is redrawn over the new length.

The scheduler object follows the ``torch.optim.lr_scheduler`` protocol DeepSpeed drives: it sets
the optimizer's learning rate after every optimizer step DeepSpeed applies, and its state dict
(the step, and the schedule it was on) goes into every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dsgpt2.errors import ConfigError
from dsgpt2.settings.options import (
    LEARNING_RATE,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    RATIO,
    Checked,
    Range,
    option,
    option_as,
)

KINDS = ("deepspeed", "cosine", "wsd")


@dataclass
class ScheduleOptions(Checked):
    """The learning-rate schedule's options, as the flags set them (a run's :class:`Schedule` is made of
    them: :func:`dsgpt2.optim.ds_config.own_schedule`)."""

    lr_schedule: str | None = option(
        None,
        "deepspeed: the DeepSpeed config's scheduler; cosine: warmup then cosine decay to --min_lr_ratio; "
        "wsd: warmup, stable, then a linear decay over the last --decay_fraction (default: wsd under Muon, "
        "deepspeed under AdamW; a resumed run keeps its own)",
        choices=list(KINDS),
    )
    lr: float | None = option(
        None,
        "peak learning rate (default: the DeepSpeed config's optimizer lr)",
        type=float,
        check=LEARNING_RATE,
    )
    warmup_iters: int | None = option(
        None,
        "warmup steps (default: the DeepSpeed config's, else 2%% of --train_iters)",
        check=NON_NEGATIVE_INT,
    )
    min_lr_ratio: float = option(
        0.1, "the learning rate at the end, as a share of the peak", type=float, check=Range(float, 0, 1)
    )
    decay_fraction: float = option(
        0.2, "wsd: the share of --train_iters spent decaying", check=RATIO, serves=("lr_schedule", "wsd")
    )


@dataclass(frozen=True)
class Schedule(Checked):
    """A learning-rate curve over ``total`` optimizer steps (each field named as the flag that sets it)."""

    kind: str = option(flag="lr_schedule", choices=("cosine", "wsd"))
    peak: float = option(flag="lr", check=POSITIVE_NUMBER)
    total: int = option(flag="train_iters", check=POSITIVE_INT)
    warmup: int = option(flag="warmup_iters", check=NON_NEGATIVE_INT)
    min_ratio: float = option_as(ScheduleOptions, "min_lr_ratio")
    decay_fraction: float = option_as(ScheduleOptions, "decay_fraction")

    def check(self) -> None:
        check_warmup(self.warmup, self.total)

    @property
    def decay_start(self) -> int:
        """The first step of the WSD decay."""
        return max(self.warmup, self.total - math.ceil(self.decay_fraction * self.total))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_warmup(warmup: int, total: int) -> None:
    """A warmup shorter than the run: checked on the flags before any work, and on every schedule built."""
    if warmup > 0 and warmup >= total:
        raise ConfigError(f"--warmup_iters {warmup}: must be below --train_iters {total}")


def lr_at(s: Schedule, step: int) -> float:
    """The learning rate of optimizer step ``step + 1`` (``step`` steps done)."""
    low = s.peak * s.min_ratio
    if step < s.warmup:
        return s.peak * (step + 1) / s.warmup
    if step >= s.total:
        return low
    if s.kind == "cosine":
        progress = (step - s.warmup) / max(1, s.total - s.warmup)
        return low + (s.peak - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    start = s.decay_start
    if step < start:
        return s.peak
    return s.peak - (s.peak - low) * (step - start) / max(1, s.total - start)


# Where a warmed-up momentum starts (``--muon_momentum_warmup``): the modded-nanogpt speedrun's and
# nanochat's 0.85, raised linearly to the group's own over the warmup's steps.
MOMENTUM_START = 0.85


def momentum_at(peak: float, warmup: int, step: int) -> float:
    """The momentum of optimizer step ``step + 1`` (``step`` steps done) of a group whose momentum rises
    from :data:`MOMENTUM_START` to ``peak`` over its first ``warmup`` steps."""
    if warmup <= 0 or step >= warmup:
        return peak
    frac = step / warmup
    return (1 - frac) * MOMENTUM_START + frac * peak


class ScheduledLR:
    """Sets the optimizer's learning rate from :func:`lr_at` after each applied optimizer step, and the
    momentum of the groups that warm theirs up (``momentum_warmup`` steps to ``momentum_peak``:
    :func:`momentum_at`).

    DeepSpeed calls :meth:`step` after every step it applies (not after an fp16 step it skips
    for overflow) and saves :meth:`state_dict` in checkpoints.
    """

    def __init__(self, optimizer: Any, schedule: Schedule) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.last_step = 0
        self.resumed_from: dict[str, Any] | None = None
        self.apply()

    def apply(self) -> None:
        """Set each group's rate (and warmed-up momentum) for the next step; a resume calls it again once
        the run's own settings are back over the checkpoint's."""
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
            if warmup := group.get("momentum_warmup"):
                group["momentum"] = momentum_at(group["momentum_peak"], warmup, self.last_step)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.last_step += 1
        self.apply()

    def get_lr(self) -> list[float]:
        """Each group's rate: the curve's, times the group's ``lr_scale`` where it has one (Muon's
        weights, whose peak is their own: :mod:`dsgpt2.optim.muon`)."""
        lr = lr_at(self.schedule, self.last_step)
        return [lr * group.get("lr_scale", 1.0) for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def state_dict(self) -> dict[str, Any]:
        # last_batch_iteration: DeepSpeed's schedulers' step count (-1 before the first), so a
        # checkpoint of this run resumes under --lr_schedule deepspeed too.
        return {
            "last_step": self.last_step,
            "last_batch_iteration": self.last_step - 1,
            "schedule": self.schedule.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The step comes from the checkpoint, the curve from this run's flags (a longer
        # --train_iters stretches it, as the module docstring says).
        if "last_step" in state:
            self.last_step = int(state["last_step"])
        else:  # saved by one of DeepSpeed's schedulers
            self.last_step = int(state.get("last_batch_iteration", -1)) + 1
        self.resumed_from = state.get("schedule")
        self.apply()
