"""Batched decoding with a KV cache: the loop behind ``generate``, ``chat`` and ``serve``.

A :class:`Decoder` holds the rows being generated (one per sample of each request) in one batch:
one forward pass per step serves every row. Requests join between steps: their prompts are
prefilled together, left-padded, and their cache rows are merged into the running batch (padding
masked out, positions counted per row, so a row's logits are those it would get alone up to
float rounding); finished or cancelled rows leave the batch at once. That is continuous batching:
a short request never waits for a long one.

Each row samples with its own settings (temperature, top-k, top-p, repetition penalty) and draws
from its own random generator, seeded from its request's ``seed`` and its sample number, so a
text does not depend on what ran before it, what shares its batch or how many samples were asked.
A row stops at end-of-text, at one of its stop tokens, at one of its stop strings (cut at text
level) or after ``max_new_tokens``; its text is delivered in increments as it grows (never half a
UTF-8 character, never the start of a stop string that may still complete).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dsgpt2.errors import ConfigError, GenerationFailed
from dsgpt2.infer.settings import SamplingParams

# The smallest temperature decoding divides by: any smaller one samples as this one does.
MIN_SCALE = 1e-6


@dataclass
class Sample:
    """One row: a completion of its request's prompt."""

    index: int
    ids: list[int] = field(default_factory=list)  # generated, the stop token included
    text: str = ""  # the visible text so far (cut at a stop string, stripped when asked)
    sent: int = 0  # characters of ``text`` already delivered
    finish_reason: str | None = None  # "stop" or "length" once finished


@dataclass
class Delta:
    """New text of one sample; ``finish_reason`` set on its last delta."""

    sample: int
    text: str
    finish_reason: str | None = None


@dataclass(eq=False)
class DecodeRequest:
    """A prompt to complete ``params.num_samples`` times.

    Attributes:
        prompt_ids: the prompt's tokens (fit into the context by :meth:`Decoder.add`).
        params: how to sample.
        stop_ids: tokens that end a sample besides end-of-text (not part of its text).
        stop_texts: strings that end a sample; the text is cut before them.
        strip: deliver the text without leading and trailing whitespace (chat replies).
        on_delta: called from the decoding thread with each piece of new text.
    """

    prompt_ids: Sequence[int]
    params: SamplingParams
    stop_ids: Sequence[int] = ()
    stop_texts: Sequence[str] = ()
    strip: bool = False
    on_delta: Callable[[Delta], None] | None = None
    samples: list[Sample] = field(default_factory=list)
    prompt_tokens: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return bool(self.samples) and all(s.finish_reason for s in self.samples)


