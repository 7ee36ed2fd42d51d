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
from pathlib import Path
from typing import Any

from dsgpt2.checkpoints.format import COMPLETE, LATEST, resolve
from dsgpt2.checkpoints.weights import (
    RUN_INFO,
    SHIPPED_TOKENIZER,
    WEIGHT_DIGESTS,
    build_with_weights,
    check_tokenizer,
    checkpoint_state,
    export_run,
    run_info,
)
from dsgpt2.errors import ConfigError
from dsgpt2.files import (
    RECORDED_FILES,
    atomic_write_text,
    check_writable_dir,
    file_sha256,
    is_occupied,
    staged_dir,
    umask,
    unlisted,
)
from dsgpt2.tokenizer.bpe import tokenizer_digest
from dsgpt2.tokenizer.stored import local_tokenizer

log = logging.getLogger(__name__)


def check_out(out: Path, ckpt_dir: Path, vocab: Path, run: dict[str, Any], overwrite: bool) -> None:
    """Refuse an ``--out`` that would overwrite something other than this same export.

    Raises:
        ConfigError: ``out`` is a file, the checkpoint or tokenizer directory (or inside or around
            one), a non-empty directory that is not a dsgpt2 export, or an export of another
            checkpoint or tokenizer while ``overwrite`` is off.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory for the model, such as runs/model")
    check_writable_dir(out, "--out")
    resolved = out.resolve()
    for flag, other in (("the checkpoint directory --ckpt_dir", ckpt_dir), ("the tokenizer", vocab)):
        other = other.resolve()
        if resolved == other or other in resolved.parents or resolved in other.parents:
            raise ConfigError(
                f"--out {out} would write into {flag} ({other}); give a directory of its own, "
                "such as runs/model"
            )
    if not is_occupied(out):
        return
    if not (out / RUN_INFO).is_file():
        raise ConfigError(
            f"--out {out} holds files that are not a dsgpt2 export; give an empty or new directory"
        )
    there = export_run(out)
    others = unlisted(out, there.get(RECORDED_FILES), RUN_INFO, (LATEST, COMPLETE))
    if others:  # the export replaces the whole directory: they would go with it
        raise ConfigError(
            f"--out {out} holds an export and other files ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}); give an empty or new directory"
        )
    same = there.get("checkpoint") == run["checkpoint"] and there.get("step") == run["step"]
    if same and (there.get("fingerprint") or {}).get("tokenizer") == run["fingerprint"]["tokenizer"]:
        return  # the same export again
    if not overwrite:
        raise ConfigError(
            f"--out {out} holds another export ({there.get('checkpoint')}, step {there.get('step')}); "
            "pass --overwrite to replace it, or give another --out"
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
    ckpt_dir: Path,
    out: Path,
    tag: str | None = None,
    vocab_dir: Path | None = None,
    overwrite: bool = False,
    *,
    db_config: str | None = None,
) -> dict[str, Any]:
    """Write the checkpoint ``tag`` (default: latest) of ``ckpt_dir`` to ``out``.

    Args:
        vocab_dir: where the run's tokenizer is, if not where the checkpoint says (a copy of it).
        overwrite: replace an export of another checkpoint at ``out``.
        db_config: the connection config to fetch a tokenizer kept in the database through.

    Raises:
        CheckpointError: no complete checkpoint, or not one of dsgpt2's.
        ConfigError: ``out`` holds something else (see :func:`check_out`), or the tokenizer is not
            the one the run trained with.
    """
    from transformers import GenerationConfig, GPT2Config

    tag = resolve(ckpt_dir, tag)
    weights, client = checkpoint_state(ckpt_dir, tag)
    config = GPT2Config.from_dict(client["model_config"])
    # What evaluation needs to find the run's validation split again; nothing secret.
    run = run_info(client, ckpt_dir / tag)
    copy = None if vocab_dir else run.get("vocab_copy")
    vocab = local_tokenizer(vocab_dir or client["vocab_dir"], db_config, copy)
    check_out(out, ckpt_dir, vocab, run, overwrite)
    check_tokenizer(vocab, run, str(ckpt_dir / tag))
    _check_vocab(vocab, config)
    model = build_with_weights(config, weights, str(ckpt_dir / tag))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    # Written beside --out and moved into place when whole: a crash leaves no half model there, and
    # another export that landed there meanwhile is refused like one that was there before.
    with staged_dir(out, check=lambda: check_out(out, ckpt_dir, vocab, run, overwrite)) as staging:
        _write(model, config, vocab, staging)
        run[SHIPPED_TOKENIZER] = tokenizer_digest(staging)
        run[RECORDED_FILES] = sorted([*os.listdir(staging), RUN_INFO])
        run[WEIGHT_DIGESTS] = {f.name: file_sha256(f) for f in sorted(staging.glob("*.safetensors"))}
        atomic_write_text(staging / RUN_INFO, json.dumps(run, indent=1) + "\n")
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
    # transformers writes the weights through a private temporary file (0600): readable, as the other
    # files are, by whoever serves the model (a container's user, a group).
    mode = 0o666 & ~umask()
    for written in out.iterdir():
        if written.is_file():
            written.chmod(mode)
