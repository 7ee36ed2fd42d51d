"""The settings of the model commands, each field also a flag: sampling, and serving's limits.

Kept free of torch so that the command line parses (and answers ``--help``) without loading it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from dsgpt2.argtypes import positive_int
from dsgpt2.errors import ConfigError
from dsgpt2.options import option

MAX_SAMPLES = 16
MIN_TEMPERATURE = 0.01
_INTEGER = re.compile(r"[+-]?[0-9]{1,19}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Checked on construction; the message names the setting and its range.

    Attributes:
        max_new_tokens: tokens to generate at most.
        temperature: 0 for greedy decoding; higher is more random.
        top_k: sample among the k likeliest tokens (0: no limit).
        top_p: sample among the likeliest tokens holding this probability mass (1: no limit).
        repetition_penalty: > 1 discourages tokens already present.
        num_samples: completions per prompt.
        seed: the same seed, prompt and model give the same text.
    """

    max_new_tokens: int = option(64, "tokens to generate at most", type=positive_int)
    temperature: float = option(0.8, "0: greedy; higher: more random")
    top_k: int = option(50, "sample among the k likeliest tokens; 0: all")
    top_p: float = option(0.95, "nucleus sampling: the likeliest tokens holding this probability mass")
    repetition_penalty: float = option(1.0, "> 1 discourages tokens already present")
    num_samples: int = option(1, "completions per prompt", type=positive_int)
    seed: int = option(0, "the same seed, prompt and model give the same text")

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        # Below 0.01 the scaled logits overflow: such a temperature is greedy in all but name.
        if self.temperature != 0:
            _check_float("temperature", self.temperature, MIN_TEMPERATURE, 100.0, zero=True)
        _check_int("top_k", self.top_k, 0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_float("repetition_penalty", self.repetition_penalty, 0.01, 100.0)
        _check_int("num_samples", self.num_samples, 1, MAX_SAMPLES)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        if self.temperature == 0 and self.num_samples > 1:
            raise ConfigError(
                "num_samples > 1 needs sampling: greedy decoding (temperature 0) gives one answer; "
                "set a temperature above 0 or num_samples 1"
            )

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any], defaults: SamplingParams | None = None
    ) -> SamplingParams:
        """Settings from strings or JSON values (a query string, a request body).

        Raises:
            ConfigError: an unknown setting or a value of the wrong type or range.
        """
        base = defaults or cls()
        known = {f.name: f.type for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"unknown setting {key!r}; known: {', '.join(known)}")
            kind = int if known[key] in (int, "int") else float
            out[key] = _coerce(key, value, kind)
        return cls(**{**{f.name: getattr(base, f.name) for f in fields(cls)}, **out})


def _coerce(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and len(value) < 64:
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{name} must be a number, got {value!r}")


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
        bound = f"between {low} and {high}" if high else f"at least {low}"
        raise ConfigError(f"{name} must be an integer {bound}, got {value!r}")


def _check_float(
    name: str, value: Any, low: float, high: float, low_open: bool = False, zero: bool = False
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        also = "0 or " if zero else ""
        raise ConfigError(f"{name} must be {also}a number in {bracket}{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for, and how many may generate at once."""

    max_prompt_chars: int = option(4000, "longest prompt accepted", type=positive_int)
    max_new_tokens: int = option(256, "largest max_new_tokens a request may ask", type=positive_int)
    max_concurrent: int = option(
        16, "requests in flight at once (decoding or waiting for room in the batch); more get 503",
        type=positive_int,
    )  # fmt: skip
    max_batch: int = option(8, "sequences decoded together in one batch (samples count)", type=positive_int)
    max_body_bytes: int = option(64_000, "largest request body", type=positive_int)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name} must be a positive integer, got {value!r}")
