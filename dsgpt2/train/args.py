"""The trainer's command line: the original toolkit's flags, DeepSpeed's, and dsgpt2's own."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from dsgpt2.argtypes import OneLineErrorParser, non_negative_int, positive_int
from dsgpt2.errors import ConfigError
from dsgpt2.model import PRESETS


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"must be in (0, 1] (the share of documents that train), got {value}"
        )
    return value


def build_parser() -> OneLineErrorParser:
    p = OneLineErrorParser(
        prog="ds_trainer.py",
        description=(
            "Train GPT-2 with DeepSpeed on the MongoDB corpus named by --config_train. Runs under the "
            "`deepspeed` launcher (one or many GPUs and nodes) or as a single process "
            "(`python ds_trainer.py ...`, CPU or one GPU). Resumes from the latest checkpoint in "
            "--ckpt_dir; --no_resume refuses to instead."
        ),
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model_select", default="112m", choices=list(PRESETS), help="model size preset (default: 112m)"
    )
    g.add_argument("--model_config", type=Path, help="a GPT-2 config JSON instead of a preset")
    g.add_argument("--loss_type", default="lm_loss", choices=["lm_loss"], help="training objective")
    g.add_argument("--context_length", type=positive_int, help="tokens per block (default: the preset's)")
    g.add_argument(
        "--init_from",
        type=Path,
        help="start from these weights (an export or a checkpoint directory): finetuning; "
        "the model config comes with them and --model_select is ignored",
    )
    g.add_argument(
        "--task",
        choices=["lm", "conversation"],
        default="lm",
        help="lm: next-token loss on every token; conversation: the documents' turns with speaker "
        "tokens, loss on the replies only (default: lm)",
    )
    g.add_argument(
        "--reply_speakers",
        default="bot",
        help="conversation task: speakers whose turns the loss covers, comma-separated (default: bot)",
    )

    g = p.add_argument_group("data")
    g.add_argument("--config_train", required=True, type=Path, help="MongoDB connection config JSON")
    g.add_argument(
        "--vocab_dir",
        type=Path,
        help="tokenizer directory (default: the --init_from model's, else runs/tokenizer)",
    )
    g.add_argument(
        "--tr_ratio", type=_ratio, default=0.99, help="share of documents that train (default 0.99)"
    )
    g.add_argument("--data_mode", choices=["streaming", "cached"], default="streaming",
                   help="streaming: read MongoDB on the fly; cached: memory-mapped token files")  # fmt: skip
    g.add_argument("--cache_dir", type=Path, help="token cache (default: WORKSPACE/cache)")
    g.add_argument("--chunk_docs", type=positive_int, default=1000, help="documents per chunk (default 1000)")
    g.add_argument("--num_workers", type=non_negative_int, default=2, help="DataLoader workers per rank")
    g.add_argument(
        "--allow_corpus_problems", action="store_true", help="train even if validate finds problems"
    )

    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=1234, help="seed of init, split and order (default 1234)")
    g.add_argument("--train_iters", type=positive_int, default=1000, help="optimizer steps (default 1000)")
    g.add_argument("--workspace", type=Path, default=Path("runs/train"), help="run directory: metrics, plot")
    g.add_argument("--eval_interval", type=positive_int, default=100, help="validate every N steps")
    g.add_argument("--eval_iters", type=positive_int, default=10, help="validation batches per evaluation")
    g.add_argument(
        "--eval_batch_size", type=positive_int, help="validation micro-batch (default: training's)"
    )
    g.add_argument("--log_interval", type=positive_int, default=10, help="log metrics every N steps")
    g.add_argument("--log_block_ids", action="store_true", help="record every batch's block ids in metrics")
    g.add_argument(
        "--max_nonfinite", type=positive_int, default=5, help="abort after this many bad losses in a row"
    )
    g.add_argument("--wandb", choices=["offline", "online", "off"], default="offline", help="wandb mode")
    g.add_argument("--wandb_dir", type=Path, help="wandb directory (default: WORKSPACE)")
    # Fault injection for the test suite: a NaN loss at these micro-batches; a hard exit after a step.
    g.add_argument(
        "--debug_nonfinite_at", type=non_negative_int, nargs="*", default=[], help=argparse.SUPPRESS
    )
    g.add_argument("--debug_exit_after", type=positive_int, help=argparse.SUPPRESS)

    g = p.add_argument_group("checkpoints")
    g.add_argument("--ckpt_dir", type=Path, default=Path("runs/ckpt"), help="where checkpoints are saved")
    g.add_argument("--save_interval", type=positive_int, default=500, help="save every N steps")
    g.add_argument(
        "--keep_last", type=non_negative_int, default=3, help="keep the last K checkpoints (0: all)"
    )
    g.add_argument("--load_dir", type=Path, help="resume from this directory (an error if it holds none)")
    g.add_argument("--ckpt_id", help="resume from this tag instead of `latest`")
    g.add_argument(
        "--no_resume",
        action="store_true",
        help="never resume: a fresh run, refused where --ckpt_dir holds checkpoints (never overwritten)",
    )
    g.add_argument("--ignore_fingerprint", action="store_true",
                   help="resume although the corpus or tokenizer changed since the checkpoint")  # fmt: skip

    g = p.add_argument_group("distributed")
    g.add_argument("--distributed-backend", dest="distributed_backend", default=None,
                   help="torch.distributed backend (default: nccl on GPU, gloo on CPU)")  # fmt: skip
    g.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")

    import deepspeed

    deepspeed.add_config_arguments(p)
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the flags.

    Raises:
        ConfigError: a combination of flags that cannot work, naming the flags and the fix.
    """
    args = build_parser().parse_args(argv)
    if not args.deepspeed_config:
        raise ConfigError("--deepspeed_config is required (the shipped ones are configs/ds_config*.json)")
    if not args.config_train.is_file():
        raise ConfigError(f"--config_train {args.config_train}: file not found")
    if args.init_from is not None and not args.init_from.exists():
        raise ConfigError(f"--init_from {args.init_from}: not found (an exported model or a checkpoint dir)")
    if args.vocab_dir is None:
        args.vocab_dir = Path("runs/tokenizer")
        if args.init_from is not None:
            from dsgpt2.train.weights import init_tokenizer_dir

            args.vocab_dir = init_tokenizer_dir(args.init_from)
    if not (args.vocab_dir / "tokenizer.json").is_file():
        raise ConfigError(
            f"--vocab_dir {args.vocab_dir}: no tokenizer.json; train one first (dsgpt2 vocab train)"
        )
    if args.model_config is not None and not args.model_config.is_file():
        raise ConfigError(f"--model_config {args.model_config}: file not found")
    if args.ckpt_id and not args.load_dir:
        args.load_dir = args.ckpt_dir
    if args.no_resume and args.load_dir:
        raise ConfigError("--no_resume contradicts --load_dir/--ckpt_id; drop one")
    return args
