"""A tiktoken ``Encoding`` built from a dsgpt2 tokenizer directory (vocab.json + merges.txt).

A second, independent BPE implementation over the same vocabulary: the tests
check it gives our ids, the benchmarks time our tokenizer against it.
"""

from __future__ import annotations

import json
from pathlib import Path

# GPT-2's pre-tokenization pattern, which the byte-level pre-tokenizer also uses.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def encoding_from_vocab(directory: Path):
    import tiktoken

    vocab: dict[str, int] = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    meta = json.loads((directory / "dsgpt2_vocab.json").read_text(encoding="utf-8"))
    specials = set(meta["special_tokens"])
    decoder = _byte_decoder()
    ranks = {bytes(decoder[ch] for ch in token): i for token, i in vocab.items() if token not in specials}
    return tiktoken.Encoding(
        name=f"dsgpt2-{directory.name}",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={tok: i for tok, i in meta["special_tokens"].items()},
    )
