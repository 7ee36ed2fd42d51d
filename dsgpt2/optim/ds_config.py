"""DeepSpeed's JSON config: loaded as DeepSpeed's schema, checked only where dsgpt2 depends on it, and
built once into what the engine is given (:func:`build_ds_config`).

The checks are the batch-size arithmetic (micro × accumulation × world =
global), the precision the device can run, the values of the sections DeepSpeed reads once the model is
built (ZeRO stage, clipping, the optimizer's type and settings, the scheduler's type: refused as the file
is read, not in a traceback after the build), and the scheduler's length. The learning rate has one
source: ``--lr``, else the file's ``optimizer.params.lr``; the schedule is dsgpt2's (:class:`Schedule`)
or the file's scheduler, and the optimizer of the run (:mod:`dsgpt2.optim.optimizers`) says what else it
needs of the config.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dsgpt2.errors import ConfigError
from dsgpt2.files import not_a_file
from dsgpt2.optim.schedule import Schedule

log = logging.getLogger(__name__)
FLAG = "--deepspeed_config"


def read_ds_config(path: str | Path) -> dict[str, Any]:
    """A DeepSpeed config as its file holds it.

    Raises:
        ConfigError: missing or malformed file.
    """
    p = Path(path)
    why = not_a_file(p) if p.exists() else None  # a named pipe would wait for a writer
    if why is not None:
        raise ConfigError(f"{FLAG} {p}: {why}")
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        from dsgpt2.settings.shipped import shipped_names

        shipped = ", ".join(n for n in shipped_names() if n.startswith("ds_"))
        raise ConfigError(
            f"{FLAG} {p}: file not found; the shipped ones (by name, from anywhere): {shipped}"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{FLAG} {p}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{FLAG} {p}: not a JSON file (its bytes are not UTF-8 text)") from None
    except OSError as exc:
        raise ConfigError(f"{FLAG} {p}: cannot read it ({exc.strerror})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{FLAG} {p}: expected a JSON object")
    check_sections(cfg, p)
    return cfg


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_sections(cfg: dict[str, Any], p: Path) -> None:
    """Refuse, in one line, the values of the sections DeepSpeed and dsgpt2 read (ZeRO, clipping, the
    optimizer's type and settings, the scheduler's type) that would end the run in a traceback once
    its model is built, or train it in ways nobody asked for.

    Raises:
        ConfigError: the first such value, named with the fix.
    """
    for section in ("zero_optimization", "optimizer", "scheduler"):
        if section in cfg and not isinstance(cfg[section], dict):
            raise ConfigError(f'{FLAG} {p}: "{section}" must be a JSON object, not {cfg[section]!r}')
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"{FLAG} {p}: zero_optimization.stage must be 0, 1, 2 or 3, not {stage!r}")
    clip = cfg.get("gradient_clipping", 0.0)
    if not _number(clip) or clip < 0:
        raise ConfigError(f"{FLAG} {p}: gradient_clipping must be a number ≥ 0 (0: none), not {clip!r}")
    block = cfg.get("optimizer") or {}
    kind = block.get("type")
    if "type" in block and (not isinstance(kind, str) or not _known_optimizer(kind)):
        raise ConfigError(
            f"{FLAG} {p}: optimizer type {kind!r} is not one DeepSpeed has; use AdamW (or leave the "
            "optimizer section out and train with --optimizer muon)"
        )
    params = block.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{FLAG} {p}: optimizer.params must be a JSON object, not {params!r}")
    for key in ("lr", "eps", "weight_decay"):
        if key in params and (not _number(params[key]) or params[key] < 0):
            raise ConfigError(f"{FLAG} {p}: optimizer.params.{key} must be a number ≥ 0, not {params[key]!r}")
    betas = params.get("betas", [0.9, 0.999])
    if not (isinstance(betas, list) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"{FLAG} {p}: optimizer.params.betas must be two numbers in [0, 1), not {betas!r}")
    scheduler = (cfg.get("scheduler") or {}).get("type")
    if "scheduler" in cfg and scheduler not in (schedulers := _deepspeed_schedulers()):
        raise ConfigError(
            f"{FLAG} {p}: scheduler type {scheduler!r} is not one DeepSpeed has: use one of "
            f"{', '.join(schedulers)}, or leave the scheduler out and choose a schedule with --lr_schedule"
        )


def _known_optimizer(kind: str) -> bool:
    """DeepSpeed's test: one of its own optimizers, or one of torch.optim by name."""
    from dsgpt2.accelerator import prepare_deepspeed_environment

    prepare_deepspeed_environment()
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return kind.lower() in DEEPSPEED_OPTIMIZERS or getattr(torch.optim, kind, None) is not None


def _deepspeed_schedulers() -> list[str]:
    from dsgpt2.accelerator import prepare_deepspeed_environment

    prepare_deepspeed_environment()
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    return list(VALID_LR_SCHEDULES)


