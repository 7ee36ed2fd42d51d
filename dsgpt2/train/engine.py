"""The model and its DeepSpeed engine: a preset or ``--init_from`` weights, the weight-decay groups,
the learning-rate schedule, ``deepspeed.initialize``."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsgpt2.accelerator import prepare_deepspeed_environment, shm_op_path
from dsgpt2.collective import every_group_times_out_after, free_port
from dsgpt2.data.sources import DataSpec
from dsgpt2.errors import ConfigError, first_line
from dsgpt2.model.gpt2 import (
    PRESETS,
    build_model,
    checkpoint_activations,
    count_parameters,
    flops_per_token,
    gpt2_config,
    read_model_config,
)
from dsgpt2.model.loss import with_chunked_loss
from dsgpt2.optim.ds_config import EngineConfig, zero_stage
from dsgpt2.optim.optimizers import OPTIMIZERS
from dsgpt2.optim.schedule import ScheduledLR
from dsgpt2.train.config import ComputeOptions, ModelOptions, OptimizerOptions
from dsgpt2.train.metrics import peak_flops
from dsgpt2.train.microloop import gradients_in_params

log = logging.getLogger("dsgpt2.train.trainer")


def run_context(m: ModelOptions) -> int:
    """Tokens per block: --context_length, else the model config's n_positions, else the preset's."""
    if m.context_length:
        return m.context_length
    if m.model_config is not None:
        return int(read_model_config(m.model_config).get("n_positions", 1024))
    return PRESETS[m.model_select].context


def init_context(args: ModelOptions, config: Any) -> int:
    """Tokens per block of a run from --init_from: at most the model's positions."""
    context = args.context_length or config.n_positions
    if context > config.n_positions:
        raise ConfigError(
            f"--context_length {context} is longer than the {config.n_positions} positions of "
            f"--init_from {args.init_from}; use at most {config.n_positions}"
        )
    return int(context)


def init_weights(
    m: ModelOptions, vocab_size: int, vocab_dir: Path | None
) -> tuple[Any, dict[str, Any]] | None:
    """The config and weights of --init_from, checked against the tokenizer (``vocab_size`` tokens, of
    ``vocab_dir``); None without it."""
    if m.init_from is None:
        return None
    from dsgpt2.checkpoints.weights import load_weights

    config, weights, _, _ = load_weights(m.init_from)
    if config.vocab_size != vocab_size:
        raise ConfigError(
            f"--init_from {m.init_from} has a vocabulary of {config.vocab_size} tokens but "
            f"--vocab_dir {vocab_dir} has {vocab_size}; use the tokenizer the model "
            "was trained with (the default when --vocab_dir is left out)"
        )
    return config, weights


