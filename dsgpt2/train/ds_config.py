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
from dsgpt2.train.schedule import Schedule

log = logging.getLogger(__name__)
FLAG = "--deepspeed_config"


def read_ds_config(path: str | Path) -> dict[str, Any]:
    """A DeepSpeed config as its file holds it.

    Raises:
        ConfigError: missing or malformed file.
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
    return cfg


def load_ds_config(
    path: str | Path, world_size: int, train_iters: int, device: str, own_schedule: bool = False
) -> dict[str, Any]:
    """Read, check and complete a DeepSpeed config.

    Returns the config with ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps`` and ``train_batch_size`` all set, and a
    ``WarmupDecayLR`` schedule stretched to ``train_iters`` (left as it is with ``own_schedule``:
    :func:`apply_schedule` replaces it).

    Raises:
        ConfigError: missing or malformed file, inconsistent batch sizes, or a precision
            this device cannot run.
    """
    p = Path(path)
    cfg = read_ds_config(p)
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
    # "bfloat16": DeepSpeed's former name of the section, which it still reads.
    bf16 = any(cfg.get(k, {}).get("enabled") for k in ("bf16", "bfloat16"))
    if fp16 and bf16:
        raise ConfigError(f"{FLAG} {p}: fp16 and bf16 are both enabled; enable one")
    autocast = autocast_precision(cfg)
    if autocast is not None and (fp16 or bf16):
        raise ConfigError(
            f"{FLAG} {p}: torch_autocast and {'fp16' if fp16 else 'bf16'} are both enabled; enable one"
        )
    lower = "fp16" if fp16 else "bf16" if bf16 else autocast
    if device == "cpu" and lower is not None:
        raise ConfigError(
            f"{FLAG} {p}: {lower} needs a GPU and none is visible; "
            "use configs/ds_config_cpu.json (fp32) on a CPU"
        )
    sched = cfg.get("scheduler")
    if isinstance(sched, dict) and sched.get("type") == "WarmupDecayLR" and not own_schedule:
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


AUTOCAST_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}


def autocast_precision(cfg: dict[str, Any]) -> str | None:
    """``bf16`` or ``fp16`` where the config's ``torch_autocast`` section is enabled (fp32 weights and
    gradients, the matmuls in the lower precision); None without it."""
    section = cfg.get("torch_autocast") or {}
    if not section.get("enabled"):
        return None
    if "dtype" not in section:
        # DeepSpeed would leave it to torch.autocast (float16 on CUDA) without a loss scaler.
        raise ConfigError(f'{FLAG}: torch_autocast needs a "dtype": "bfloat16" (or "float16")')
    dtype = str(section["dtype"]).removeprefix("torch.")
    if dtype not in AUTOCAST_DTYPES:
        raise ConfigError(
            f"{FLAG}: torch_autocast dtype {dtype!r} is not a lower precision; use bfloat16 or float16"
        )
    return AUTOCAST_DTYPES[dtype]


def precision(cfg: dict[str, Any]) -> str:
    """``bf16``, ``fp16`` or ``fp32``: what the config's matmuls run in (DeepSpeed's fp16/bf16 or
    torch autocast)."""
    for name, section in (("bf16", "bf16"), ("bf16", "bfloat16"), ("fp16", "fp16")):
        if cfg.get(section, {}).get("enabled"):
            return name
    return autocast_precision(cfg) or "fp32"


def apply_schedule(cfg: dict[str, Any], opts: Any, train_iters: int) -> Schedule | None:
    """Put a :class:`~dsgpt2.train.schedule.ScheduleOptions`' choice into ``cfg`` (in place).

    Returns the schedule dsgpt2 drives, or None where the config's own scheduler stays
    (``--lr_schedule deepspeed``; ``--lr`` then sets its peak).

    Raises:
        ConfigError: a schedule but no optimizer learning rate to take the peak from.
    """
    params = cfg.setdefault("optimizer", {}).setdefault("params", {})
    if opts.lr is not None:
        params["lr"] = opts.lr
    sched = cfg.get("scheduler")
    sched_params = sched.get("params", {}) if isinstance(sched, dict) else {}
    if opts.lr_schedule == "deepspeed":
        if opts.lr is not None and "warmup_max_lr" in sched_params:
            sched_params["warmup_max_lr"] = opts.lr
        return None
    peak = params.get("lr")
    if not isinstance(peak, int | float) or isinstance(peak, bool):
        raise ConfigError(
            f"--lr_schedule {opts.lr_schedule}: set --lr (the DeepSpeed config's optimizer has no lr)"
        )
    warmup = opts.warmup_iters
    if warmup is None:
        warmup = sched_params.get("warmup_num_steps", train_iters // 50)
        warmup = min(int(warmup), max(0, train_iters // 10))
    cfg.pop("scheduler", None)
    kind = opts.lr_schedule
    return Schedule(kind, float(peak), train_iters, warmup, opts.min_lr_ratio, opts.decay_fraction)


def schedule_note(scheduler: Any, schedule: Schedule | None) -> str | None:
    """The line that says a DeepSpeed config's ``scheduler`` (its block, read before
    :func:`apply_schedule` removed it) gave way to ``schedule``; None where nothing was replaced."""
    if schedule is None or not isinstance(scheduler, dict):
        return None
    return (
        f"learning rate: --lr_schedule {schedule.kind} (peak {schedule.peak:g}, {schedule.warmup} warm-up "
        f"steps) in place of the DeepSpeed config's scheduler ({scheduler.get('type', 'unnamed')})"
    )


def check_attention(kind: str, device: str, cfg: dict[str, Any] | None = None) -> None:
    """Refuse an attention implementation this machine or precision cannot run.

    Raises:
        ConfigError: flash_attention_2 without a GPU, the flash-attn package, or half precision.
    """
    if kind != "flash_attention_2":
        return
    import importlib.util

    if device != "cuda":
        raise ConfigError("--attn_implementation flash_attention_2 needs a GPU; use sdpa (the default)")
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "--attn_implementation flash_attention_2: the flash-attn package is not installed "
            "(pip install flash-attn --no-build-isolation), or use sdpa (the default)"
        )
    if cfg is not None and precision(cfg) == "fp32":
        raise ConfigError(
            f"--attn_implementation flash_attention_2 runs in bf16 or fp16; {FLAG} trains in fp32: "
            "use configs/ds_config.json (bf16) or sdpa"
        )
