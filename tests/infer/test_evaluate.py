"""``evaluate_batches``' bits per byte: what perplexity cannot do, compare tokenizers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dsgpt2.data.loader import Batch
from dsgpt2.data.packing import IGNORE
from dsgpt2.infer.evaluate import evaluate_batches
from dsgpt2.tokenizer.bpe import PAD, VocabSettings, load_tokenizer, train_vocab
from dsgpt2.tokenizer.token_bytes import token_bytes

T, ROWS = 64, 8


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table inverted (the character a byte-level BPE writes → its byte)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


class Fixed(torch.nn.Module):
    """A model-free predictor: the same next-token logits (V,) at every position."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        return SimpleNamespace(logits=self.logits.expand(*input_ids.shape, -1))  # (B, T, V)


def _batches(ids: list[int], pad: int) -> list[Batch]:
    """``ids`` in blocks of T tokens, ROWS to a batch; the last block padded, its padding unlabelled."""
    blocks = [ids[i : i + T] for i in range(0, len(ids), T)]
    out = []
    for k in range(0, len(blocks), ROWS):
        rows = blocks[k : k + ROWS]
        inputs = torch.full((len(rows), T), pad)
        labels = torch.full((len(rows), T), IGNORE)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for j, row in enumerate(rows):
            inputs[j, : len(row)] = labels[j, : len(row)] = torch.tensor(row)
            mask[j, : len(row)] = 1
        out.append(Batch(inputs, labels, mask, [], int(mask.sum())))
    return out


def test_two_vocabularies_differ_in_perplexity_but_agree_in_bits_per_byte(
    sample_texts: list[str], tmp_path: Path
) -> None:
    """One predictor, the byte frequencies of the training text, written over the tokens of a 300-token
    and a 2,000-token BPE trained on that text (a token's logit: the summed log-frequencies of its
    bytes), evaluated on held-out text. The larger vocabulary's tokens hold ~2.3 times the bytes, so
    its perplexity is hundreds of times higher; per byte the two agree. (A unigram over each
    vocabulary's tokens would not make the point: its longer tokens are context, and bits per byte
    rightly fall, from 4.7 to 3.1 here.)"""
    train, held = sample_texts[:1000], sample_texts[-200:]
    counts = torch.bincount(torch.tensor(list("".join(train).encode("utf-8"))), minlength=256) + 1
    log_p = torch.log(counts / counts.sum()).tolist()
    alphabet = gpt2_byte_alphabet()
    found = {}
    for size in (300, 2000):
        train_vocab(iter(train), tmp_path / str(size), VocabSettings(vocab_size=size), "test", progress=False)
        tok = load_tokenizer(tmp_path / str(size))
        logits = torch.full((tok.get_vocab_size(),), -1e4)  # special tokens: never predicted
        specials = tok.get_added_tokens_decoder()
        for piece, i in tok.get_vocab().items():
            if i not in specials:
                logits[i] = sum(log_p[alphabet[c]] for c in piece)
        ids = [i for e in tok.encode_batch(held) for i in e.ids]
        found[size] = evaluate_batches(
            Fixed(logits), _batches(ids, tok.token_to_id(PAD)), progress=False,
            bytes_of=torch.tensor(token_bytes(tok)),
        )  # fmt: skip
    small, large = found[300], found[2000]
    assert large.tokens < 0.6 * small.tokens
    # The same held-out bytes but the first of each block, which nothing predicts.
    assert small.bytes == pytest.approx(sum(len(t.encode("utf-8")) for t in held), rel=0.02)
    assert large.bytes == pytest.approx(small.bytes, rel=0.01)
    assert large.perplexity > 50 * small.perplexity
    assert large.bpb == pytest.approx(small.bpb, rel=0.05)
    assert small.bpb == pytest.approx(small.loss * small.tokens / 0.6931471805599453 / small.bytes)


def test_without_the_bytes_of_the_tokens_there_is_no_bits_per_byte() -> None:
    (batch,) = _batches(list(range(10)), 0)
    m = evaluate_batches(Fixed(torch.zeros(16)), [batch], progress=False)
    assert m.tokens == 9 and m.bpb is None and m.bytes == 0
