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

from dsgpt2.train import checkpoint
from dsgpt2.train.weights import RUN_INFO, build_with_weights, checkpoint_state

log = logging.getLogger(__name__)


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
