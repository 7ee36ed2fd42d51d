"""The weights of a trained model, wherever they are: an export or a checkpoint (any ZeRO stage).

``path`` may be an export (``config.json`` + safetensors, see :mod:`dsgpt2.infer.export`), a
checkpoint directory (the tag its ``latest`` names, or ``tag``), or one checkpoint tag directory.
:func:`load_weights` gives the GPT-2 config, fp32 state dict, tokenizer directory and run info;
:func:`build_with_weights` a ``GPT2LMHeadModel`` holding them. Finetuning (``--init_from``) and
every inference command start here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from dsgpt2.accelerator import prepare_deepspeed_environment
from dsgpt2.checkpoints import format as checkpoint
from dsgpt2.errors import ConfigError
from dsgpt2.model import causal_lm_loss

log = logging.getLogger(__name__)

RUN_INFO = "dsgpt2_run.json"  # what an export keeps of its training run


def is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def locate_checkpoint(path: Path, tag: str | None) -> tuple[Path, str]:
    """``(ckpt_dir, tag)`` for a checkpoint directory or a tag directory inside one."""
    if tag is None and (path / checkpoint.COMPLETE).is_file():
        return path.parent, checkpoint.resolve(path.parent, path.name)  # verified like any other
    return path, checkpoint.resolve(path, tag)


def init_tokenizer_dir(path: Path) -> Path:
    """The tokenizer a model was trained with: an export holds it; a checkpoint names it."""
    if is_export(path):
        return path
    ckpt_dir, tag = locate_checkpoint(path, None)
    return Path(checkpoint.read_client_state(ckpt_dir, tag)["vocab_dir"])


def load_weights(path: Path, tag: str | None = None) -> tuple[Any, dict[str, Any], Path, dict[str, Any]]:
    """The GPT-2 config, fp32 state dict, tokenizer directory and run info behind ``path``.

    Raises:
        ConfigError: ``path`` is neither an export nor a checkpoint.
        CheckpointError: the checkpoint is incomplete or not dsgpt2's.
    """
    from transformers import GPT2Config

    if not path.exists():
        raise ConfigError(f"model {path}: not found; give an exported model or a checkpoint directory")
    if is_export(path):
        from safetensors.torch import load_file

        if tag is not None:
            raise ConfigError(f"--ckpt_id {tag}: {path} is an exported model, not a checkpoint directory")
        config = GPT2Config.from_pretrained(str(path))
        weights: dict[str, Any] = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        run = json.loads((path / RUN_INFO).read_text()) if (path / RUN_INFO).is_file() else {}
        return config, weights, path, run
    if not checkpoint.has_checkpoints(path) and not (path / checkpoint.COMPLETE).exists() and tag is None:
        raise ConfigError(
            f"model {path}: neither an exported model (config.json + *.safetensors) nor a checkpoint "
            "directory (with `latest`); export one with `dsgpt2 export` or point at --ckpt_dir of a run"
        )
    ckpt_dir, tag = locate_checkpoint(path, tag)
    weights, client = checkpoint_state(ckpt_dir, tag)
    config = GPT2Config.from_dict(client["model_config"])
    run = {
        "step": client["step"],
        "fingerprint": client["fingerprint"],
        "checkpoint": str(ckpt_dir / tag),
        "doc_mask": bool(client.get("args", {}).get("doc_mask", False)),
    }
    return config, weights, Path(client["vocab_dir"]), run


def build_with_weights(config: Any, weights: dict[str, Any], where: str) -> Any:
    """A ``GPT2LMHeadModel`` of ``config`` holding ``weights``, embeddings tied.

    Raises:
        ConfigError: the weights do not fit the config.
    """
    from transformers import GPT2LMHeadModel

    model = causal_lm_loss(GPT2LMHeadModel(config))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # The output projection is the input embedding (tied): a checkpoint may store it once.
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ConfigError(
            f"{where} does not match its model config: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    return model


def checkpoint_state(ckpt_dir: Path, tag: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full fp32 weights of a checkpoint and its dsgpt2 client state."""
    blob = checkpoint.load_states(ckpt_dir, tag)
    client = blob["dsgpt2"]
    if checkpoint.is_partitioned(ckpt_dir, tag):
        prepare_deepspeed_environment()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        weights = {k: v.float() for k, v in blob["module"].items()}
    return weights, client