@dataclass(frozen=True)
class EngineConfig:
    """What a run's engine is built from, made once from the DeepSpeed config file and the run's options.

    Attributes:
        config: the DeepSpeed config ``deepspeed.initialize`` is given (and the run records): batch sizes
            all set, the learning rate the run's, the scheduler the file's (stretched to the run) or
            none where dsgpt2 drives the schedule, and what the optimizer asks of it.
        optimizer_params: the file's optimizer settings (AdamW's betas, eps, decay), ``lr`` the run's.
        schedule: the schedule dsgpt2 drives; None where the file's scheduler does.
        notes: lines for the log about what the options replaced in the file.
    """

    config: dict[str, Any]
    optimizer_params: dict[str, Any]
    schedule: Schedule | None
    notes: tuple[str, ...] = ()

    @property
    def micro_batch(self) -> int:
        return int(self.config["train_micro_batch_size_per_gpu"])

    @property
    def grad_accum(self) -> int:
        return int(self.config["gradient_accumulation_steps"])

    def resuming(self, universal: bool) -> EngineConfig:
        """The config an engine resuming from a checkpoint is built with: told to read DeepSpeed's
        universal form where the checkpoint is one (see :mod:`dsgpt2.checkpoints.universal`)."""
        if not universal:
            return self
        checkpoint = {**self.config.get("checkpoint", {}), "load_universal": True}
        return replace(self, config={**self.config, "checkpoint": checkpoint})


def build_ds_config(
    path: str | Path,
    world_size: int,
    train_iters: int,
    device: str,
    *,
    schedule: Any = None,
    optimizer: Any = None,
) -> EngineConfig:
    """The DeepSpeed config file at ``path`` checked and built into what the engine is given.

    Args:
        schedule: the run's ``ScheduleOptions`` (None: the file's scheduler).
        optimizer: the run's :class:`~dsgpt2.optim.optimizer.RunOptimizer` (None: the file as it is).

    Raises:
        ConfigError: missing or malformed file, inconsistent batch sizes, a precision this device cannot
            run, or a schedule of dsgpt2's with no learning rate to take its peak from.
    """
    p = Path(path)
    file = read_ds_config(p)
    micro, gas = batch_sizes(file, p, world_size)
    check_precision(file, p, device)
    config = {**file, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
              "train_batch_size": micro * gas * world_size}  # fmt: skip
    lr = getattr(schedule, "lr", None)
    block = file.get("optimizer")
    params = dict((block or {}).get("params") or {})
    if lr is not None:
        params["lr"] = lr
        config["optimizer"] = {**(block or {}), "params": params}
    kind = getattr(schedule, "lr_schedule", None) or "deepspeed"
    own = None if kind == "deepspeed" else own_schedule(file, schedule, train_iters, params.get("lr"))
    notes = []
    if own is not None:
        config.pop("scheduler", None)
        if note := schedule_note(file.get("scheduler"), own):
            notes.append(note)
    elif isinstance(file.get("scheduler"), dict):
        config["scheduler"] = deepspeed_scheduler(file["scheduler"], train_iters, lr)
    if optimizer is not None:
        config = optimizer.engine_config(config)
        if (clip := file.get("gradient_clipping")) and not config.get("gradient_clipping"):
            name = type(optimizer).__name__
            notes.append(f"{name}: gradient clipping ({clip} in the DeepSpeed config) is off")
    return EngineConfig(config, params, own, tuple(notes))


def batch_sizes(cfg: dict[str, Any], p: Path, world_size: int) -> tuple[int, int]:
    """The micro-batch and the accumulation steps of ``cfg`` (read from ``p``) on ``world_size`` ranks.

    Raises:
        ConfigError: a size that is not a positive integer, or sizes that disagree.
    """
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
    return micro, gas


def check_precision(cfg: dict[str, Any], p: Path, device: str) -> None:
    """Refuse precisions that exclude each other, or that this device cannot run.

    Raises:
        ConfigError: fp16 with bf16, torch_autocast with either, or a lower precision on a CPU.
    """
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


def deepspeed_scheduler(block: dict[str, Any], train_iters: int, lr: float | None) -> dict[str, Any]:
    """The file's scheduler as the run drives it: a ``WarmupDecayLR`` stretched to ``train_iters`` (its
    warm-up cut to a tenth where longer than the run), its peak ``--lr`` where given."""
    params = dict(block.get("params") or {})
    if block.get("type") == "WarmupDecayLR":
        if params.get("total_num_steps") != train_iters:
            log.info("scheduler: WarmupDecayLR total_num_steps set to --train_iters %d", train_iters)
            params["total_num_steps"] = train_iters
        if params.get("warmup_num_steps", 0) > train_iters:
            params["warmup_num_steps"] = max(1, train_iters // 10)
    if lr is not None and "warmup_max_lr" in params:
        params["warmup_max_lr"] = lr
    return {**block, "params": params} if "params" in block or params else block


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


def own_schedule(cfg: dict[str, Any], opts: Any, train_iters: int, peak: Any) -> Schedule:
    """The schedule dsgpt2 drives for ``opts`` (a ``ScheduleOptions`` of
    cosine or wsd) peaking at ``peak`` (the run's learning rate), its warm-up the option's, else the file
    scheduler's (at most a tenth of the run), else 2 % of the run.

    Raises:
        ConfigError: no learning rate to peak at.
    """
    if not isinstance(peak, int | float) or isinstance(peak, bool):
        raise ConfigError(
            f"--lr_schedule {opts.lr_schedule}: set --lr (the DeepSpeed config's optimizer has no lr)"
        )
    warmup = opts.warmup_iters
    if warmup is None:
        sched = cfg.get("scheduler")
        warmup = (sched.get("params") or {} if isinstance(sched, dict) else {}).get(
            "warmup_num_steps", train_iters // 50
        )
        warmup = min(int(warmup), max(0, train_iters // 10))
    return Schedule(
        opts.lr_schedule, float(peak), train_iters, warmup, opts.min_lr_ratio, opts.decay_fraction
    )


def schedule_note(scheduler: Any, schedule: Schedule | None) -> str | None:
    """The line that says a DeepSpeed config's ``scheduler`` (its block in the file) gave way to
    ``schedule``; None where nothing was replaced."""
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
