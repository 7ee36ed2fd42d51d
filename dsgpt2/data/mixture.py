"""Mixture weights: how many of the training tokens each collection gives. Pure functions.

With weights, each collection is read as a stream of its own (its own shuffled epochs and cursor),
and every block a rank takes comes from the stream furthest behind its weight: the one with the
least ``tokens taken / weight`` once the block is counted. Shares then track the weights within a
block at every step, with no randomness to save. A collection given more than its natural share
(its size's) runs through its epochs faster, so it repeats; one given less is subsampled: the run
ends before its epoch does. Stages change the weights at given steps; the cursors carry on, so no
document is read twice or skipped because of a change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dsgpt2.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    """From step ``step`` on, collection i gives ``weights[i]`` of the tokens (they sum to 1)."""

    step: int
    weights: tuple[float, ...]


def normalized(weights: Sequence[float]) -> tuple[float, ...]:
    total = float(sum(weights))
    return tuple(w / total for w in weights)


def parse_mixture(text: str, names: Sequence[str]) -> list[Stage]:
    """``"news=0.7,wiki=0.3; 1000: news=0.5,wiki=0.5"`` → stages (a stage without ``STEP:`` starts
    at step 0). A collection left out of a stage gets weight 0.

    Raises:
        ConfigError: malformed text, an unknown collection, a negative or infinite (or NaN) weight, all
            weights 0, steps out of order.
    """
    hint = 'write --mixture "NAME=W,NAME=W" or "NAME=W,...; STEP: NAME=W,..."'
    stages: list[Stage] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        step_text, _, body = part.rpartition(":")
        try:
            step = int(step_text) if step_text.strip() else 0
            pairs = [item.split("=") for item in body.split(",") if item.strip()]
            given = {name.strip(): float(w) for name, w in pairs}
        except ValueError:
            raise ConfigError(f"--mixture {text!r}: cannot read {part!r}; {hint}") from None
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ConfigError(f"--mixture: {', '.join(unknown)} not in COLLECTIONS ({', '.join(names)})")
        # float() reads "inf", "nan" and "1e400" (inf) too.
        infinite = [f"{n.strip()}={w.strip()}" for n, w in pairs if not math.isfinite(given[n.strip()])]
        if infinite:
            raise ConfigError(f"--mixture {part!r}: {infinite[0]} is not a finite weight; give numbers >= 0")
        weights = [given.get(n, 0.0) for n in names]
        if step < 0 or min(weights) < 0 or not sum(weights) > 0:
            raise ConfigError(f"--mixture {part!r}: need a step >= 0 and weights >= 0, not all 0")
        if stages and step <= stages[-1].step:
            raise ConfigError(f"--mixture: stage steps must increase; {step} follows {stages[-1].step}")
        stages.append(Stage(step, normalized(weights)))
    if not stages:
        raise ConfigError(f"--mixture {text!r} names no weights; {hint}")
    return stages


def mixture_stages(config_weights: Sequence[float], flag: str | None, names: Sequence[str]) -> list[Stage]:
    """The run's stages: ``--mixture`` when given (its first stage from step 0 falls back on the
    config's weights when it starts later), else the config's weights; [] for no mixture."""
    base = [Stage(0, normalized(config_weights))] if config_weights else []
    if not flag:
        return base
    stages = parse_mixture(flag, names)
    if stages[0].step > 0:
        if not base:
            raise ConfigError(
                f"--mixture: the first stage starts at step {stages[0].step}; say the weights from step 0 "
                "too (or give the collections weights in the config)"
            )
        stages = base + stages
    return stages


def stage_at(stages: Sequence[Stage], step: int) -> int:
    """The index of the stage in force at ``step``."""
    current = 0
    for i, s in enumerate(stages):
        if s.step <= step:
            current = i
    return current


def pick(taken: Sequence[int], weights: Sequence[float], block: int) -> int:
    """The stream the next block comes from: the least ``(taken + block) / weight``, ties to the
    first. ``taken`` counts the tokens each stream gave since the stage began."""
    best, best_key = -1, 0.0
    for s, (t, w) in enumerate(zip(taken, weights, strict=True)):
        if w <= 0:
            continue
        key = (t + block) / w
        if best < 0 or key < best_key:
            best, best_key = s, key
    return best
