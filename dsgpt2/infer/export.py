"""Export a checkpoint (any ZeRO stage) as a Hugging Face model directory.

The directory holds ``model.safetensors``, ``config.json``,
``generation_config.json`` and the tokenizer files: ``transformers`` loads
it with ``GPT2LMHeadModel.from_pretrained`` or ``pipeline("text-generation")``,
without dsgpt2.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dsgpt2.checkpoints.format import resolve
from dsgpt2.checkpoints.weights import RUN_INFO, build_with_weights, checkpoint_state
from dsgpt2.errors import ConfigError
from dsgpt2.files import atomic_write_text

log = logging.getLogger(__name__)


def check_out(out: Path, ckpt_dir: Path, vocab: Path) -> None:
    """Refuse an ``--out`` that would overwrite something other than an earlier export.

    Raises:
        ConfigError: ``out`` is a file, the checkpoint or tokenizer directory (or inside or around
            one), or a non-empty directory that is not a dsgpt2 export.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory for the model, such as runs/model")
    resolved = out.resolve()
    for flag, other in (("the checkpoint directory --ckpt_dir", ckpt_dir), ("the tokenizer", vocab)):
        other = other.resolve()
        if resolved == other or other in resolved.parents or resolved in other.parents:
            raise ConfigError(
                f"--out {out} would write into {flag} ({other}); give a directory of its own, "
                "such as runs/model"
            )
    if out.is_dir() and any(out.iterdir()) and not (out / RUN_INFO).is_file():
        raise ConfigError(
            f"--out {out} holds files that are not a dsgpt2 export; give an empty or new directory"
        )


def _check_vocab(vocab: Path, config: Any) -> None:
    from dsgpt2.tokenizer.bpe import load_tokenizer

    if not (vocab / "tokenizer.json").is_file():
        raise ConfigError(
            f"--vocab_dir {vocab}: no tokenizer.json; leave --vocab_dir out to ship the tokenizer the "
            "run trained with"
        )
    size = load_tokenizer(vocab).get_vocab_size()
    if size != config.vocab_size:
        raise ConfigError(
            f"--vocab_dir {vocab} has {size} tokens but the model has {config.vocab_size}: the "
            "model would read other ids than it learned. Leave --vocab_dir out to ship the "
            "tokenizer the run trained with"
        )


def export(
    ckpt_dir: Path, out: Path, tag: str | None = None, vocab_dir: Path | None = None
) -> dict[str, Any]:
    """Write the checkpoint ``tag`` (default: latest) of ``ckpt_dir`` to ``out``.

    Raises:
        CheckpointError: no complete checkpoint, or not one of dsgpt2's.
    """
    from transformers import GenerationConfig, GPT2Config

    tag = resolve(ckpt_dir, tag)
    weights, client = checkpoint_state(ckpt_dir, tag)
    config = GPT2Config.from_dict(client["model_config"])
    vocab = Path(vocab_dir or client["vocab_dir"])
    check_out(out, ckpt_dir, vocab)
    _check_vocab(vocab, config)
    model = build_with_weights(config, weights, str(ckpt_dir / tag))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    # Written beside --out and moved into place when whole: a crash leaves no half model there.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(model, config, vocab, staging)
        # What evaluation needs to find the run's validation split again; nothing secret.
        run = {
            "step": client["step"],
            "fingerprint": client["fingerprint"],
            "checkpoint": str(ckpt_dir / tag),
            # Trained with attention inside documents: evaluation does the same by default.
            "doc_mask": bool(client.get("args", {}).get("doc_mask", False)),
        }
        atomic_write_text(staging / RUN_INFO, json.dumps(run, indent=1) + "\n")
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {
        "tag": tag,
        "step": client["step"],
        "out": str(out),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _write(model: Any, config: Any, vocab: Path, out: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # One file's "Writing model shards" bar is noise.
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(vocab))
    tokenizer.model_max_length = config.n_positions
    tokenizer.save_pretrained(str(out))
    for name in ("vocab.json", "merges.txt", "dsgpt2_vocab.json"):
        if (vocab / name).exists():
            shutil.copyfile(vocab / name, out / name)


def _replace_dir(new: Path, out: Path) -> None:
    """Put ``new`` at ``out``; an earlier export there goes only once the new one is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
