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
from dsgpt2.errors import ConfigError, first_line
from dsgpt2.files import file_sha256, not_a_file
from dsgpt2.model.gpt2 import causal_lm_loss
from dsgpt2.tokenizer.stored import stored_tokenizer

log = logging.getLogger(__name__)

RUN_INFO = "dsgpt2_run.json"  # what an export keeps of its training run
WEIGHT_DIGESTS = "weights"  # its record of each weights file: size and SHA-256, checked as it loads
# In RUN_INFO: the hash of the tokenizer.json the export ships (transformers writes it anew, so it is
# not the run's file byte for byte).
SHIPPED_TOKENIZER = "tokenizer_digest"


def is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def locate_checkpoint(path: Path, tag: str | None) -> tuple[Path, str]:
    """``(ckpt_dir, tag)`` for a checkpoint directory or a tag directory inside one."""
    if tag is None and (path / checkpoint.COMPLETE).is_file():
        return path.parent, checkpoint.resolve(path.parent, path.name)  # verified like any other
    return path, checkpoint.resolve(path, tag)


def init_tokenizer_dir(path: Path) -> Path:
    """The tokenizer a model was trained with: an export holds it; a checkpoint names it.

    Raises:
        ConfigError: that tokenizer is no longer the one the model was trained with.
    """
    if is_export(path):
        check_tokenizer(path, export_run(path), str(path))
        return path
    ckpt_dir, tag = locate_checkpoint(path, None)
    client = checkpoint.read_client_state(ckpt_dir, tag)
    vocab = Path(client["vocab_dir"])
    if stored_tokenizer(vocab) is not None:
        return vocab  # fetched by the run through its connection; its vocabulary size checked there
    check_tokenizer(vocab, run_info(client, ckpt_dir / tag), str(ckpt_dir / tag))
    return vocab


def export_run(path: Path) -> dict[str, Any]:
    """What an export records of its training run (empty for a model exported elsewhere).

    Raises:
        ConfigError: the record is damaged.
    """
    if not (path / RUN_INFO).exists():
        return {}
    why = not_a_file(path / RUN_INFO)  # a folder or a named pipe there is no record, not an absent one
    if why is not None:
        raise damaged_export(path, RUN_INFO, ValueError(why))
    try:
        run = json.loads((path / RUN_INFO).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged_export(path, RUN_INFO, exc) from exc
    if not isinstance(run, dict):
        raise damaged_export(path, RUN_INFO, ValueError("not a JSON object"))
    return run


def read_export(path: Path) -> tuple[Any, dict[str, Any]]:
    """The GPT-2 config and weights of the export at ``path``.

    Raises:
        ConfigError: one of its files is damaged (cut short, not JSON, values of the wrong type).
    """
    from safetensors.torch import load_file
    from transformers import GPT2Config

    name = "config.json"
    recorded = export_run(path).get(WEIGHT_DIGESTS) or {}
    try:
        config = GPT2Config.from_pretrained(str(path))
        weights: dict[str, Any] = {}
        for f in sorted(path.glob("*.safetensors")):
            name = f.name
            why = not_a_file(f)  # a named pipe would wait for a writer
            if why is not None:
                raise ValueError(why)
            if name in recorded and file_sha256(f) != recorded[name]:
                # Bytes changed in place keep the format valid: the weights would load, and give NaN.
                raise ValueError(
                    "its size or SHA-256 differs from the export's record, damaged or written by another tool"
                )
            weights.update(load_file(str(f)))
    except Exception as exc:  # transformers', huggingface_hub's and safetensors' own errors of a bad file
        raise damaged_export(path, name, exc) from exc
    check_generation_config(path)
    return config, weights


def damaged_export(path: Path, name: str, exc: BaseException) -> ConfigError:
    return ConfigError(
        f"model {path}: {name} cannot be read ({first_line(exc)}): the export is damaged; export it again "
        "from its checkpoint (`dsgpt2 export --ckpt_dir DIR --out DIR`)"
    )


GENERATION_CONFIG = "generation_config.json"
# The kinds of value transformers' GenerationConfig takes for its keys (any other key it keeps as it is).
_WHOLE = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "num_beams", "num_beam_groups",
          "top_k", "no_repeat_ngram_size", "num_return_sequences")  # fmt: skip
