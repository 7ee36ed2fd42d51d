"""Text generation from a trained model: sampling settings, stop tokens, seeds.

Decoding is transformers' ``model.generate`` (sampling with temperature,
top-k, top-p and repetition penalty, or greedy at temperature 0); this module
adds what a user of the toolkit relies on: checked settings, the prompt fit
into the context, a seed that makes a sample repeatable without touching the
process's global random state, and a stop at end-of-text (or at a speaker
token in a chat).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from dsgpt2.corpus.documents import text_problem
from dsgpt2.data.sources import load_tokenizer
from dsgpt2.errors import ConfigError
from dsgpt2.infer.loading import LoadedModel

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

    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    repetition_penalty: float = 1.0
    num_samples: int = 1
    seed: int = 0

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


@dataclass
class Completion:
    text: str
    tokens: int  # generated tokens, the stop token included
    finish_reason: str  # "stop" (end-of-text or a stop token) or "length"


class Generator:
    """Generates from a loaded model; keeps the tokenizer and stop ids at hand."""

    def __init__(self, loaded: LoadedModel, device: str | None = None) -> None:
        from dsgpt2.tokenizer.bpe import EOT

        self.loaded = loaded
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = loaded.model.to(self.device).eval()
        self.tokenizer = load_tokenizer(loaded.tokenizer_dir)
        self.eot = self.tokenizer.token_to_id(EOT)
        config = self.model.config
        self.pad = config.pad_token_id if config.pad_token_id is not None else self.eot
        self.context = loaded.context

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(self, prompt: str, params: SamplingParams) -> list[Completion]:
        """``params.num_samples`` completions of the text ``prompt`` (end-of-text stops them).

        Raises:
            ConfigError: the prompt is not valid text (a lone surrogate, say).
        """
        if prompt and text_problem(prompt, 10**9) == "invalid_unicode":
            raise ConfigError("the prompt holds invalid text (a lone surrogate or undecodable bytes)")
        return self.generate_ids(self.encode(prompt), params)

    def generate_ids(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop_ids: Sequence[int] = ()
    ) -> list[Completion]:
        """Completions of ``prompt_ids``; generation stops at end-of-text or any of ``stop_ids``.

        The prompt keeps its last tokens when it and ``max_new_tokens`` exceed the context; an
        empty prompt starts from end-of-text, as a document does.

        Raises:
            ConfigError: ``max_new_tokens`` does not fit the model's context.
        """
        if params.max_new_tokens >= self.context:
            raise ConfigError(
                f"max_new_tokens {params.max_new_tokens} does not fit the model's context of "
                f"{self.context} tokens; ask for fewer than {self.context}"
            )
        ids = list(prompt_ids)[-(self.context - params.max_new_tokens) :] or [self.eot]
        input_ids = torch.tensor([ids], device=self.device)
        stops = [self.eot, *stop_ids]
        sampling = params.temperature > 0
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "do_sample": sampling,
            "num_return_sequences": params.num_samples,
            "repetition_penalty": params.repetition_penalty,
            "eos_token_id": stops,
            "pad_token_id": self.pad,
        }
        if sampling:
            kwargs.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_k=None, top_p=None)
        # A private random state: the same seed gives the same text, whatever ran before.
        devices = [self.device] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(params.seed)
            out = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs
            )  # (num_samples, len(ids) + new)
        return [self._completion(row[len(ids) :].tolist(), set(stops)) for row in out]

    def _completion(self, new: list[int], stops: set[int]) -> Completion:
        for i, t in enumerate(new):
            if t in stops:
                return Completion(self.decode(new[:i]), i + 1, "stop")
        return Completion(self.decode(new), len(new), "length")
