"""The ``dsgpt2`` command: parse, build, run. Each subcommand maps to one function."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dsgpt2 import __version__
from dsgpt2.argtypes import OneLineErrorParser, non_negative_int, port, positive_int
from dsgpt2.corpus.config import ENV_URI, scrub
from dsgpt2.errors import DsGpt2Error
from dsgpt2.log import setup_logging

log = logging.getLogger("dsgpt2")

DESCRIPTION = """\
Pretrain GPT-2 with DeepSpeed on a corpus stored in MongoDB.

Every subcommand reads a connection config (--config), a JSON file such as
  {"MONGO_CONNECTION_STRING": "mongodb://user@host:27017",
   "MONGO_CONNECTION_DB": "corpus", "COLLECTIONS": ["news", "wiki"]}
The environment variable MONGO_CONNECTION_STRING overrides the file's
connection string: keep passwords there, not in files. mongomock://PATH is an
in-process store persisted in PATH, for tests and the demo.

Typical first steps:
  dsgpt2 ingest --config configs/sample.json --sample stdlib
  dsgpt2 validate --config configs/sample.json
  dsgpt2 info --config configs/sample.json
"""


Parser = OneLineErrorParser


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        required=True,
        metavar="JSON",
        help="connection config (MONGO_CONNECTION_STRING, MONGO_CONNECTION_DB, COLLECTIONS, ...)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")


def build_parser() -> Parser:
    parser = Parser(
        prog="dsgpt2", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"dsgpt2 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "ingest",
        help="load text files or the built-in sample into a collection",
        description=(
            "Load documents into a collection: each record's text is kept as `form`, cleaned into "
            "`filt_text` and numbered with `idx` after the collection's last one. Interrupted and "
            "re-run with the same arguments, it resumes without duplicating or skipping records. "
            "Files may be gzipped."
        ),
        epilog=(
            "examples:\n"
            "  dsgpt2 ingest --config c.json --sample stdlib\n"
            "  dsgpt2 ingest --config c.json --collection news news.jsonl.gz --field body\n"
            "  dsgpt2 ingest --config c.json --collection books --split paragraph books/*.txt\n"
            "  dsgpt2 ingest --config c.json --collection chats --format conversation chats.jsonl"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config(p)
    p.add_argument(
        "inputs", nargs="*", metavar="FILE", help="input files (.txt, .jsonl, .csv, optionally .gz)"
    )
    p.add_argument(
        "--sample",
        choices=["stdlib", "stdlib-chat"],
        help="ingest a built-in sample (no download): stdlib documentation, or conversations about it",
    )
    p.add_argument("--limit", type=positive_int, help="with --sample: only the first N documents")
    p.add_argument("--collection", help="target collection (default: the first of COLLECTIONS in the config)")
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", "text", "jsonl", "csv", "conversation"],
        help="input format; auto goes by the file extension (default: auto)",
    )
    p.add_argument("--field", default="text", help="jsonl: the field holding the text (default: text)")
    p.add_argument("--column", default="text", help="csv: the column holding the text (default: text)")
    p.add_argument(
        "--split",
        default="line",
        choices=["line", "paragraph"],
        help="text files: one document per line or per blank-line separated paragraph (default: line)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=1000, help="documents per insert (default: 1000)"
    )
    p.add_argument("--strict", action="store_true", help="stop at the first unusable record")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser(
        "validate",
        help="check idx, indexes and counts of the collections",
        description=(
            "Check each collection for what training relies on: integer idx values 0..n-1, each once, "
            "a unique index on idx, and a matching count in meta_info. Prints each problem with its "
            "fix; exits 1 when there is one. --fix creates a missing index and records the count."
        ),
    )
    _add_config(p)
    p.add_argument(
        "--collection", action="append", help="check only this collection (repeatable; default: all)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--fix", action="store_true", help="create a missing idx index and record counts")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "info",
        help="show the configured collections, their counts and ingest history",
        description="Show what the config points at: hosts, database, collections and meta_info.",
    )
    _add_config(p)
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=cmd_info)

    _add_vocab(sub)

    p = sub.add_parser(
        "tokenize",
        help="build the token cache that `ds_trainer.py --data_mode cached` reads",
        description=(
            "Tokenize and pack the training and validation splits into memory-mapped files, ahead of "
            "training. Use the data flags the training run will use: the cache is fingerprinted by the "
            "collections, their counts, the tokenizer, the context, the split and the seed, and a run "
            "with other settings rebuilds it."
        ),
    )
    from dsgpt2.options import add_options
    from dsgpt2.train.config import DataOptions, ModelOptions

    # The training run's own data flags, so that the cache matches the run that reads it.
    data_flags = ["config_train", "vocab_dir", "tr_ratio", "seed", "chunk_docs", "cache_dir", "num_workers"]
    defaults = {"vocab_dir": Path("runs/tokenizer"), "cache_dir": Path("runs/train/cache")}
    add_options(p, DataOptions, only=data_flags, defaults=defaults)
    add_options(p, ModelOptions, only=["model_select", "context_length"])
    p.add_argument("--force", action="store_true", help="rebuild even if the cache is up to date")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser(
        "plan",
        help="estimate GPU and CPU memory per ZeRO stage for a model preset",
        description=(
            "Estimate the memory the model states of a preset need under each ZeRO stage and offload "
            "choice (DeepSpeed's estimators), to pick a DeepSpeed config before training. "
            "Activations come on top."
        ),
    )
    from dsgpt2.model import PRESETS

    p.add_argument("--model_select", required=True, choices=list(PRESETS), help="model size preset")
    p.add_argument("--vocab_size", type=positive_int, default=50257, help="vocabulary size (default 50257)")
    p.add_argument("--num_gpus", type=positive_int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--num_nodes", type=positive_int, default=1, help="nodes (default 1)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "export",
        help="turn a training checkpoint into a Hugging Face model directory",
        description=(
            "Export a checkpoint (any ZeRO stage) as safetensors weights, config and tokenizer: the "
            "directory loads with transformers' GPT2LMHeadModel.from_pretrained and "
            "pipeline('text-generation'), without dsgpt2."
        ),
    )
    p.add_argument("--ckpt_dir", required=True, help="checkpoint directory of a training run")
    p.add_argument("--ckpt_id", help="checkpoint tag (default: the one `latest` names)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--vocab_dir", help="tokenizer directory (default: the one the run trained with)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_export)

    _add_inference(sub)

    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on the built-in sample corpus, in process",
        description=(
            "Run every stage on the built-in sample corpus against an in-process mongomock "
            "database: no server, no download. Prints a summary and writes OUT/summary.json."
        ),
    )
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument(
        "--config",
        metavar="JSON",
        help="run against this MongoDB server and database instead (the demo's own collections "
        "there: stdlib, stdlib_chat)",
    )
    p.add_argument("--limit", type=positive_int, help="only the first N sample documents")
    p.add_argument("--steps", type=positive_int, default=300, help="training steps (default 300)")
    p.add_argument(
        "--chat_steps", type=positive_int, default=150, help="conversation finetuning steps (default 150)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_demo)
    return parser


def _add_sampling(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--fraction", type=float, help="draw this fraction of the documents, in (0, 1]")
    group.add_argument("--count", type=positive_int, help="draw about this many documents")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (default: 0)")


def _add_vocab(sub: Any) -> None:
    vocab = sub.add_parser(
        "vocab",
        help="export the vocabulary corpus and train the BPE tokenizer",
        description="Build the vocabulary: `vocab download` exports text shards, `vocab train` learns BPE.",
    )
    vsub = vocab.add_subparsers(dest="vocab_command", metavar="STEP", required=True)

    p = vsub.add_parser(
        "download",
        help="export (a sample of) the collections to local text shards",
        description=(
            "Export the configured collections, all documents or a seeded sample, to "
            "OUT/shard-NNNNN.jsonl ({idx, text} per line) in parallel worker processes, each with its "
            "own MongoDB client. Finished shards are recorded in OUT/manifest.json: a re-run (after a "
            "crash, say) writes only the missing ones."
        ),
    )
    _add_config(p)
    p.add_argument("--out", default="runs/vocab_corpus", help="shard directory (default: runs/vocab_corpus)")
    _add_sampling(p)
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes (default: 2)")
    p.add_argument("--shards", type=positive_int, help="number of shards (default: one per 50,000 documents)")
    p.add_argument("--chunk", type=positive_int, default=1000, help="documents per query (default: 1000)")
    p.add_argument("--overwrite", action="store_true", help="replace shards of a different download in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_vocab_download)

    p = vsub.add_parser(
        "train",
        help="train the byte-level BPE tokenizer from shards or straight from MongoDB",
        description=(
            "Train a byte-level BPE tokenizer (GPT-2 style) on the shards of `vocab download` or, with "
            "--from-mongo, on texts streamed from the collections. OUT then holds vocab.json, "
            "merges.txt, tokenizer.json and tokenizer_config.json: "
            "transformers.AutoTokenizer.from_pretrained(OUT) loads it. Special tokens take the first "
            "ids: <|endoftext|> 0, <|pad|> 1, then <|SPEAKER|> per --speakers, then <unusedN>."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", metavar="DIR", help="shard directory written by `vocab download`")
    src.add_argument(
        "--from-mongo", action="store_true", help="stream texts from the collections of --config"
    )
    p.add_argument("--config", metavar="JSON", help="connection config (with --from-mongo)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    _add_sampling(p)
    p.add_argument("--out", default="runs/tokenizer", help="tokenizer directory (default: runs/tokenizer)")
    p.add_argument("--vocab-size", type=positive_int, default=50257, help="vocabulary size (default: 50257)")
    p.add_argument("--min-frequency", type=positive_int, default=2, help="minimum pair count (default: 2)")
    p.add_argument(
        "--speakers", default="user,bot", help="conversation speakers, comma-separated (default: user,bot)"
    )
    p.add_argument(
        "--reserved", type=int, default=0, help="number of <unusedN> tokens to reserve (default: 0)"
    )
    p.add_argument("--lowercase", action="store_true", help="lowercase texts first (default: keep case)")
    p.add_argument(
        "--context-length", type=positive_int, default=1024, help="model context length (default: 1024)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_vocab_train)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="an exported model (dsgpt2 export) or a checkpoint directory (its `latest`)",
    )
    p.add_argument("--ckpt_id", help="checkpoint tag (default: the one `latest` names)")
    p.add_argument("--vocab_dir", help="tokenizer directory (default: the model's)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")


def _add_generation(p: argparse.ArgumentParser, max_new_tokens: int | None = 64) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max_new_tokens",
        type=positive_int,
        default=max_new_tokens,
        help=f"tokens to generate at most (default {max_new_tokens or '64, at most --max_tokens_limit'})",
    )
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy; higher: more random (0.8)")
    g.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest; 0: all (50)")
    g.add_argument("--top_p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    g.add_argument("--repetition_penalty", type=float, default=1.0, help="> 1 discourages repeats (1)")
    g.add_argument("--seed", type=int, default=0, help="same seed, same text (default 0)")


def _sampling(args: argparse.Namespace, **extra: Any) -> Any:
    from dsgpt2.infer.generate import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        **extra,
    )


def _add_inference(sub: Any) -> None:
    p = sub.add_parser(
        "evaluate",
        help="loss and perplexity of a model on the validation split or any collection",
        description=(
            "Evaluate a checkpoint or an exported model: mean loss per token and perplexity over every "
            "block of a split, made as in training. By default the validation split of the run that "
            "trained the model (its collections, split seed and ratio, context and task). Writes a "
            "JSON report and records the result in the eval_results collection of the database."
        ),
        epilog=(
            "examples:\n"
            "  dsgpt2 evaluate --model runs/model --config configs/mongo.json\n"
            "  dsgpt2 evaluate --model runs/ckpt --config c.json --collection news --split all"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model(p)
    p.add_argument("--config", required=True, metavar="JSON", help="connection config of the corpus")
    p.add_argument(
        "--split",
        default="val",
        choices=["val", "train", "all"],
        help="the run's validation or training split, or every document (default: val)",
    )
    p.add_argument("--collection", action="append", help="evaluate on this collection (repeatable)")
    p.add_argument("--start", type=int, help="first document of the unified index (default: 0)")
    p.add_argument("--stop", type=positive_int, help="end of the unified index range (default: all)")
    p.add_argument("--task", choices=["lm", "conversation"], help="default: the run's")
    p.add_argument("--reply_speakers", help="conversation task: speakers scored (default: the run's)")
    p.add_argument("--tr_ratio", type=float, help="split ratio (default: the run's)")
    p.add_argument("--split_seed", type=int, help="split seed (default: the run's)")
    p.add_argument("--context_length", type=positive_int, help="tokens per block (default: the run's)")
    p.add_argument("--batch_size", type=positive_int, default=8, help="blocks per forward pass (default 8)")
    p.add_argument("--max_batches", type=positive_int, help="stop after this many batches (default: all)")
    p.add_argument(
        "--num_workers", type=non_negative_int, default=2, help="tokenizing worker processes (default 2)"
    )
    p.add_argument("--report", help="JSON report path (default: runs/eval/<model>-<split>.json)")
    p.add_argument("--no_record", action="store_true", help="do not write the result to eval_results")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint or an exported model",
        description=(
            "Continue each prompt (from the arguments, or one per line of --prompts_file) with "
            "sampled text; generation stops at end-of-text or --max_new_tokens. The same seed, "
            "prompt and model give the same text."
        ),
    )
    _add_model(p)
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    p.add_argument("--prompts_file", help="a file with one prompt per line")
    p.add_argument("--num_samples", type=positive_int, default=1, help="completions per prompt (default 1)")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    _add_generation(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "chat",
        help="talk with a conversation-finetuned model (stdin, interactive or piped)",
        description=(
            "Read a line, answer it, keep the dialogue within the model's context (oldest turns go "
            "first). /reset forgets the conversation, /quit ends it. Works from a pipe: one answer "
            "per input line."
        ),
    )
    _add_model(p)
    p.add_argument("--user", default="user", help="the user's speaker name (default: user)")
    p.add_argument("--bot", default="bot", help="the model's speaker name (default: bot)")
    _add_generation(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "serve",
        help="serve generation over HTTP (GET/POST /generate, GET /health)",
        description=(
            "An HTTP server: GET /generate?sentence=TEXT and POST /generate with a JSON body "
            '{"prompt": TEXT, "max_new_tokens": N, "temperature": T, ...}; GET /health. Bad '
            "parameters get 400 with the reason. Bound to 127.0.0.1 unless --host says otherwise."
        ),
    )
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--max_prompt_chars", type=positive_int, default=4000, help="longest prompt accepted (default 4000)"
    )
    p.add_argument(
        "--max_tokens_limit",
        type=positive_int,
        default=256,
        help="largest max_new_tokens a request may ask (default 256)",
    )
    p.add_argument(
        "--max_concurrent",
        type=positive_int,
        default=2,
        help="requests in flight at once; more get 503 (default 2)",
    )
    _add_generation(p, max_new_tokens=None)
    p.set_defaults(func=cmd_serve)


def _check_writable(path: Any, flag: str) -> None:
    """Fail before the work when its output cannot be written."""
    from dsgpt2.errors import ConfigError

    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name such as {path / 'report.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write there ({exc.strerror})") from None


def _load_model(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from dsgpt2.infer.loading import load_model

    return load_model(Path(args.model), args.ckpt_id, Path(args.vocab_dir) if args.vocab_dir else None)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dsgpt2.infer.evaluate import EvalRequest, default_report_path, evaluate, report_lines, write_report

    if args.stop is not None and args.start is None:
        args.start = 0
    if args.start is not None and args.start < 0:
        raise _usage("evaluate", f"--start must be 0 or more, got {args.start}")
    window = None
    if args.start is not None:
        window = (args.start, args.stop if args.stop is not None else 2**62)
    request = EvalRequest(
        split=args.split,
        collections=tuple(args.collection) if args.collection else None,
        window=window,
        task=args.task,
        reply_speakers=args.reply_speakers,
        tr_ratio=args.tr_ratio,
        seed=args.split_seed,
        context=args.context_length,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
        workers=args.num_workers,
    )
    config = _load(args)
    loaded = _load_model(args)
    path = Path(args.report) if args.report else default_report_path(loaded.name, args.split)
    _check_writable(path, "--report")
    report = evaluate(loaded, config, request, progress=not args.no_progress)
    write_report(report, path)
    print("\n".join(report_lines(report)))
    print(f"report: {path}")
    if not args.no_record:
        from dsgpt2.corpus.mongo import EVAL_RESULTS, connect, record_eval

        record_eval(connect(config), report)
        print(f"recorded in {config.db}.{EVAL_RESULTS}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dsgpt2.infer.generate import Generator

    prompts = list(args.prompts)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise _usage("generate", f"--prompts_file {path}: file not found")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise _usage("generate", f"--prompts_file {path}: cannot read it as UTF-8 text ({exc})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise _usage("generate", "give PROMPT arguments or --prompts_file")
    params = _sampling(args, num_samples=args.num_samples)
    generator = Generator(_load_model(args))
    for prompt in prompts:
        completions = generator.generate(prompt, params)
        for i, c in enumerate(completions):
            if args.json:
                print(json.dumps({"prompt": prompt, "sample": i, **vars(c)}, ensure_ascii=False))
            else:
                head = f"[{i + 1}/{len(completions)}] " if len(completions) > 1 else ""
                print(f"{head}{prompt}{c.text}")
                print(f"--- {c.tokens} tokens, stopped by {c.finish_reason}", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from dsgpt2.infer.chat import ChatSession, run_chat
    from dsgpt2.infer.generate import Generator

    session = ChatSession(Generator(_load_model(args)), _sampling(args), args.user, args.bot)
    interactive = sys.stdin.isatty()

    def lines() -> Any:
        while True:
            if interactive:
                print(f"{args.user}> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return
            yield line

    for out in run_chat(session, lines(), interactive):
        print(out, flush=True)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dsgpt2.infer.generate import Generator
    from dsgpt2.infer.serve import ServeLimits, make_app, serve

    limits = ServeLimits(
        max_prompt_chars=args.max_prompt_chars,
        max_new_tokens=args.max_tokens_limit,
        max_concurrent=args.max_concurrent,
    )
    if args.max_new_tokens is None:
        args.max_new_tokens = min(64, limits.max_new_tokens)
    if args.max_new_tokens > limits.max_new_tokens:
        raise _usage("serve", f"--max_new_tokens {args.max_new_tokens} is above --max_tokens_limit")
    app = make_app(Generator(_load_model(args)), limits, _sampling(args))
    serve(app, args.host, args.port)
    return 0


def cmd_vocab_download(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dsgpt2.tokenizer.texts import download

    report = download(
        _load(args),
        Path(args.out),
        fraction=args.fraction,
        count=args.count,
        seed=args.seed,
        workers=args.workers,
        shards=args.shards,
        chunk=args.chunk,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print("\n".join(report.lines()))
    return 0


def cmd_vocab_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dsgpt2.corpus.documents import SkipTally
    from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
    from dsgpt2.tokenizer.texts import mongo_texts, shard_texts

    speakers = tuple(s.strip() for s in args.speakers.split(",") if s.strip())
    settings = VocabSettings(
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        speakers=speakers,
        reserved=args.reserved,
        lowercase=args.lowercase,
        context_length=args.context_length,
    )
    if args.from_mongo:
        if not args.config:
            raise _usage("vocab train", "--from-mongo needs --config")
        config = _load(args)
        texts, wrapper = mongo_texts(config, args.fraction, args.count, args.seed)
        skipped = wrapper.skipped
        source = f"{config.display_uri} {config.db}.{','.join(config.collections)}"
    else:
        if args.fraction or args.count:
            raise _usage("vocab train", "--fraction/--count go with --from-mongo; sample at `vocab download`")
        skipped = SkipTally()
        texts = shard_texts(Path(args.input), skipped=skipped)
        source = f"shards in {args.input}"
    report = train_vocab(
        texts, Path(args.out), settings, source, skipped=skipped, progress=not args.no_progress
    )
    print("\n".join(report.lines()))
    return 0


def _load(args: argparse.Namespace) -> Any:
    from dsgpt2.corpus.config import load_config

    return load_config(args.config)


def cmd_ingest(args: argparse.Namespace) -> int:
    from dsgpt2.corpus.ingest import file_source, ingest, sample_source
    from dsgpt2.corpus.mongo import connect

    if not args.inputs and not args.sample:
        raise _usage("ingest", "give input FILEs or --sample stdlib")
    if args.limit and not args.sample:
        raise _usage("ingest", "--limit goes with --sample")
    config = _load(args)
    if config.uri == "mongomock://":
        log.warning(
            "MONGO_CONNECTION_STRING is mongomock:// (in memory): the documents vanish when this "
            "command ends; use mongomock://PATH to keep them in a file, or a real server"
        )
    collection = args.collection or config.collections[0]
    sources = [sample_source(args.sample, args.limit)] if args.sample else []
    sources += [
        file_source(path, args.format, field=args.field, column=args.column, split=args.split)
        for path in args.inputs
    ]
    conn = connect(config)
    log.info("ingesting %d source(s) into %s.%s", len(sources), config.db, collection)
    report = ingest(
        conn,
        collection,
        sources,
        batch_size=args.batch_size,
        strict=args.strict,
        progress=not args.no_progress,
    )
    for line in report.lines():
        print(line)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from dsgpt2.corpus.mongo import connect
    from dsgpt2.corpus.validate import fix_collection, validate_corpus
    from dsgpt2.errors import CorpusValidationError

    config = _load(args)
    conn = connect(config)
    names = args.collection or list(config.collections)
    if args.fix:
        for name in names:
            for line in fix_collection(conn, name):
                print(line)
    reports = validate_corpus(conn, names)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for r in reports:
            print("\n".join(r.lines()))
    bad = [r.name for r in reports if not r.ok]
    if bad:
        raise CorpusValidationError(f"problems found in {', '.join(bad)}; apply the fixes above")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from dsgpt2.corpus.mongo import MongoWrapper, read_meta

    config = _load(args)
    wrapper = MongoWrapper(config)
    meta = read_meta(wrapper.connection, list(config.collections))
    info = {
        "uri": config.display_uri,
        "db": config.db,
        "documents": len(wrapper),
        "collections": [
            {
                "name": name,
                "count": count,
                "cleaner_version": meta.get(name, {}).get("cleaner_version"),
                "sources": [
                    {k: s.get(k) for k in ("label", "records", "inserted", "complete")}
                    for s in meta.get(name, {}).get("sources", {}).values()
                ],
            }
            for name, count in zip(config.collections, wrapper.counts, strict=True)
        ],
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['uri']} / {info['db']}: {info['documents']} documents")
    for c in info["collections"]:
        print(f"  {c['name']}: {c['count']} documents (cleaner {c['cleaner_version'] or '-'})")
        for s in c["sources"]:
            state = "complete" if s["complete"] else f"interrupted after record {s['records']}"
            print(f"    {s['label']}: {s['inserted']} inserted, {state}")
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from dsgpt2.corpus.config import load_config
    from dsgpt2.data.cache import prepare_cache
    from dsgpt2.data.sources import make_spec
    from dsgpt2.options import from_namespace
    from dsgpt2.train.config import DataOptions, ModelOptions
    from dsgpt2.train.trainer import run_context

    data = from_namespace(DataOptions, args)
    context = run_context(from_namespace(ModelOptions, args))
    spec = make_spec(data.vocab_dir, context, data.chunk_docs, data.tr_ratio, data.seed)
    meta, built = prepare_cache(
        load_config(data.config_train), data.vocab_dir, spec, data.cache_dir, data.num_workers, args.force
    )
    state = "built" if built else "already up to date"
    print(
        f"{data.cache_dir}: {state}; blocks of {context} tokens: "
        f"{meta['blocks']['train']} train, {meta['blocks']['val']} validation"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dsgpt2.train.plan import plan, plan_lines

    total, rows = plan(args.model_select, args.vocab_size, args.num_gpus, args.num_nodes)
    print("\n".join(plan_lines(args.model_select, total, rows, args.num_gpus, args.num_nodes)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dsgpt2.infer.export import export

    result = export(
        Path(args.ckpt_dir), Path(args.out), args.ckpt_id, Path(args.vocab_dir) if args.vocab_dir else None
    )
    print(
        f"exported {args.ckpt_dir}/{result['tag']} (step {result['step']}, "
        f"{result['parameters'] / 1e6:.1f}M parameters) to {result['out']}"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dsgpt2.demo import run_demo, summary_lines

    out = Path(args.out)
    server = _load(args) if args.config else None
    summary = run_demo(
        out,
        limit=args.limit,
        progress=not args.no_progress,
        steps=args.steps,
        chat_steps=args.chat_steps,
        server=server,
    )
    print("\n".join(summary_lines(summary, out)))
    return 0


def _usage(command: str, message: str) -> DsGpt2Error:
    from dsgpt2.errors import ConfigError

    return ConfigError(f"dsgpt2 {command}: {message} (see `dsgpt2 {command} --help`)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dsgpt2`` command; user errors print one line and return their exit code."""
    args = build_parser().parse_args(argv)
    setup_logging(verbose=getattr(args, "verbose", False))
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except DsGpt2Error as exc:
        # Messages are scrubbed where they are made; this is the last line of defence.
        message = scrub(str(exc), os.environ.get(ENV_URI, ""))
        print(f"dsgpt2: error: {message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("dsgpt2: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
