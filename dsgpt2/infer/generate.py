"""Text generation from a trained model: sampling settings, stop tokens, seeds.

Decoding is :mod:`dsgpt2.infer.decode`'s batched loop (sampling with temperature, top-k, top-p
and repetition penalty, or greedy at temperature 0); this module adds what a user of the toolkit
relies on: checked settings, the prompt fit into the context, a seed that makes a sample
repeatable without touching the process's global random state, and a stop at end-of-text (or at a
speaker token in a chat).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dsgpt2.documents import text_problem
from dsgpt2.errors import ConfigError
from dsgpt2.infer.decode import Decoder, DecodeRequest, run
from dsgpt2.infer.loading import LoadedModel
from dsgpt2.infer.settings import SamplingParams
from dsgpt2.tokenizer.bpe import load_tokenizer


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
        self.context = loaded.context
        self.decoder = Decoder(self.model, self.tokenizer, self.eot, self.device)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(
        self, prompt: str, params: SamplingParams, on_text: Callable[[str], None] | None = None
    ) -> list[Completion]:
        """``params.num_samples`` completions of the text ``prompt`` (end-of-text stops them).

        Raises:
            ConfigError: the prompt is not valid text (a lone surrogate, say).
        """
        if prompt and text_problem(prompt, 10**9) == "invalid_unicode":
            raise ConfigError("the prompt holds invalid text (a lone surrogate or undecodable bytes)")
        return self.generate_ids(self.encode(prompt), params, on_text=on_text)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop_ids: Sequence[int] = (),
        on_text: Callable[[str], None] | None = None,
        strip: bool = False,
    ) -> list[Completion]:
        """Completions of ``prompt_ids``; generation stops at end-of-text or any of ``stop_ids``.

        The prompt keeps its last tokens when it and ``max_new_tokens`` exceed the context; an
        empty prompt starts from end-of-text, as a document does. ``on_text`` receives the text
        of a single sample as it grows; ``strip`` drops leading and trailing whitespace.

        Raises:
            ConfigError: ``max_new_tokens`` does not fit the model's context.
        """
        on_delta = (lambda d: on_text(d.text) if d.text else None) if on_text else None
        request = DecodeRequest(prompt_ids, params, stop_ids=stop_ids, strip=strip, on_delta=on_delta)
        run(self.decoder, [request])
        return [Completion(s.text, len(s.ids), s.finish_reason or "length") for s in request.samples]