_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_bos_token_id",
           "forced_eos_token_id")  # fmt: skip
_NUMBERS = ("temperature", "top_p", "typical_p", "min_p", "repetition_penalty", "length_penalty",
            "diversity_penalty", "epsilon_cutoff", "eta_cutoff")  # fmt: skip
_FLAGS = ("do_sample", "use_cache", "output_scores", "output_attentions", "output_hidden_states",
          "return_dict_in_generate", "renormalize_logits", "remove_invalid_values")  # fmt: skip


def check_generation_config(path: Path) -> None:
    """Refuse an export whose generation_config.json is not one: dsgpt2 reads its token ids from
    config.json, but transformers loads this file with the model, and of a junk one keeps nothing (not
    JSON, a value of the wrong type) or fails (not an object).

    Raises:
        ConfigError: naming the file, what is wrong with it and the way out.
    """
    file = path / GENERATION_CONFIG
    if not file.is_file():
        return
    try:
        data = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"not valid JSON: {first_line(exc)}"
    else:
        problem = _generation_problem(data)
    if problem:
        raise ConfigError(
            f"model {path}: {GENERATION_CONFIG} cannot be read ({problem}); delete it (the model's "
            "config.json holds its token ids) or export the model again (`dsgpt2 export --ckpt_dir DIR "
            "--out DIR`)"
        )


def _generation_problem(data: Any) -> str | None:
    """What is wrong with a generation config's JSON ``data``; None where nothing is."""
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "true or false"}.get(type(data), "a number")
        return f'{"null" if data is None else kind}, not a JSON object such as {{"eos_token_id": 0}}'

    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    for key, value in data.items():
        if value is None:
            continue
        shown = repr(value)[:80]  # a value of megabytes is not a line
        if key in _WHOLE and not whole(value):
            return f"{key} is {shown}, not a whole number"
        if key in _TOKENS and not (whole(value) or (isinstance(value, list) and all(map(whole, value)))):
            return f"{key} is {shown}, not a token id or a list of them"
        if key in _NUMBERS and (isinstance(value, bool) or not isinstance(value, int | float)):
            return f"{key} is {shown}, not a number"
        if key in _FLAGS and not isinstance(value, bool):
            return f"{key} is {shown}, not true or false"
    return None


def run_info(client: dict[str, Any], where: Path) -> dict[str, Any]:
    """What a checkpoint's client state says of its run, as an export records it."""
    return {
        "step": client["step"],
        "fingerprint": client["fingerprint"],
        "checkpoint": str(where),
        "vocab_dir": str(client["vocab_dir"]),
        # Where the tokenizer is in the database (vocab_dir gridfs:NAME): the run's own copy of it.
        **({"vocab_copy": client["vocab_copy"]} if client.get("vocab_copy") else {}),
        # Trained with attention inside documents: evaluation does the same by default.
        "doc_mask": bool(client.get("args", {}).get("doc_mask", False)),
        # What it learned: text (lm) or conversations; chat refuses a model that never saw one.
        "task": client.get("args", {}).get("task"),
    }


