"""The settings of the model commands, each field also a flag: sampling, serving's limits, what
to evaluate on.

Kept free of torch so that the command line parses (and answers ``--help``) without loading it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from dsgpt2.errors import ConfigError
from dsgpt2.model.gpt2 import DEFAULT_LOSS_CHUNK
from dsgpt2.settings.options import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    RATIO,
    SEED,
    Checked,
    Range,
    option,
)

MAX_SAMPLES = 16
# The least --max_body_bytes: room for a short request with its sampling fields (a few hundred bytes);
# below it every request would get 413.
MIN_BODY_BYTES = 1024
_INTEGER = re.compile(r"[+-]?[0-9]{1,19}")


@dataclass(frozen=True)
class SamplingParams(Checked):
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

    # Checked on construction only (plain int and float flags), from flags as from a request body, the
    # message naming the setting as a request spells it (``temperature must be ...``).
    max_new_tokens: int = option(64, "tokens to generate at most", type=int, check=Range(int, 1))
    # Any temperature above 0 samples, however small (as the OpenAI API takes it): decoding scales
    # by at least MIN_SCALE (decode.py), where a smaller one would overflow the logits.
    temperature: float = option(
        0.8, "0: greedy; higher: more random", type=float, check=Range(float, 0.0, 100.0)
    )
    top_k: int = option(50, "sample among the k likeliest tokens; 0: all", type=int, check=NON_NEGATIVE_INT)
    top_p: float = option(
        0.95,
        "nucleus sampling: the likeliest tokens holding this probability mass",
        type=float,
        check=Range(float, 0.0, 1.0, low_open=True),
    )
    repetition_penalty: float = option(
        1.0, "> 1 discourages tokens already present", type=float, check=Range(float, 0.01, 100.0)
    )
    num_samples: int = option(1, "completions per prompt", type=int, check=Range(int, 1, MAX_SAMPLES))
    seed: int = option(
        0, "the same seed, prompt and model give the same text", type=int, check=Range(int, 0, 2**63 - 1)
    )

    flag_prefix: ClassVar[str] = ""  # named as a request's field

    def check(self) -> None:
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


def as_json(value: Any) -> str:
    """``value`` as a request's JSON spells it (``true``, not Python's ``True``), cut to 80 characters."""
    try:
        shown = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _coerce(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {as_json(value)}")
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {as_json(value)}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and len(value) < 64:
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{name} must be a number, got {as_json(value)}")


@dataclass(frozen=True)
class ServeLimits(Checked):
    """What one request may ask for, and how many may generate at once."""

    max_prompt_chars: int = option(4000, "longest prompt accepted", check=POSITIVE_INT)
    # A flag of its own: --max_new_tokens is the default request's (SamplingParams).
    max_new_tokens: int = option(
        256, "largest max_new_tokens a request may ask", check=POSITIVE_INT, flag="max_tokens_limit"
    )
    max_concurrent: int = option(
        16, "requests in flight at once (decoding or waiting for room in the batch); more get 503",
        check=POSITIVE_INT,
    )  # fmt: skip
    max_batch: int = option(8, "sequences decoded together in one batch (samples count)", check=POSITIVE_INT)
    max_sequences: int = option(
        MAX_SAMPLES,
        "sequences one request may ask for (its prompts times n); more get a 400",
        check=POSITIVE_INT,
    )
    max_body_bytes: int | None = option(
        None,
        f"largest request body in bytes, at least {MIN_BODY_BYTES:,}; larger get 413 (default: room for "
        "--max_sequences prompts of --max_prompt_chars characters, at 6 bytes a character as JSON escapes "
        "them, and 64,000 more)",
        check=Range(int, MIN_BODY_BYTES),
    )

    def convert(self) -> None:
        if self.max_body_bytes is None:
            room = 6 * self.max_prompt_chars * self.max_sequences + 64_000
            object.__setattr__(self, "max_body_bytes", room)

    @property
    def max_head_bytes(self) -> int:
        """The longest request line and headers read: room for a query that carries a prompt of
        ``max_prompt_chars`` characters (``GET /generate?sentence=``), percent-encoded at 12 bytes a
        character (4 UTF-8 bytes of 3 each), and 16 KiB more (h11's own bound) for the rest."""
        return 12 * self.max_prompt_chars + 16 * 1024

    def check_length(self, asked: int, name: str = "max_new_tokens") -> None:
        """A request's length within what this server allows (``name``: as the request spells it).

        Raises:
            ConfigError: more tokens than ``max_new_tokens`` (--max_tokens_limit).
        """
        if asked > self.max_new_tokens:
            raise ConfigError(f"{name} {asked} is more than this server allows ({self.max_new_tokens})")

    def check_sequences(self, prompts: int, samples: int, name: str = "num_samples") -> None:
        """A request's sequences (``prompts`` times ``samples``, the latter spelt ``name``) within
        what this server decodes for one request.

        Raises:
            ConfigError: more than ``max_sequences``.
        """
        if prompts * samples <= self.max_sequences:
            return
        asked = f"{name} {samples}" if prompts == 1 else f"{prompts} prompts times {name} {samples}"
        raise ConfigError(
            f"{asked} is more sequences than this server decodes for one request "
            f"({self.max_sequences}); ask for fewer"
        )


EVAL_SPLITS = ("val", "train", "all")


@dataclass
class EvalRequest(Checked):
    """What to evaluate on, each field also a ``dsgpt2 evaluate`` flag; one left None comes from the
    model's training run."""

    split: str = option(
        "val", "the run's validation or training split, or every document", choices=EVAL_SPLITS
    )
    collections: tuple[str, ...] | None = option(
        None,
        "evaluate on this collection (repeatable; default: the config's)",
        flag="collection",
        repeat=True,
    )
    start: int | None = option(
        None, "first document of the unified index (default: 0)", check=NON_NEGATIVE_INT
    )
    stop: int | None = option(None, "end of the unified index range (default: all)", check=POSITIVE_INT)
    task: str | None = option(None, "lm or conversation (default: the run's)", choices=["lm", "conversation"])
    reply_speakers: str | None = option(None, "conversation task: speakers scored (default: the run's)")
    tr_ratio: float | None = option(None, "split ratio (default: the run's)", check=RATIO)
    seed: int | None = option(None, "split seed (default: the run's)", flag="split_seed", check=SEED)
    context: int | None = option(
        None, "tokens per block (default: the run's)", check=Range(int, 2), flag="context_length"
    )
    batch_size: int = option(8, "blocks per forward pass", check=POSITIVE_INT)
    max_batches: int | None = option(None, "stop after this many batches (default: all)", check=POSITIVE_INT)
    workers: int = option(2, "tokenizing worker processes", check=Range(int, 0, 256), flag="num_workers")
    doc_mask: bool | None = option(None, "attention within documents only (default: as the model trained)")
    loss_chunk: int = option(
        DEFAULT_LOSS_CHUNK,
        "cross-entropy over the LM head in chunks of this many tokens (0: over the whole logits at once)",
        check=NON_NEGATIVE_INT,
    )

    def convert(self) -> None:
        if self.collections is not None:
            self.collections = tuple(self.collections)
        if self.stop is not None and self.start is None:
            self.start = 0

    def check(self) -> None:
        if self.start is not None and self.stop is not None and self.start >= self.stop:
            raise ConfigError(f"--start/--stop: need start < stop; got {self.start} and {self.stop}")

    @property
    def window(self) -> tuple[int, int] | None:
        """The unified-index range asked for; None: every document."""
        if self.start is None:
            return None
        return (self.start, self.stop if self.stop is not None else 2**62)
