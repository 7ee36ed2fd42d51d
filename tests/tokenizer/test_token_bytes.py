"""The UTF-8 bytes each token id stands for (what bits per byte divides by)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsgpt2.tokenizer.bpe import EOT, PAD, VocabSettings, load_tokenizer, special_tokens, train_vocab
from dsgpt2.tokenizer.token_bytes import token_bytes

TEXTS = ["hello café, 100€ each"] * 50


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A byte-level BPE that has merged "hello", "é" (2 bytes) and "€" (3 bytes), with speaker and
    reserved tokens."""
    out = tmp_path_factory.mktemp("bytes") / "tok"
    train_vocab(iter(TEXTS), out, VocabSettings(vocab_size=300, reserved=2), "test", progress=False)
    return load_tokenizer(out)


def _only(tok: Any, text: str) -> int:
    (i,) = tok.encode(text).ids
    return i


def test_a_token_counts_the_utf8_bytes_it_stands_for(tok: Any) -> None:
    counts = token_bytes(tok)
    assert len(counts) == tok.get_vocab_size()
    assert counts[_only(tok, "hello")] == 5
    assert counts[_only(tok, " café")] == 6  # the space, c, a, f, and é's two bytes
    assert counts[_only(tok, "é")] == 2
    assert counts[_only(tok, "€")] == 3
    # Part of a character: é's first byte (0xC3), and the merge of €'s first two (0xE2 0x82), which
    # the byte alphabet writes as "Ã" and "âĤ".
    assert counts[tok.token_to_id("Ã")] == 1
    assert counts[tok.token_to_id("âĤ")] == 2


def test_special_tokens_count_no_bytes(tok: Any) -> None:
    counts = token_bytes(tok)
    specials = special_tokens(reserved=2)
    assert specials[:2] == [EOT, PAD] and len(specials) == 6  # end of text, pad, 2 speakers, 2 unused
    assert [counts[tok.token_to_id(s)] for s in specials] == [0] * 6
    assert min(c for i, c in enumerate(counts) if i >= len(specials)) == 1


@pytest.mark.parametrize(
    "text",
    [
        "hello café, 100€ each",
        "emoji 🎉 (unseen: four single-byte tokens), 日本語, naïve",
        "<|endoftext|> written as text is text",
        "  tabs\tand\r\nwindows lines",
    ],
)
def test_the_bytes_of_an_encoding_sum_to_the_texts(tok: Any, text: str) -> None:
    counts = token_bytes(tok)
    assert sum(counts[i] for i in tok.encode(text).ids) == len(text.encode("utf-8"))


def test_a_tokenizer_that_is_not_byte_level_has_none(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert token_bytes(wordpiece) is None
    # A byte-level decoder over pieces outside the byte alphabet (a SentencePiece's "▁").
    spelled = Tokenizer(models.BPE({"a": 0, "▁": 1, "▁a": 2}, [("▁", "a")]))
    spelled.decoder = decoders.ByteLevel()
    assert token_bytes(spelled) is None
