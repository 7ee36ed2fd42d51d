"""Whether a run's model can fit this machine at all, known from its shape before any of it is built.

A model too large for the memory it trains in used to be found by the allocator: after the process
group, the corpus checks and the feed had started, or at the first step, as an out-of-memory exit 1. Here
the bytes a run is sure to hold are counted from the config (parameters, position table included, and
the blocks' inputs at the micro-batch size) and compared with the machine's memory. Only lower bounds
are counted, so that a run refused here could never have trained: half-precision weights and
activations where a run might use them, optimizer state where it cannot be offloaded, no allocator
slack, no attention scores but eager attention's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsgpt2.errors import ConfigError

if TYPE_CHECKING:
    from dsgpt2.optim.ds_config import EngineConfig

GB = 1e9


@dataclass(frozen=True)
class Placement:
    """Where a run trains and how DeepSpeed spreads its states: the sequences a micro-batch, the device
    (``cuda`` or ``cpu``), the ranks, the ZeRO stage, whether ZeRO 3 keeps the weights on the host, the
    attention kernel."""

    micro_batch: int
    device: str = "cpu"
    world: int = 1
    stage: int = 0
    params_offloaded: bool = False
    attention: str = "sdpa"


@dataclass(frozen=True)
class Memory:
    """Bytes of this machine: the host's (RAM and swap) and one GPU's (None without one)."""

    host: int
    device: int | None = None


@dataclass(frozen=True)
class Need:
    """Bytes a run holds in one memory (``host`` or ``device``) at once, by part."""

    memory: str
    parts: list[tuple[str, float]]


def parameters(cfg: Any) -> dict[str, int]:
    """A GPT-2 config's parameters by part (embeddings tied: the LM head is the token table)."""
    d, inner = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd
    # Attention's qkv and projection (4d² + 4d), the MLP (2·d·inner + inner + d), two layer norms (4d).
    block = 4 * d * d + 2 * d * inner + inner + 9 * d
    return {
        "token table": cfg.vocab_size * d,
        "position table": cfg.n_positions * d,
        "blocks": cfg.n_layer * block + 2 * d,
    }


def least_needs(cfg: Any, context: int, where: Placement) -> list[Need]:
    """What a run of ``cfg`` at blocks of ``context`` tokens holds for certain: its float32
    weights, built whole on each rank's host before DeepSpeed places them; then, where it trains, the
    weights, gradients and optimizer state DeepSpeed cannot move elsewhere, and the activations backward
    needs."""
    p = sum(parameters(cfg).values())
    built = Need("host", [("its float32 weights, built whole on each rank", 4.0 * p)])
    # The input of every block is kept for backward, activation checkpointing or not; at least 2 bytes.
    micro_batch = where.micro_batch
    act = 2.0 * cfg.n_layer * micro_batch * context * cfg.n_embd
    if where.attention == "eager":  # one layer's attention probabilities, (micro, heads, T, T)
        act += 2.0 * micro_batch * cfg.n_head * context * context
    acts = (f"the blocks' activations at a micro-batch of {micro_batch} × {context} tokens", act)
    on_cpu = where.device == "cpu"
    # Weights and gradients in half precision at least: ZeRO 3 shards the weights (or moves them off a
    # GPU), ZeRO 2 the gradients (off a GPU too). The optimizer's state, a float32 master or moment per
    # weight at least, may be moved off a GPU; on a CPU it stays, sharded from ZeRO 1 on.
    weights = 2.0 * p / (where.world if where.stage == 3 else 1)
    grads = 2.0 * p / (where.world if where.stage >= 2 else 1)
    optim = 4.0 * p / (where.world if where.stage >= 1 else 1)
    if on_cpu:
        return [
            built,
            Need("host", [("its weights, gradients and optimizer state", weights + grads + optim), acts]),
        ]
    weights = 0.0 if where.params_offloaded else weights
    grads = 0.0 if where.stage >= 2 else grads
    return [built, Need("device", [("its weights and gradients", weights + grads), acts])]


def machine_memory(device: str) -> Memory:
    """This machine's memory: RAM and swap (what an allocation may take at most), and where the run
    trains on CUDA, its GPU's."""
    import psutil

    host = psutil.virtual_memory().total + psutil.swap_memory().total
    if device != "cuda":
        return Memory(host)
    import torch

    index = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
    return Memory(host, torch.cuda.get_device_properties(index).total_memory)


def placement(ds: EngineConfig, device: str, world: int, attention: str) -> Placement:
    """Where a run of DeepSpeed config ``ds`` trains (``device``, ``world`` ranks, ``attention``)."""
    zero = ds.config.get("zero_optimization") or {}
    offload = (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    return Placement(ds.micro_batch, device, world, int(zero.get("stage", 0)), offload, attention)


def check_fits(cfg: Any, context: int, where: Placement, memory: Memory | None = None) -> None:
    """Refuse a run whose model cannot fit this machine (``memory``; default: its own) however it
    trains.

    Raises:
        ConfigError: naming the estimate, the memory and the flag to lower.
    """
    memory = memory or machine_memory(where.device)
    for need in least_needs(cfg, context, where):
        has = memory.host if need.memory == "host" else memory.device
        total = sum(size for _, size in need.parts)
        if has is None or total <= has:
            continue
        said = "; ".join(f"{what}: {size / GB:,.1f} GB" for what, size in need.parts)
        held_in = "RAM and swap" if need.memory == "host" else "on its GPU"
        raise ConfigError(
            f"the model cannot fit this machine: its {sum(parameters(cfg).values()) / 1e6:,.1f}M parameters "
            f"need at least {total / GB:,.1f} GB ({said}) and this machine has {has / GB:,.1f} GB "
            f"({held_in}); {remedy(cfg, context, need.parts)}"
        )


def remedy(cfg: Any, context: int, shown: list[tuple[str, float]]) -> str:
    """The flag that lowers the largest part of what did not fit."""
    largest = max(shown, key=lambda part: part[1])[0]
    if largest.startswith("the blocks' activations"):
        return (
            "lower --context_length or the micro-batch (train_micro_batch_size_per_gpu in --deepspeed_config)"
        )
    weights = parameters(cfg)
    if max(weights, key=lambda k: weights[k]) == "position table":
        own = "--context_length" if cfg.n_positions <= context else "n_positions in --model_config"
        return f"lower {own} ({cfg.n_positions:,} positions × {cfg.n_embd} wide)"
    return "choose a smaller model (--model_select, or n_layer, n_embd, n_inner in --model_config)"