def model_config_for(
    m: ModelOptions, vocab_size: int, spec: DataSpec, init: tuple[Any, dict[str, Any]] | None
) -> Any:
    """The ``GPT2Config`` the run builds (a preset, ``--model_config`` or ``init``'s), known before any
    model is: a checkpoint of another shape is refused before the engine exists."""
    if init is not None:
        return init[0]
    return gpt2_config(
        m.model_select, vocab_size, spec.context, spec.eot, spec.pad, config_json=m.model_config
    )


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is built from: the model and compute options, and the run's seed (the initial
    weights)."""

    model: ModelOptions
    compute: ComputeOptions
    seed: int
    optim: OptimizerOptions = field(default_factory=OptimizerOptions)


@dataclass
class Engine:
    """The DeepSpeed engine and what the run reads off it."""

    engine: Any
    model_config: Any  # GPT2Config
    micro_batch: int
    grad_accum: int
    flops_per_token: float
    peak_flops: float | None
    clip: float = 0.0  # the DeepSpeed config's gradient clipping, taken by the trainer (see trainer_clips)


def build_engine(
    settings: EngineSettings,
    ds: EngineConfig,
    spec: DataSpec,
    vocab_size: int,
    *,
    init: tuple[Any, dict[str, Any]] | None,
    device: str,
    world: int,
) -> Engine:
    """The model (a preset, ``--model_config`` or ``init``'s weights) under DeepSpeed, seeded from the
    run's seed, trained by the run's optimizer under ``ds`` (its schedule dsgpt2's, or where None the
    DeepSpeed config's scheduler)."""
    prepare_deepspeed_environment()
    import deepspeed

    m = settings.model
    _seed_all(settings.seed)
    c = settings.compute
    context = spec.context
    model_config = model_config_for(m, vocab_size, spec, init)
    model_config._attn_implementation = c.attn_implementation
    if init is None:
        model = build_model(model_config)
    else:
        from dsgpt2.checkpoints.weights import build_with_weights

        model = build_with_weights(init[0], init[1], str(m.init_from))
        log.info("initialised from %s", m.init_from)
    # ZeRO 3 gathers the head's weight around its own forward, which the loss never calls: there
    # the loss stays eager, outside the graph.
    compiled = compiles(c.compile, device)
    compile_stance(compiled)
    model = with_chunked_loss(model, c.loss_chunk, compiled=compiled and zero_stage(ds.config) != 3)
    if c.activation_checkpointing:
        checkpoint_activations(model)
    scheduler = None
    if (lr_schedule := ds.schedule) is not None:
        scheduler = lambda optimizer: ScheduledLR(optimizer, lr_schedule)  # noqa: E731
    optimizer = settings.optim.chosen()
    given = optimizer.build(model, ds)
    with _quiet_scheduler_start(), _config_refusals():
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds.config, lr_scheduler=scheduler, **given)
    clip = trainer_clips(engine) if optimizer.trainer_clips else 0.0
    if clip:
        # At ZeRO 0 DeepSpeed reads its clipping at every step: the trainer's takes its place. (The
        # config as the run records it keeps the value.)
        engine._config.gradient_clipping = 0.0
    if world == 1 and zero_stage(ds.config) == 0:
        # One rank has nothing to all-reduce: DeepSpeed would still flatten every gradient into a buffer
        # and copy it back, parameter by parameter, at each step.
        engine.enable_backward_allreduce = False
    if compiled:
        # In place (nn.Module.compile): parameter names and checkpoints stay as they were.
        engine.compile()
    built = Engine(
        engine,
        model_config,
        ds.micro_batch,
        ds.grad_accum,
        flops_per_token(model_config, context),
        peak_flops(c.peak_tflops, device, ds.config),
        clip,
    )
    log.info(
        "model %s: %.1fM parameters, context %d, vocab %d; %d rank(s), micro-batch %d × accumulation %d, "
        "ZeRO stage %d, %s",
        m.init_from or m.model_config or m.model_select,
        count_parameters(model) / 1e6,
        context,
        vocab_size,
        world,
        built.micro_batch,
        built.grad_accum,
        zero_stage(ds.config),
        device,
    )
    return built


def compiles(option: bool | None, device: str) -> bool:
    """Whether the run compiles its model: ``--compile``/``--no_compile`` where given, else where CUDA is
    the device (compiled is the fast path there, 1.3x eager at 112m; on a CPU compiling a short run costs
    more than it saves)."""
    return option if option is not None else device == "cuda"


def compile_stance(compiled: bool) -> None:
    """What DeepSpeed compiles for itself (Muon's Newton–Schulz iteration, ``torch.compile``-decorated at
    import) follows the run: without --compile it runs eagerly. On a CPU the eager iteration is within 5 %
    of the compiled one at 112m's shapes, where compiling costs 7–9 s a shape before the first step."""
    torch.compiler.set_stance("default" if compiled else "force_eager")


def trainer_clips(engine: Any) -> float:
    """The gradient clipping the trainer takes over from DeepSpeed's ``engine`` (0.0: none, or
    DeepSpeed's own).

    At ZeRO 0 without DeepSpeed's fp16/bf16 optimizers the gradients are the parameters' own, and
    DeepSpeed clips them parameter by parameter (a norm, a cast and a multiply each: ~600 dispatches a
    step at 148 tensors); ``torch.nn.utils.clip_grad_norm_`` does the same arithmetic (the global 2-norm,
    ``max_norm / (norm + 1e-6)`` capped at 1) in a few multi-tensor ops, and its norm is the step's
    ``grad_norm``. (Muon runs without clipping: its ``trainer_clips`` is off.) fp16 autocast's gradients
    are scaled until its scaler unscales them, in DeepSpeed's step, which clips them there."""
    if not gradients_in_params(engine):
        return 0.0
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        return 0.0
    return float(engine.gradient_clipping() or 0.0)


@contextlib.contextmanager
def _config_refusals() -> Iterator[None]:
    """The DeepSpeed config's optimizer or scheduler refusing its ``params`` (an unknown key, a value
    out of range): one line naming the section, not DeepSpeed's traceback. Anything else is raised."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = " ".join(f"{f.filename}:{f.name}" for f in frames)
        section = "scheduler" if "lr_schedules.py" in where or "_scheduler_from_config" in where else None
        if section is None and "_configure_basic_optimizer" in where:
            section = "optimizer"
        keyword = isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc)
        if section is None or not (keyword or isinstance(exc, ValueError)):
            raise
        raise ConfigError(
            f"--deepspeed_config: its {section} refused its params ({first_line(exc)}); see DeepSpeed's "
            f"documentation of the {section} type, or leave the section's params to dsgpt2's flags"
        ) from None


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _SchedulerStartFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "scheduler before it has started" not in record.getMessage()


@contextlib.contextmanager
def _quiet_scheduler_start() -> Iterator[None]:
    """DeepSpeed's WarmupLR and WarmupDecayLR ask themselves for a rate in their own constructor, and
    warn every user of such a config that the schedule "has not started": that one line is dropped."""
    prepare_deepspeed_environment()
    from deepspeed.utils import logger as ds_logger

    quiet = _SchedulerStartFilter()
    ds_logger.addFilter(quiet)
    try:
        yield
    finally:
        ds_logger.removeFilter(quiet)


def build_cpu_ops() -> str | None:
    """Compile DeepSpeed's CPU communication op now (as ``make`` does at the install and the image at its
    build), rather than inside the first run that needs it; the op's path, or None where the device is
    not the CPU (nothing to build)."""
    prepare_deepspeed_environment()
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return None
    get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    return shm_op_path()


def announce_compiles(cfg: Any, device: str, step: int) -> None:
    """A line before a first step that compiles (tens of seconds on a CPU, with nothing else on screen)."""
    what = first_step_compiles(cfg.optim.optimizer, compiles(cfg.compute.compile, device))
    if what and step < cfg.run.train_iters:
        log.info("the first step compiles %s: it takes longer than the others (tens of seconds on a CPU, "
                 "less once torch has cached the compiled code)", what)  # fmt: skip


def first_step_compiles(optimizer: str | None, compiled: bool) -> str | None:
    """What torch compiles on a run's first step (None: nothing): the model with --compile, and what the
    optimizer's step compiles with it (under Muon the Newton–Schulz iteration DeepSpeed compiles for its
    matrices; without --compile that runs eagerly)."""
    own = OPTIMIZERS[optimizer].compiles if optimizer and compiled else None
    what = ["the model (--compile)"] * compiled + [own] * bool(own)
    return " and ".join(what) or None


def start_process_group(backend: str, seconds: int, own_port: bool) -> None:
    """DeepSpeed's process group, it and every group made after it timing out after ``seconds``. Where
    this process chose its MASTER_PORT itself (``own_port``: one process, no launcher), a port another
    process took in the meantime is chosen again rather than failing the run."""
    from datetime import timedelta

    import deepspeed

    every_group_times_out_after(seconds)
    for attempt in range(3):
        try:
            deepspeed.init_distributed(
                dist_backend=backend, verbose=False, timeout=timedelta(seconds=seconds)
            )
            return
        except RuntimeError as exc:  # torch's DistNetworkError
            if not own_port or "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
            os.environ["MASTER_PORT"] = str(free_port())
