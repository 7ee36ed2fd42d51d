"""Export a checkpoint (any ZeRO stage) as a Hugging Face model directory.

The directory holds ``model.safetensors``, ``config.json``,
``generation_config.json`` and the tokenizer files: ``transformers`` loads
it with ``GPT2LMHeadModel.from_pretrained`` or ``pipeline("text-generation")``,
without dsgpt2.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from dsgpt2 import checkpoint
from dsgpt2.loading import RUN_INFO, build_with_weights

log = logging.getLogger(__name__)


def checkpoint_state(ckpt_dir: Path, tag: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full fp32 weights of a checkpoint and its dsgpt2 client state."""
    blob = checkpoint.load_states(ckpt_dir, tag)
    client = blob["dsgpt2"]
    if checkpoint.is_partitioned(ckpt_dir, tag):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        weights = {k: v.float() for k, v in blob["module"].items()}
    return weights, client


def export(
    ckpt_dir: Path, out: Path, tag: str | None = None, vocab_dir: Path | None = None
) -> dict[str, Any]:
    """Write the checkpoint ``tag`` (default: latest) of ``ckpt_dir`` to ``out``.

    Raises:
        CheckpointError: no complete checkpoint, or not one of dsgpt2's.
    """
    from transformers import AutoTokenizer, GenerationConfig, GPT2Config

    tag = checkpoint.resolve(ckpt_dir, tag)
    weights, client = checkpoint_state(ckpt_dir, tag)
    config = GPT2Config.from_dict(client["model_config"])
    model = build_with_weights(config, weights, str(ckpt_dir / tag))
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    vocab = Path(vocab_dir or client["vocab_dir"])
    tokenizer = AutoTokenizer.from_pretrained(str(vocab))
    tokenizer.model_max_length = config.n_positions
    tokenizer.save_pretrained(str(out))
    for name in ("vocab.json", "merges.txt", "dsgpt2_vocab.json"):
        if (vocab / name).exists():
            shutil.copyfile(vocab / name, out / name)
    # What evaluation needs to find the run's validation split again; nothing secret.
    run = {"step": client["step"], "fingerprint": client["fingerprint"], "checkpoint": str(ckpt_dir / tag)}
    (out / RUN_INFO).write_text(json.dumps(run, indent=1) + "\n")
    return {
        "tag": tag,
        "step": client["step"],
        "out": str(out),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
