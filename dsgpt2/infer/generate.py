"""Text generation from a trained model: sampling settings, stop tokens, seeds.

Decoding is transformers' ``model.generate`` (sampling with temperature,
top-k, top-p and repetition penalty, or greedy at temperature 0); this module
adds what a user of the toolkit relies on: checked settings, the prompt fit
into the context, a seed that makes a sample repeatable without touching the
process's global random state, and a stop at end-of-text (or at a speaker
token in a chat).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsgpt2.corpus.documents import text_problem
from dsgpt2.data.sources import load_tokenizer
from dsgpt2.errors import ConfigError
from dsgpt2.infer.loading import LoadedModel
from dsgpt2.infer.settings import SamplingParams


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
