"""A trained model ready to run: :func:`load_model` gives a ``GPT2LMHeadModel`` in eval mode, the
directory of its tokenizer (checked against the model's vocabulary) and what is known of the run
that trained it, from an export or a checkpoint (see :mod:`dsgpt2.checkpoints.weights`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsgpt2.checkpoints.weights import build_with_weights, check_tokenizer, load_weights
from dsgpt2.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run, and where it came from."""

    model: Any  # GPT2LMHeadModel
    tokenizer_dir: Path
    name: str  # for reports: "<dir>" or "<ckpt_dir>/<tag>"
    run: dict[str, Any] = field(default_factory=dict)  # step, fingerprint (empty when unknown)

    @property
    def context(self) -> int:
        return int(self.model.config.n_positions)


def load_model(
    path: Path, tag: str | None = None, vocab_dir: Path | None = None, *, db_config: str | None = None
) -> LoadedModel:
    """A ``GPT2LMHeadModel`` in eval mode from an export or a checkpoint (see the module doc).

    Args:
        path: export directory, checkpoint directory or checkpoint tag directory.
        tag: checkpoint tag (default: ``latest``).
        vocab_dir: where the model's tokenizer is, instead of where the model says (a copy of it).
        db_config: the connection config to fetch a tokenizer kept in the database through.

    Raises:
        ConfigError: not a model, or a tokenizer other than the one it was trained with.
    """
    from dsgpt2.tokenizer.stored import local_tokenizer

    config, weights, recorded, run = load_weights(path, tag)
    copy = None if vocab_dir else run.get("vocab_copy")
    tokenizer_dir = local_tokenizer(vocab_dir or recorded, db_config, copy)
    name = run.get("checkpoint") or str(path)
    # The tokenizer pinned by hash: another one would read other ids than the model learned.
    check_tokenizer(tokenizer_dir, run, str(path))  # named as given: an export ships its tokenizer there
    from dsgpt2.tokenizer.bpe import load_tokenizer

    if load_tokenizer(tokenizer_dir).get_vocab_size() > config.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_dir} has more tokens than the model's {config.vocab_size}; use the "
            "tokenizer the model was trained with (the default without --vocab_dir)"
        )
    model = build_with_weights(config, weights, str(path))
    model.eval()
    return LoadedModel(model, tokenizer_dir, name, run)
