"""The UTF-8 bytes each token id stands for: what bits per byte divides by.

A byte-level BPE (GPT-2's, :mod:`dsgpt2.tokenizer.bpe`) writes every byte as one character of a
256-character alphabet, so a token's bytes are fixed whatever text it appears in (a token holding part
of a character's bytes counts those bytes) and number as many as the token has characters. Special
tokens stand for no text: they count 0 bytes (as nanochat counts them).
"""

from __future__ import annotations

from typing import Any


def token_bytes(tokenizer: Any) -> list[int] | None:
    """How many UTF-8 bytes each token id of ``tokenizer`` (a ``tokenizers.Tokenizer``) stands for,
    indexed by id; 0 for special tokens. None when it is not a byte-level BPE: its tokens have no
    fixed bytes (a WordPiece's ``##`` or a SentencePiece's ``▁`` stand for other bytes than they spell).
    """
    from tokenizers import decoders, pre_tokenizers

    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = tokenizer.get_added_tokens_decoder()
    counts = [0] * tokenizer.get_vocab_size()
    for piece, i in tokenizer.get_vocab().items():
        if i in added:
            # An added token matches its text as written, not through the byte alphabet.
            counts[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
        elif alphabet.issuperset(piece):
            counts[i] = len(piece)
        else:
            return None
    return counts
