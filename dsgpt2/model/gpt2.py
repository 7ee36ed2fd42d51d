"""The GPT-2 model: presets, construction, optimizer parameter groups, and its inputs and held-out
loss on a packed batch.

Imports torch and transformers only (never deepspeed or pymongo).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsgpt2.data.packing import IGNORE
from dsgpt2.errors import ConfigError, first_line
from dsgpt2.files import not_a_file


@dataclass(frozen=True)
class Preset:
    """A model size: layers, width, heads, and the context it is meant for."""

    n_layer: int
    n_embd: int
    n_head: int
    context: int
    note: str


# Tokens per chunk of the LM head's cross-entropy (:mod:`dsgpt2.model.loss`): at GPT-2's 50,257-token
# vocabulary a chunk's float32 logits take 0.8 GB where a whole 16 × 1,024 micro-batch's take 3.3 GB.
DEFAULT_LOSS_CHUNK = 4096

PRESETS: dict[str, Preset] = {
    "tiny": Preset(2, 64, 2, 128, "CPU runs and tests"),
    "112m_half": Preset(6, 768, 12, 1024, "GPT-2 small width, half the layers"),
    "112m": Preset(12, 768, 12, 1024, "GPT-2 small"),
    "345m": Preset(24, 1024, 16, 1024, "GPT-2 medium"),
    "762m": Preset(36, 1280, 20, 1024, "GPT-2 large (memory experiments)"),
    "1.5b": Preset(48, 1600, 25, 1024, "GPT-2 XL (memory experiments)"),
}


def gpt2_config(
    preset: str | None, vocab_size: int, context: int, eot: int, pad: int, *, config_json: Path | None = None
) -> Any:
    """A ``GPT2Config`` from a preset or an HF config JSON, sized for the tokenizer.

    Raises:
        ConfigError: unknown preset, unreadable JSON, or a context the model cannot hold.
    """
    from transformers import GPT2Config

    if config_json is not None:
        cfg = GPT2Config(**read_model_config(config_json))
    else:
        if preset not in PRESETS:
            raise ConfigError(
                f"--model_select {preset!r} is not a preset; choose one of {', '.join(PRESETS)}"
            )
        p = PRESETS[preset]
        # No dropout: pretraining on a corpus seen about once needs none (nanoGPT and llm.c train
        # GPT-2 without it); a --model_config sets its own.
        cfg = GPT2Config(n_layer=p.n_layer, n_embd=p.n_embd, n_head=p.n_head, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    cfg.vocab_size = vocab_size
    cfg.n_positions = max(context, getattr(cfg, "n_positions", context)) if config_json else context
    cfg.bos_token_id = eot
    cfg.eos_token_id = eot
    cfg.pad_token_id = pad
    cfg.tie_word_embeddings = True
    if context > cfg.n_positions:
        raise ConfigError(f"--context_length {context} exceeds the model's n_positions {cfg.n_positions}")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd {cfg.n_embd} is not divisible by n_head {cfg.n_head}")
    return cfg


def check_model_sizes(cfg: Any, where: str) -> None:
    """Refuse a layer count, width, head count or dropout a GPT-2 cannot have (zero layers trains
    nothing but the embeddings, silently).

    Raises:
        ConfigError: the first such setting, named with its value.
    """
    for key in ("n_layer", "n_head", "n_embd", "n_positions", "n_inner"):
        value = getattr(cfg, key, None)
        if key == "n_inner" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {key} must be a whole number of at least 1, not {value!r}")
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"):
        value = getattr(cfg, key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ConfigError(f"{where}: {key} must be a probability in [0, 1), not {value!r}")


# Written by save_pretrained beside the architecture's own keys; not settings.
_BOOKKEEPING = ("architectures", "transformers_version", "model_type", "dtype", "torch_dtype")


def read_model_config(path: Path) -> dict[str, Any]:
    """The settings of a GPT-2 config JSON (``--model_config``), checked.

    Raises:
        ConfigError: not a file (missing, a directory, a named pipe), unreadable, not a JSON object, a key
            GPT2Config does not know, a value of the wrong type or a size a GPT-2 cannot have.
    """
    why = not_a_file(path)
    if why is not None:
        inside = Path(path) / "config.json"
        if inside.is_file():  # an exported model's directory, or a Hugging Face one
            why = f"{why}; its model config is --model_config {inside}"
        raise ConfigError(f"--model_config {path}: {why}")
    from transformers import GPT2Config

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--model_config {path}: cannot read it ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--model_config {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f'--model_config {path}: expected a JSON object such as {{"n_layer": 4}}')
    known = set(GPT2Config().to_dict()) | set(GPT2Config.attribute_map)
    unknown = sorted(k for k in data if k not in known and k not in _BOOKKEEPING)
    if unknown:
        valid = sorted(k for k in known if not k.startswith("_"))
        raise ConfigError(
            f"--model_config {path}: unknown key(s) {', '.join(unknown)}; GPT-2 configs have "
            f"{', '.join(valid)}"
        )
    settings = {k: v for k, v in data.items() if k not in _BOOKKEEPING}
    try:
        made = GPT2Config(**settings)
    except Exception as exc:  # huggingface_hub's validation of a value of the wrong type
        raise ConfigError(f"--model_config {path}: {first_line(exc)}") from None
    check_model_sizes(made, f"--model_config {path}")
    return settings


def build_model(cfg: Any) -> Any:
    """A freshly initialised ``GPT2LMHeadModel``."""
    from transformers import GPT2LMHeadModel

    return causal_lm_loss(GPT2LMHeadModel(cfg))


def checkpoint_activations(model: Any) -> Any:
    """``model`` recomputing each block's activations in backward instead of keeping them (non-reentrant
    checkpoints); under the name of the installed transformers (``gradient_checkpointing_enable`` is
    deprecated from 5.x's ``activation_checkpointing_enable`` on)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean token loss in nats, kept finite: a diverged run reads as a huge number."""
    return math.exp(min(loss, 700.0))


def bits_per_byte(nll: float, n_bytes: float) -> float | None:
    """Bits per byte of text: a split's summed token loss ``nll`` (nats) over the UTF-8 bytes its
    predicted tokens stand for. Unlike perplexity it compares models of different tokenizers: a larger
    vocabulary predicts fewer, longer tokens. None where the tokens stand for no bytes."""
    return nll / math.log(2) / n_bytes if n_bytes > 0 else None


def causal_lm_loss(model: Any) -> Any:
    """Name the loss transformers would pick anyway: left unset, it warns on every run."""
    model.loss_type = "ForCausalLM"
    return model


def param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices and embeddings; none on biases and layer norms.

    Tied weights appear once (``named_parameters`` deduplicates them).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2 or name.endswith(".bias") or ".ln_" in name or name.startswith("transformer.ln_f"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def count_parameters(model: Any) -> int:
    """The model's parameters, whole: ZeRO 3 leaves each rank an empty tensor and the whole size in
    ``ds_numel``."""
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())


def flops_per_token(cfg: Any, context: int) -> float:
    """Training FLOPs per token (forward and backward) of a GPT-2 config at ``context``.

    6 per parameter (a multiply-add forward, two backward) plus attention's
    ``12 · layers · context · width`` (PaLM, appendix B); recomputed activations are not counted,
    so MFU stays comparable with and without activation checkpointing.
    """
    width, layers = cfg.n_embd, cfg.n_layer
    per_layer = 12 * width * width + 13 * width  # attention and MLP matrices, their biases, two norms
    params = layers * per_layer + cfg.vocab_size * width + cfg.n_positions * width + 2 * width
    return 6.0 * params + 12.0 * layers * context * width


def to_device(t: Any, device: Any) -> Any:
    """A host tensor on ``device``; to a GPU through pinned memory, without waiting for the copy."""
    import torch

    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def batch_inputs(batch: Any, device: Any, doc_mask_eot: int | None = None) -> dict[str, Any]:
    """The forward's keyword arguments for a packed batch (no labels, no cache).

    ``doc_mask_eot``: no attention mask and positions that restart per document, so the model attends
    within documents only (padding, after the last end-of-text, is a document of its own): how a
    run with --doc_mask trains and is evaluated.

    A batch without padding (every packed block but a stream's last) gets no attention mask either:
    transformers then runs its causal attention as such (SDPA's ``is_causal``, flash kernels), where a
    mask of ones would be materialized as a (B, 1, T, T) bias under ``torch.compile``, which cannot look
    at its values, and attention would run the masked kernels (on a CPU: the unfused matmuls).
    """
    input_ids = to_device(batch.input_ids, device)
    inputs = {"input_ids": input_ids, "use_cache": False}
    if doc_mask_eot is not None:
        inputs["position_ids"] = doc_position_ids(input_ids, doc_mask_eot)
    elif not bool(batch.attention_mask.all()):
        inputs["attention_mask"] = to_device(batch.attention_mask, device)
    return inputs


def predicted_tokens(labels: Any) -> int:
    """How many tokens of ``labels`` (B, T) a next-token loss counts: position t predicts t + 1."""
    return int((labels[:, 1:] != IGNORE).sum())


def predicted_bytes(token_bytes: Any, labels: Any) -> Any:
    """The UTF-8 bytes that the tokens ``labels`` (B, T) predict stand for, those the loss counts: an
    int64 scalar on the device, one gather and a sum (read with the loss, no wait of its own).
    ``token_bytes`` (V,): each id's bytes (:func:`dsgpt2.tokenizer.token_bytes.token_bytes`)."""
    import torch

    targets = labels[:, 1:]  # position t predicts token t + 1
    return torch.where(targets != IGNORE, token_bytes[targets.clamp(min=0)], 0).sum()


def batch_nll(
    forward: Any, batch: Any, device: Any, doc_mask_eot: int | None = None, *, token_bytes: Any = None
) -> tuple[Any, int, Any]:
    """Summed next-token negative log-likelihood of ``batch`` (a float64 scalar on ``device``), how
    many tokens it covers, and the bytes they stand for (:func:`predicted_bytes`; None without
    ``token_bytes``): the one held-out measure of validation and ``dsgpt2 evaluate``.

    ``forward``: the model, or the engine wrapping it (ZeRO-3 gathers its weights in the engine's
    forward). Logits are upcast to float32 before the softmax, as training's loss does; a model with
    the chunked loss (:func:`dsgpt2.model.loss.with_chunked_loss`) takes it chunk by chunk.
    """
    import torch

    from dsgpt2.model.loss import chunked

    labels = to_device(batch.labels, device)
    n_bytes = None if token_bytes is None else predicted_bytes(token_bytes, labels)
    if chunked(forward):
        nll = forward(**batch_inputs(batch, device, doc_mask_eot), labels=labels, nll_sum=True).loss
        return nll.double(), predicted_tokens(batch.labels), n_bytes
    logits = forward(**batch_inputs(batch, device, doc_mask_eot)).logits  # (B, T, V)
    # Position t predicts token t + 1.
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    nll = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE, reduction="sum")
    return nll.double(), predicted_tokens(batch.labels), n_bytes


def span_nll(logits: Any, targets: Any) -> Any:
    """Summed negative log-likelihood of ``targets`` (T,) under ``logits`` (T, V), upcast to float32
    as :func:`batch_nll` does: a completion's loss (HellaSwag's endings)."""
    import torch

    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


def doc_position_ids(input_ids: Any, eot: int) -> Any:
    """Positions that restart after every ``eot``: ``(B, T)`` → ``(B, T)``.

    Given these and no attention mask, transformers' GPT-2 attends only within each run of
    positions (it derives the packed-sequence mask from where positions restart), so a token sees
    only its own document. A document's ``eot`` ends it and belongs to it.
    """
    import torch

    _, t = input_ids.shape
    idx = torch.arange(t, device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eot
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - last_start