def check_tokenizer(tokenizer_dir: Path, run: dict[str, Any], model: str) -> None:
    """Refuse a tokenizer other than the one ``model`` was trained with, by content hash.

    ``run`` is what the checkpoint or export records (see :func:`run_info`): the hash of the run's
    tokenizer (its data fingerprint) and, for an export, of the copy it ships. A model that records
    neither (exported elsewhere, or before exports recorded one) is not checked.

    Raises:
        ConfigError: no tokenizer.json there, or one with another hash.
    """
    from dsgpt2.data.sources import tokenizer_digest

    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ConfigError(
            f"tokenizer {tokenizer_dir}: no tokenizer.json (the model {model} was trained with one); "
            "give the tokenizer directory with --vocab_dir"
        )
    trained = (run.get("fingerprint") or {}).get("tokenizer")
    shipped = run.get(SHIPPED_TOKENIZER)
    if trained is None or (is_export(Path(model)) and Path(model) == tokenizer_dir and shipped is None):
        return
    digest = tokenizer_digest(tokenizer_dir)
    if digest in {trained, shipped}:
        return
    was = f"hash {shipped}, shipped in {model}" if shipped else f"hash {trained}"
    if run.get("vocab_dir"):
        was += f", from {run['vocab_dir']}"
    raise ConfigError(
        f"tokenizer {tokenizer_dir} (hash {digest}) is not the one {model} was trained with ({was}): "
        "it was rewritten or replaced since; give that tokenizer with --vocab_dir"
    )


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
        if tag is not None:
            raise ConfigError(f"--ckpt_id {tag}: {path} is an exported model, not a checkpoint directory")
        return (*read_export(path), path, export_run(path))
    if not checkpoint.has_checkpoints(path) and not (path / checkpoint.COMPLETE).exists() and tag is None:
        raise ConfigError(
            f"model {path}: neither an exported model (config.json + *.safetensors) nor a checkpoint "
            "directory (with `latest`); export one with `dsgpt2 export`, or give the directory a training "
            "run saved its checkpoints to"
        )
    ckpt_dir, tag = locate_checkpoint(path, tag)
    weights, client = checkpoint_state(ckpt_dir, tag)
    config = GPT2Config.from_dict(client["model_config"])
    return config, weights, Path(client["vocab_dir"]), run_info(client, ckpt_dir / tag)


def build_with_weights(config: Any, weights: dict[str, Any], where: str) -> Any:
    """A ``GPT2LMHeadModel`` of ``config`` holding ``weights``, embeddings tied.

    Raises:
        ConfigError: the weights do not fit the config.
    """
    from transformers import GPT2LMHeadModel

    try:
        model = causal_lm_loss(GPT2LMHeadModel(config))
    except (ValueError, TypeError, ArithmeticError) as exc:  # n_head 0 or not dividing n_embd, say
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{where}: its model config does not make a GPT-2 ({reason})") from None
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # a tensor of another shape than the config's
        shapes = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        raise ConfigError(
            f"{where} does not match its model config: {len(shapes)} weight(s) of another shape "
            f"({'; '.join(shapes[:2])[:300]}{', ...' if len(shapes) > 2 else ''})"
        ) from None
    # The output projection is the input embedding (tied): a checkpoint may store it once.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        said = [f"{len(names)} {kind} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                for kind, names in (("missing", missing), ("unexpected", unexpected)) if names]  # fmt: skip
        raise ConfigError(f"{where} does not match its model config: weights {' and '.join(said)}")
    model.tie_weights()
    return model


def checkpoint_state(ckpt_dir: Path, tag: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full fp32 weights of a checkpoint (its tail average's, where it holds one) and its dsgpt2
    client state."""
    blob = checkpoint.load_states(ckpt_dir, tag)
    client = blob["dsgpt2"]
    if checkpoint.is_partitioned(ckpt_dir, tag):
        prepare_deepspeed_environment()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        weights = {k: v.float() for k, v in blob["module"].items()}
    return with_average(weights, client.get("average")), client


def with_average(weights: dict[str, torch.Tensor], average: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """A checkpoint's full weights, its tail average (``--ema_tail``; where it holds one) in place of the
    raw ones: the model the run ends on."""
    if not average:
        return weights
    held = {n: t.float().cpu() for n, t in average["weights"].items()}
    held.update({alias: held[name] for alias, name in average.get("aliases", {}).items()})
    return {**weights, **{n: t for n, t in held.items() if n in weights}}