def cache_argument(model: Any) -> str:
    """The name under which ``model``'s forward takes and returns the KV cache: ``cache`` since
    transformers 5.24 (which deprecates ``past_key_values``), ``past_key_values`` before it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Decoder:
    """The batch of rows being decoded on one model (used from one thread)."""

    def __init__(self, model: Any, tokenizer: Any, eot: int, device: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eot = eot
        self.device = device
        self.context = int(model.config.n_positions)
        self.vocab = int(model.config.vocab_size)
        self.cache_arg = cache_argument(model)
        self.tokens_generated = 0  # over the decoder's life, for monitoring
        self._clear()

    def _clear(self) -> None:
        self.rows: list[tuple[DecodeRequest, Sample]] = []
        self.cache: Any = None  # DynamicCache of the rows, (B, H, L, D) per layer
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # (B, L): 1 = real token
        self.next_pos = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,)
        self.seen = torch.zeros(0, self.vocab, dtype=torch.bool, device=self.device)  # (B, V)
        self.rngs: list[torch.Generator] = []  # one per row

    def __len__(self) -> int:
        return len(self.rows)

    def fit(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's last tokens that leave room for ``max_new_tokens``; an empty prompt starts
        from end-of-text, as a document does.

        Raises:
            ConfigError: ``max_new_tokens`` does not fit the model's context.
        """
        if params.max_new_tokens >= self.context:
            raise ConfigError(
                f"max_new_tokens {params.max_new_tokens} does not fit the model's context of "
                f"{self.context} tokens; ask for fewer than {self.context}"
            )
        return list(prompt_ids)[-(self.context - params.max_new_tokens) :] or [self.eot]

    @torch.no_grad()
    def add(self, requests: Sequence[DecodeRequest]) -> None:
        """Prefill ``requests`` and join their rows to the batch; each gets its first token.

        Raises:
            ConfigError: a request's ``max_new_tokens`` does not fit the context.
        """
        prompts = [self.fit(r.prompt_ids, r.params) for r in requests]
        if not requests:
            return
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.eot, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            use_cache=True,
        )
        cache = out[self.cache_arg]
        # Each sample of a request is a row of its own, sharing the prompt's cache.
        repeat = torch.tensor([r.params.num_samples for r in requests], device=self.device)
        pick = torch.repeat_interleave(torch.arange(len(requests), device=self.device), repeat)
        layers = [(lay.keys[pick], lay.values[pick]) for lay in cache.layers]
        new_seen = torch.zeros(len(requests), self.vocab, dtype=torch.bool, device=self.device)
        for i, p in enumerate(prompts):
            new_seen[i, torch.tensor(p, device=self.device)] = True
        new_rows = []
        for r, p in zip(requests, prompts, strict=True):
            r.prompt_tokens = len(p)
            r.samples = [Sample(i) for i in range(r.params.num_samples)]
            new_rows += [(r, s) for s in r.samples]
            self.rngs += [_rng(r.params.seed, s.index, self.device) for s in r.samples]
        self._merge(layers, mask[pick], mask[pick].sum(1), new_seen[pick], new_rows)
        self._advance(out.logits[pick, -1].float(), first=len(self.rows) - len(new_rows))

    @torch.no_grad()
    def step(self) -> None:
        """One token for every row, then the finished and cancelled rows leave."""
        self.drop_cancelled()
        if not self.rows:
            return
        last = torch.tensor([s.ids[-1] for _, s in self.rows], device=self.device)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        out = self.model(
            input_ids=last[:, None],
            attention_mask=self.mask,
            position_ids=self.next_pos[:, None],
            use_cache=True,
            **{self.cache_arg: self.cache},
        )
        self.cache = out[self.cache_arg]
        self.next_pos += 1
        self._advance(out.logits[:, -1].float(), first=0)

    def drop_cancelled(self) -> None:
        keep = [i for i, (r, _) in enumerate(self.rows) if not r.cancelled.is_set()]
        if len(keep) < len(self.rows):
            self._keep(keep)

    def fail_all(self) -> list[DecodeRequest]:
        """Empty the batch (after an error); the requests that were in it."""
        requests = list(dict.fromkeys(r for r, _ in self.rows))
        self._clear()
        return requests

    def _merge(
        self,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        next_pos: torch.Tensor,
        seen: torch.Tensor,
        rows: list[tuple[DecodeRequest, Sample]],
    ) -> None:
        from transformers.cache_utils import DynamicCache

        if self.rows:
            # Left-pad the shorter cache so both end at the latest token, then stack the rows.
            width = max(self.mask.shape[1], mask.shape[1])
            old = [(_pad_left(k, width, 2), _pad_left(v, width, 2)) for k, v in self._layers()]
            layers = [
                (torch.cat([ok, _pad_left(k, width, 2)]), torch.cat([ov, _pad_left(v, width, 2)]))
                for (ok, ov), (k, v) in zip(old, layers, strict=True)
            ]
            mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)])
            next_pos = torch.cat([self.next_pos, next_pos])
            seen = torch.cat([self.seen, seen])
        self.cache = DynamicCache(layers)
        self.mask, self.next_pos, self.seen = mask, next_pos, seen
        self.rows += rows

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(lay.keys, lay.values) for lay in self.cache.layers]

    def _keep(self, keep: list[int]) -> None:
        from transformers.cache_utils import DynamicCache

        if not keep:
            self._clear()
            return
        index = torch.tensor(keep, device=self.device)
        mask = self.mask[index]
        # Columns that are padding in every remaining row go: the cache stays as long as its
        # longest row.
        start = int((mask.sum(0) == 0).int().cumprod(0).sum())
        self.cache = DynamicCache([(k[index, :, start:], v[index, :, start:]) for k, v in self._layers()])
        self.mask = mask[:, start:]
        self.next_pos, self.seen = self.next_pos[index], self.seen[index]
        self.rows = [self.rows[i] for i in keep]
        self.rngs = [self.rngs[i] for i in keep]

    def _advance(self, logits: torch.Tensor, first: int) -> None:
        """Sample the next token of rows ``first:`` from their ``logits`` (rows, V), record it,
        deliver the new text, and let finished rows go."""
        rows = self.rows[first:]
        tokens = self._sample(logits, rows, self.seen[first:])
        self.tokens_generated += len(rows)
        self.seen[torch.arange(first, len(self.rows), device=self.device), tokens] = True
        finished = []
        for (request, sample), token in zip(rows, tokens.tolist(), strict=True):
            sample.ids.append(token)
            self._update(request, sample)
            if sample.finish_reason:
                finished.append(request)
        if finished:
            self._keep([i for i, (_, s) in enumerate(self.rows) if not s.finish_reason])

    def _sample(
        self, logits: torch.Tensor, rows: list[tuple[DecodeRequest, Sample]], seen: torch.Tensor
    ) -> torch.Tensor:
        logits = logits[:, : self.tokenizer.get_vocab_size()]  # rows past the vocabulary: never
        if not bool(torch.isfinite(logits).all()):  # greedy would pick token 0, sampling would fail
            raise GenerationFailed(
                "the model's next-token scores are not finite (NaN or infinity): its weights are damaged "
                "or its training diverged; export it again from a checkpoint whose loss was finite"
            )
        seen = seen[:, : logits.shape[1]]
        params = [r.params for r, _ in rows]
        penalty = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[:, None]
        if (penalty != 1).any():
            # As transformers does: a seen token's logit is divided by the penalty (multiplied if
            # negative).
            punished = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, punished, logits)
        chosen = logits.argmax(-1)
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if not sampled:
            return chosen
        index = torch.tensor(sampled, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
        # In float32 and by MIN_SCALE at least: a tiny temperature neither overflows half-precision
        # logits nor float32's (1e-45 samples as 1e-6 does: the likeliest token, but for exact ties).
        scaled = logits[index].float() / temperature.clamp_min(MIN_SCALE)[:, None]
        vocab = scaled.shape[1]
        top_k = [min(params[i].top_k, vocab) or vocab for i in sampled]  # 0: no limit
        top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)[:, None]
        if max(top_k) < vocab:
            values, order = scaled.topk(max(top_k), -1)  # (S, k): the likeliest first
        else:
            values, order = scaled.sort(-1, descending=True)
        ks = torch.tensor(top_k, device=logits.device)[:, None]
        rank = torch.arange(values.shape[1], device=logits.device)[None]
        values = values.masked_fill(rank >= ks, float("-inf"))
        probs = values.softmax(-1)
        # Nucleus: keep the likeliest tokens until their mass reaches top_p, and the likeliest one
        # always (a top_p below float32's smallest number is 0 here, and would leave none to draw).
        before = probs.cumsum(-1) - probs
        probs = probs.masked_fill((before >= top_p) & (rank > 0), 0.0)
        # Back in vocabulary order, so that a row's draw does not depend on how wide the other
        # rows' filters made this tensor.
        probs = torch.zeros_like(scaled).scatter_(1, order, probs)
        rngs = self.rngs[len(self.rows) - len(rows) :]
        picks = torch.cat([torch.multinomial(probs[j], 1, generator=rngs[i]) for j, i in enumerate(sampled)])
        chosen[index] = picks
        return chosen

    def _update(self, request: DecodeRequest, sample: Sample) -> None:
        token = sample.ids[-1]
        if token == self.eot or token in request.stop_ids:
            sample.finish_reason = "stop"
            ids = sample.ids[:-1]
        else:
            ids = sample.ids
            if len(sample.ids) >= request.params.max_new_tokens:
                sample.finish_reason = "length"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in request.stop_texts) if i >= 0]
        if cuts:
            text, sample.finish_reason = text[: min(cuts)], "stop"
        if request.strip:
            text = text.lstrip()
        ready = len(text)
        if not sample.finish_reason:
            # Hold back what may still change: half a UTF-8 character, the start of a stop
            # string, whitespace a stripped reply may end with.
            if text.endswith("\ufffd"):
                ready = len(text.rstrip("\ufffd"))
            ready -= _partial_stop(text[:ready], request.stop_texts)
            if request.strip:
                ready = len(text[:ready].rstrip())
        elif request.strip:
            text = text.rstrip()
            ready = len(text)
        sample.text = text
        if ready > sample.sent or sample.finish_reason:
            delta = Delta(sample.index, text[sample.sent : ready], sample.finish_reason)
            sample.sent = max(ready, sample.sent)
            if request.on_delta:
                request.on_delta(delta)


def _rng(seed: int, sample: int, device: str) -> torch.Generator:
    """The random generator of sample ``sample`` of a request seeded ``seed``: sample 0 draws from
    ``seed`` itself, so a sample does not depend on how many were asked."""
    rng = torch.Generator(device=device)
    rng.manual_seed(seed if sample == 0 else hash((seed, sample)) % 2**63)
    return rng


def _partial_stop(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``stops``."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim)


def run(decoder: Decoder, requests: Sequence[DecodeRequest]) -> None:
    """Decode ``requests`` together until every one is finished (or cancelled)."""
    decoder.add(requests)
    while len(decoder):
        decoder.step()
