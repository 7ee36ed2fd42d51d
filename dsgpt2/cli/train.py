"""The training-side commands: tokenize (the token cache), plan (memory per ZeRO stage), lineage
(which steps of a run trained on a document)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from dsgpt2.model.gpt2 import DEFAULT_LOSS_CHUNK
from dsgpt2.settings.argtypes import non_negative_int, positive_float, positive_int

log = logging.getLogger("dsgpt2")


def add_tokenize(sub: Any) -> None:
    p = sub.add_parser(
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
    )
    from dsgpt2.settings.options import add_options
    from dsgpt2.train.config import DataOptions, ModelOptions

    # The training run's own data flags, so that the cache matches the run that reads it.
    data_flags = ["config_train", "vocab_dir", "tr_ratio", "seed", "chunk_docs", "read_order", "cache_dir",
                  "num_workers"]  # fmt: skip
    defaults = {"vocab_dir": Path("runs/tokenizer"), "cache_dir": Path("runs/train/cache")}
    add_options(p, DataOptions, only=data_flags, defaults=defaults)
    add_options(p, ModelOptions, only=["model_select", "context_length", "task", "reply_speakers"])
    p.add_argument("--force", action="store_true", help="rebuild even if the cache is up to date")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a token cache of other data (another tokenizer, corpus or settings) at --cache_dir",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_tokenize)


def add_plan(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="estimate GPU and CPU memory per ZeRO stage for a model preset",
        description=(
            "Estimate the memory the model states of a preset need under each ZeRO stage and offload "
            "choice (DeepSpeed's estimators), to pick a DeepSpeed config before training. "
            "Activations come on top."
        ),
    )
    from dsgpt2.model.gpt2 import PRESETS

    p.add_argument("--model_select", required=True, choices=list(PRESETS), help="model size preset")
    p.add_argument("--vocab_size", type=positive_int, default=50257, help="vocabulary size (default 50257)")
    p.add_argument("--num_gpus", type=positive_int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--num_nodes", type=positive_int, default=1, help="nodes (default 1)")
    p.add_argument("--micro_batch", type=positive_int, help="add activations: N sequences a micro-batch")
    p.add_argument("--context_length", type=positive_int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--activation_checkpointing", action="store_true", help="as the trainer's flag")
    chunk = f"as the trainer's flag (default {DEFAULT_LOSS_CHUNK}; 0: transformers' loss)"
    p.add_argument("--loss_chunk", type=non_negative_int, default=DEFAULT_LOSS_CHUNK, help=chunk)
    p.add_argument("--gpu_memory", type=positive_float, default=80.0, help="GB per GPU (default 80)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_plan)


def add_lineage(sub: Any) -> None:
    p = sub.add_parser(
        "lineage",
        help="the steps and checkpoints of a run that trained on a document",
        description=(
            "Which steps of a training run, and so which of its checkpoints, trained on a document: its "
            "chunk and blocks, and each rank's reading replayed from the run's own record (launches, "
            "ranks, growth, mixture stages, skipped micro-batches), checked against the data position "
            "the checkpoint saved. Chunks are read and tokenized again; no model is built."
        ),
        epilog=(
            "examples:\n"
            "  dsgpt2 lineage --ckpt_dir runs/ckpt --doc news:1234\n"
            "  dsgpt2 lineage --ckpt_dir runs/ckpt --doc news:1234 --doc wiki:7 --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ckpt_dir", required=True, help="the run's checkpoint directory")
    p.add_argument(
        "--doc", required=True, action="append", metavar="COLLECTION:IDX", help="a document (repeatable)"
    )
    p.add_argument("--ckpt_id", help="replay up to this checkpoint (default: the one `latest` names)")
    p.add_argument("--config", metavar="JSON", help="connection config (default: the run's --config_train)")
    p.add_argument("--vocab_dir", help="the run's tokenizer (default: the one it recorded)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_lineage)


def cmd_lineage(args: argparse.Namespace) -> int:
    import json

    from dsgpt2.checkpoints.lineage import lineage, lineage_lines
    from dsgpt2.db.config import load_config

    ckpt_dir = Path(args.ckpt_dir)
    mongo = load_config(args.config) if args.config else None
    vocab = Path(args.vocab_dir) if args.vocab_dir else None
    result = lineage(ckpt_dir, args.doc, mongo, args.ckpt_id, vocab)
    print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(lineage_lines(result)))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from dsgpt2.data.cache import prepare_cache
    from dsgpt2.db.config import load_config
    from dsgpt2.db.mongo import connect, require_collections
    from dsgpt2.settings.options import from_namespace
    from dsgpt2.train.config import DataOptions, ModelOptions, data_spec
    from dsgpt2.train.engine import run_context

    data, model = from_namespace(DataOptions, args), from_namespace(ModelOptions, args)
    context = run_context(model)
    spec = data_spec(data, model, context)
    config = load_config(data.config_train)
    # An absent collection reads as an empty one: a cache of nothing, "already up to date".
    require_collections(connect(config), str(data.config_train))
    meta, added = prepare_cache(
        config,
        data.vocab_dir,
        spec,
        data.cache_dir,
        data.num_workers,
        args.force,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    state = f"{added} chunk(s) tokenized, {meta['chunks']} in all" if added else "already up to date"
    tokens = meta["tokens"]
    print(f"{data.cache_dir}: {state}; tokens: {tokens['train']} train, {tokens['val']} validation")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dsgpt2.model.gpt2 import PRESETS
    from dsgpt2.train.plan import plan, plan_lines

    total, rows = plan(args.model_select, args.vocab_size, args.num_gpus, args.num_nodes)
    act, shape = None, (0, 0)
    if args.micro_batch:
        from dsgpt2.train.plan import activations

        shape = (args.micro_batch, args.context_length or PRESETS[args.model_select].context)
        act = activations(args.model_select, args.vocab_size, shape[1], shape[0],
                          args.activation_checkpointing, args.loss_chunk)  # fmt: skip
    where = (args.num_gpus, args.num_nodes)
    print("\n".join(plan_lines(args.model_select, total, rows, *where, act, shape, args.gpu_memory)))
    return 0
