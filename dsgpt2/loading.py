"""Load a trained model for inference or finetuning: an exported directory or a checkpoint.

``path`` may be an export (``config.json`` + weights, see :mod:`dsgpt2.export`),
a checkpoint directory (the tag its ``latest`` names, or ``tag``), or one
checkpoint tag directory. Either way the result is a plain
``GPT2LMHeadModel`` in eval mode, the directory of its tokenizer, and what
is known of the run that trained it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsgpt2.errors import ConfigError

log = logging.getLogger(__name__)

RUN_INFO = "dsgpt2_run.json"  # what an export keeps of its training run


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


def is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def locate_checkpoint(path: Path, tag: str | None) -> tuple[Path, str]:
    """``(ckpt_dir, tag)`` for a checkpoint directory or a tag directory inside one."""
    from dsgpt2 import checkpoint

    if tag is None and (path / checkpoint.COMPLETE).is_file():
        return path.parent, checkpoint.resolve(path.parent, path.name)  # verified like any other
    return path, checkpoint.resolve(path, tag)


def init_tokenizer_dir(path: Path) -> Path:
    """The tokenizer a model was trained with: an export holds it; a checkpoint names it."""
    if is_export(path):
        return path
    from dsgpt2 import checkpoint

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
    from dsgpt2 import checkpoint
    from dsgpt2.export import checkpoint_state

    if not checkpoint.has_checkpoints(path) and not (path / checkpoint.COMPLETE).exists() and tag is None:
        raise ConfigError(
            f"model {path}: neither an exported model (config.json + *.safetensors) nor a checkpoint "
            "directory (with `latest`); export one with `dsgpt2 export` or point at --ckpt_dir of a run"
        )
    ckpt_dir, tag = locate_checkpoint(path, tag)
    weights, client = checkpoint_state(ckpt_dir, tag)
    config = GPT2Config.from_dict(client["model_config"])
    run = {"step": client["step"], "fingerprint": client["fingerprint"], "checkpoint": str(ckpt_dir / tag)}
    return config, weights, Path(client["vocab_dir"]), run


def load_model(path: Path, tag: str | None = None, vocab_dir: Path | None = None) -> LoadedModel:
    """A ``GPT2LMHeadModel`` in eval mode from an export or a checkpoint (see the module doc).

    Args:
        path: export directory, checkpoint directory or checkpoint tag directory.
        tag: checkpoint tag (default: ``latest``).
        vocab_dir: tokenizer to use instead of the one the model names.
    """
    config, weights, tokenizer_dir, run = load_weights(path, tag)
    tokenizer_dir = vocab_dir or tokenizer_dir
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ConfigError(
            f"tokenizer {tokenizer_dir}: no tokenizer.json (the model was trained with it); "
            "give the tokenizer directory with --vocab_dir"
        )
    from dsgpt2.data import load_tokenizer

    if load_tokenizer(tokenizer_dir).get_vocab_size() > config.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_dir} has more tokens than the model's {config.vocab_size}; use the "
            "tokenizer the model was trained with (the default without --vocab_dir)"
        )
    model = build_with_weights(config, weights, str(path))
    model.eval()
    name = run.get("checkpoint") or str(path)
    return LoadedModel(model, tokenizer_dir, name, run)


def build_with_weights(config: Any, weights: dict[str, Any], where: str) -> Any:
    """A ``GPT2LMHeadModel`` of ``config`` holding ``weights``, embeddings tied.

    Raises:
        ConfigError: the weights do not fit the config.
    """
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # The output projection is the input embedding (tied): a checkpoint may store it once.
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ConfigError(
            f"{where} does not match its model config: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    return model
