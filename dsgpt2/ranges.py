"""Even range splitting: ``[start, stop)`` cut into contiguous parts as even as integers allow.

One rule for every cut of a range into parts: a tokenizer's training texts into shards
(:mod:`dsgpt2.tokenizer.texts`), a collection's idx values into machines' parts and workers' windows
(:mod:`dsgpt2.curation.steps`).
"""

from __future__ import annotations


def even_ranges(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into ``parts`` contiguous ``[lo, hi)`` ranges, in order, whose sizes differ
    by at most one. Fewer parts where the range holds fewer values than ``parts``; an empty range is
    one empty part, so a caller always has a range to hand out."""
    n = stop - start
    parts = max(1, min(parts, n))
    cuts = [start + n * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]
