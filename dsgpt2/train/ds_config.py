"""DeepSpeed's JSON config: loaded as DeepSpeed's schema, checked only where dsgpt2 depends on it.

The checks are the batch-size arithmetic (micro × accumulation × world =
global), the precision the device can run, and the scheduler's length.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dsgpt2.errors import ConfigError

log = logging.getLogger(__name__)
FLAG = "--deepspeed_config"


def load_ds_config(path: str | Path, world_size: int, train_iters: int, device: str) -> dict[str, Any]:
    """Read, check and complete a DeepSpeed config.

    Returns the config with ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps`` and ``train_batch_size`` all set, and a
    ``WarmupDecayLR`` schedule stretched to ``train_iters``.

    Raises:
        ConfigError: missing or malformed file, inconsistent batch sizes, or a precision
            this device cannot run.
    """
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{FLAG} {p}: file not found; the shipped ones are configs/ds_config*.json"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{FLAG} {p}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{FLAG} {p}: expected a JSON object")
    micro = cfg.get("train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps")
    total = cfg.get("train_batch_size")
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", gas),
                       ("train_batch_size", total)):  # fmt: skip
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ConfigError(f"{FLAG} {p}: {key} must be a positive integer; got {value!r}")
    if micro is None and total is None:
        raise ConfigError(f"{FLAG} {p}: set train_micro_batch_size_per_gpu (or train_batch_size)")
    gas = gas or 1
    if micro is None:
        if total % (gas * world_size):
            raise ConfigError(
                f"{FLAG} {p}: train_batch_size {total} is not divisible by gradient_accumulation_steps "
                f"{gas} × world size {world_size}; change one of them"
            )
        micro = total // (gas * world_size)
    if total is not None and total != micro * gas * world_size:
        raise ConfigError(
            f"{FLAG} {p}: train_batch_size {total} ≠ train_micro_batch_size_per_gpu {micro} × "
            f"gradient_accumulation_steps {gas} × world size {world_size} = {micro * gas * world_size}; "
            "fix one of them, or drop train_batch_size and let it follow"
        )
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = gas
    cfg["train_batch_size"] = micro * gas * world_size

    fp16 = bool(cfg.get("fp16", {}).get("enabled"))
    bf16 = bool(cfg.get("bf16", {}).get("enabled"))
    if fp16 and bf16:
        raise ConfigError(f"{FLAG} {p}: fp16 and bf16 are both enabled; enable one")
    if device == "cpu" and (fp16 or bf16):
        raise ConfigError(
            f"{FLAG} {p}: {'fp16' if fp16 else 'bf16'} needs a GPU and none is visible; "
            "use configs/ds_config_cpu.json (fp32) on a CPU"
        )
    sched = cfg.get("scheduler")
    if isinstance(sched, dict) and sched.get("type") == "WarmupDecayLR":
        params = sched.setdefault("params", {})
        if params.get("total_num_steps") != train_iters:
            log.info("scheduler: WarmupDecayLR total_num_steps set to --train_iters %d", train_iters)
            params["total_num_steps"] = train_iters
        if params.get("warmup_num_steps", 0) > train_iters:
            params["warmup_num_steps"] = max(1, train_iters // 10)
    return cfg


def optimizer_weight_decay(cfg: dict[str, Any]) -> float:
    """The weight decay the config's optimizer asks for (0 when none)."""
    return float(cfg.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0))


def zero_stage(cfg: dict[str, Any]) -> int:
    return int(cfg.get("zero_optimization", {}).get("stage", 0))
