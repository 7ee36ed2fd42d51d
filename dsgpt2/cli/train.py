"""The training-side commands: tokenize (the token cache), plan (memory per ZeRO stage), lineage
(which steps of a run trained on a document)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from dsgpt2.cli.common import Command, Flags, config_option, no_progress_option, verbose_option
from dsgpt2.errors import CorpusError
from dsgpt2.files import check_writable_dir
from dsgpt2.settings.options import (
    MISSING,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    Checked,
    from_namespace,
    option,
)
from dsgpt2.train.config import ComputeOptions, DataOptions, ModelOptions

log = logging.getLogger("dsgpt2")
# The training run's own data flags, so that a token cache matches the run that reads it.
CACHE_DATA = ("config_train", "vocab_dir", "tr_ratio", "seed", "chunk_docs", "read_order", "cache_dir",
              "num_workers")  # fmt: skip
CACHE_MODEL = ("model_select", "context_length", "task", "reply_speakers")


@dataclass(frozen=True, kw_only=True)
class TokenizeSettings:
    """``dsgpt2 tokenize``, besides the run's data and model flags (:data:`CACHE_DATA`,
    :data:`CACHE_MODEL`)."""

    force: bool = option(False, "rebuild even if the cache is up to date")
    overwrite: bool = option(
        False, "replace a token cache of other data (another tokenizer, corpus or settings) at --cache_dir"
    )
    no_progress: bool = no_progress_option()
    verbose: bool = verbose_option()


@dataclass(frozen=True, kw_only=True)
class PlanSettings(Checked):
    """``dsgpt2 plan``: the machines and the batch, besides the model's and the trainer's flags
    (--model_select, --context_length, --activation_checkpointing, --loss_chunk)."""

    vocab_size: int = option(50257, "vocabulary size", check=POSITIVE_INT)
    num_gpus: int = option(1, "GPUs per node", check=POSITIVE_INT)
    num_nodes: int = option(1, "nodes", check=POSITIVE_INT)
    micro_batch: int | None = option(None, "add activations: N sequences a micro-batch", check=POSITIVE_INT)
    gpu_memory: float = option(80.0, "GB per GPU", check=POSITIVE_NUMBER)
    verbose: bool = verbose_option()


@dataclass(frozen=True, kw_only=True)
class LineageSettings:
    """``dsgpt2 lineage``: the run, the documents, and where the run's inputs are now."""

    ckpt_dir: Path = option(help="the run's checkpoint directory, or its gridfs:RUN in the database")
    doc: tuple[str, ...] = option(help="a document (repeatable)", repeat=True, metavar="COLLECTION:IDX")
    ckpt_id: str | None = option(None, "replay up to this checkpoint (default: the one `latest` names)")
    config: str | None = config_option(
        "connection config (default: the run's --config_train)", required=False
    )
    vocab_dir: Path | None = option(None, "the run's tokenizer (default: the one it recorded)")
    json: bool = option(False, "print JSON")
    verbose: bool = verbose_option()


