"""A tail average of the weights (``--ema_tail N``): over a run's last N steps (or, N in (0, 1), that
share of the run's), an exponential moving average of the weights, the model the run ends on.

The modded-nanogpt speedrun's record evaluates such an average rather than the last step's weights: late
in a run each step still moves the weights around a minimum, and their average sits nearer its bottom.
The average starts at the weights after step ``train_iters - N + 1`` and takes in each later step's with
weight ``2 / (N + 1)`` (an EMA of span N). Training itself never reads it: the optimizer steps the raw
weights, and a checkpoint holds both, so a resume (or a run extended past its end) goes on exactly. What
reads a model out of a checkpoint (``export``, ``evaluate``, ``generate``, ``--init_from``) takes the
average where the checkpoint holds one, and the run's last validation measures it.

The average is kept in fp32 on the weights' device, one copy of the trainable weights; every rank keeps
the same one (ZeRO 0, 1 and 2 hold whole weights on every rank; ZeRO 3 is refused).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from dsgpt2.errors import ConfigError


def tail_steps(tail: float, train_iters: int) -> int:
    """The steps ``--ema_tail`` averages over: ``tail`` itself, or, in (0, 1), that share of
    ``train_iters`` (rounded up)."""
    return math.ceil(tail * train_iters) if 0 < tail < 1 else int(tail)


def check_average(tail: float, train_iters: int, stage: int) -> str | None:
    """The line that says where the average starts, or None without one.

    Raises:
        ConfigError: a tail longer than the run, or ZeRO 3 (whose ranks hold slices of each weight).
    """
    if not tail:
        return None
    steps = tail_steps(tail, train_iters)
    if steps > train_iters:
        raise ConfigError(f"--ema_tail {tail}: must be at most --train_iters {train_iters}")
    if stage == 3:
        raise ConfigError(
            f"--ema_tail {tail}: ZeRO stage 3 holds a slice of each weight on each rank, where the "
            "average needs whole ones; use ZeRO 0, 1 or 2, or leave --ema_tail out"
        )
    share = f" {tail} of {train_iters} steps" if tail < 1 else ""
    return (
        f"weight average: from step {train_iters - steps + 1}, an EMA of span {steps} (--ema_tail{share}); "
        "the run's last validation, its export and evaluation use it"
    )


class TailAverage:
    """The average of ``module``'s trainable weights over the last ``tail`` of ``train_iters`` steps,
    kept in ``state.average`` (a :class:`~dsgpt2.checkpoints.checkpointer.TrainState`, so that each
    checkpoint saves it): ``{"weights": name → fp32 tensor, "aliases": tied name → the name kept}``."""

    def __init__(self, module: torch.nn.Module, tail: float, train_iters: int) -> None:
        tail = tail_steps(tail, train_iters)
        self.start = train_iters - tail if tail else None
        self.share = 2.0 / (tail + 1)  # the weight of each step taken in
        self.on_device = False
        kept: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        self.named: list[tuple[str, torch.nn.Parameter]] = []
        for name, p in module.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                continue
            if id(p) in kept:
                self.aliases[name] = kept[id(p)]
            else:
                kept[id(p)] = name
                self.named.append((name, p))

    def after_step(self, state: Any) -> None:
        """Take in the weights of the step just taken (``state.step`` steps done)."""
        if self.start is None or state.step <= self.start:
            return
        if state.step == self.start + 1 or state.average is None:
            weights = {n: p.detach().float().clone() for n, p in self.named}
            state.average = {"weights": weights, "aliases": dict(self.aliases)}
            self.on_device = True
            return
        held = state.average["weights"]
        if not self.on_device:  # once: an average read back from a checkpoint is on the CPU
            held.update({n: held[n].to(p.device, torch.float32) for n, p in self.named})
            self.on_device = True
        torch._foreach_lerp_([held[n] for n, _ in self.named], [p.detach().float() for _, p in self.named],
                             self.share)  # fmt: skip

    @contextlib.contextmanager
    def applied(self, state: Any, when: bool) -> Iterator[bool]:
        """Where ``when`` and there is an average: the module's weights are the average's inside, the
        raw ones again after. Yields whether they were."""
        if not when or state.average is None:
            yield False
            return
        raw = [p.detach().clone() for _, p in self.named]
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(state.average["weights"][n])
        try:
            yield True
        finally:
            with torch.no_grad():
                for (_, p), r in zip(self.named, raw, strict=True):
                    p.copy_(r)