def cmd_lineage(args: argparse.Namespace) -> int:
    import json

    from dsgpt2.checkpoints.copies import readable
    from dsgpt2.checkpoints.lineage import lineage, lineage_lines
    from dsgpt2.db.config import load_config

    s = from_namespace(LineageSettings, args)
    mongo = load_config(s.config) if s.config else None
    ckpt_dir = readable(s.ckpt_dir, s.ckpt_id, s.config, "--ckpt_dir")
    result = lineage(ckpt_dir, list(s.doc), mongo, s.ckpt_id, s.vocab_dir)
    result.ckpt_dir = str(s.ckpt_dir)  # a stored run by its location, not this machine's copy
    print(json.dumps(result.to_dict(), indent=1) if s.json else "\n".join(lineage_lines(result)))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from dsgpt2.data.cache import prepare_cache
    from dsgpt2.db.client import connect, require_collections
    from dsgpt2.db.config import load_config
    from dsgpt2.train.config import data_spec
    from dsgpt2.train.engine import run_context

    data = from_namespace(DataOptions, args)
    data.check_files()
    if data.cache_dir is not None and not (data.cache_dir / "cache.json").is_file():
        check_writable_dir(data.cache_dir, "--cache_dir")  # before any query
    model, settings = from_namespace(ModelOptions, args), from_namespace(TokenizeSettings, args)
    context = run_context(model)
    spec = data_spec(data, model, context)
    config = load_config(data.config_train)
    # An absent collection reads as an empty one: a cache of nothing, "already up to date".
    require_collections(connect(config))
    meta, added = prepare_cache(
        config,
        data.vocab_dir,
        spec,
        data.cache_dir,
        data.num_workers,
        force=settings.force,
        progress=not settings.no_progress,
        overwrite=settings.overwrite,
    )
    state = f"{added} chunk(s) tokenized, {meta['chunks']} in all" if added else "already up to date"
    tokens = meta["tokens"]
    print(f"{data.cache_dir}: {state}; tokens: {tokens['train']} train, {tokens['val']} validation")
    if not tokens.get("train"):  # a run would find nothing to train on: said now, not at its first step
        task = " (--task conversation on documents without turns?)" if model.task == "conversation" else ""
        raise CorpusError(
            f"{data.cache_dir}: no training tokens: the split is empty (too few documents, or --tr_ratio "
            f"leaves none for training){task}"
        )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dsgpt2.model.gpt2 import PRESETS
    from dsgpt2.train.plan import plan, plan_lines

    s, model = from_namespace(PlanSettings, args), from_namespace(ModelOptions, args)
    compute = from_namespace(ComputeOptions, args)
    preset = model.model_select
    total, rows = plan(preset, s.vocab_size, s.num_gpus, s.num_nodes)
    act, shape = None, (0, 0)
    if s.micro_batch:
        from dsgpt2.train.plan import activations

        shape = (s.micro_batch, model.context_length or PRESETS[preset].context)
        act = activations(preset, s.vocab_size, shape[1], shape[0], compute.activation_checkpointing,
                          loss_chunk=compute.loss_chunk)  # fmt: skip
    where = (s.num_gpus, s.num_nodes)
    print("\n".join(plan_lines(preset, total, rows, *where, act=act, shape=shape, gpu_memory=s.gpu_memory)))
    return 0


PLAN = Command(
    "plan",
    help="estimate GPU and CPU memory per ZeRO stage for a model preset",
    description="Estimate the memory the model states of a preset need under each ZeRO stage and offload "
    "choice (DeepSpeed's estimators), to pick a DeepSpeed config before training. "
    "Activations come on top.",
    # The model's and the trainer's own flags among the plan's: a plan is of the run those flags make.
    settings=(
        Flags(ModelOptions, only=["model_select"], defaults={"model_select": MISSING}),
        Flags(PlanSettings, only=["vocab_size", "num_gpus", "num_nodes", "micro_batch"]),
        Flags(ModelOptions, only=["context_length"]),
        Flags(ComputeOptions, only=["activation_checkpointing", "loss_chunk"]),
        Flags(PlanSettings, only=["gpu_memory", "verbose"]),
    ),
    handler=cmd_plan,
)


LINEAGE = Command(
    "lineage",
    help="the steps and checkpoints of a run that trained on a document",
    description="Which steps of a training run, and so which of its checkpoints, trained on a document: its "
    "chunk and blocks, and each rank's reading replayed from the run's own record (launches, "
    "ranks, growth, mixture stages, skipped micro-batches), checked against the data position "
    "the checkpoint saved. Chunks are read and tokenized again; no model is built.",
    epilog="examples:\n"
    "  dsgpt2 lineage --ckpt_dir runs/ckpt --doc news:1234\n"
    "  dsgpt2 lineage --ckpt_dir runs/ckpt --doc news:1234 --doc wiki:7 --json",
    settings=(LineageSettings,),
    handler=cmd_lineage,
)


TOKENIZE = Command(
    "tokenize",
    help="build the token cache that `ds_trainer.py --data_mode cached` reads",
    description=(
        "Tokenize every document into memory-mapped files, ahead of training. Use the data flags the "
        "training run will use: the cache is fingerprinted by the collections, their counts, the "
        "tokenizer, the context, the split, the seed, the reading order and the task (--task "
        "conversation: reply-only labels), and a run with other settings rebuilds it. "
        "Several nodes: a shared --cache_dir is built once; with node-local disks, run this on every "
        "node with its own --cache_dir (a run builds what a node lacks, one builder per directory)."
    ),
    settings=(
        Flags(DataOptions, only=CACHE_DATA,
              defaults={"vocab_dir": Path("runs/tokenizer"), "cache_dir": Path("runs/train/cache")}),
        Flags(ModelOptions, only=CACHE_MODEL),
        TokenizeSettings,
    ),
    handler=cmd_tokenize,
)  # fmt: skip
