"""The model commands: export, evaluate, generate, chat, serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import (
    check_writable,
    load_config_arg,
    usage,
)
from dsgpt2.settings.argtypes import port, positive_int
from dsgpt2.settings.options import add_options, from_namespace

log = logging.getLogger("dsgpt2")
API_KEY_ENV = "DSGPT2_API_KEY"


def add_export(sub: Any) -> None:
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
    p.add_argument(
        "--vocab_dir",
        help="where the run's tokenizer is, if it moved (default: the one the run trained with; "
        "checked by its hash)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an export of another checkpoint at --out"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_export)


def add_evaluate(sub: Any) -> None:
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
    from dsgpt2.infer.settings import EvalRequest

    add_options(p, EvalRequest)
    p._option_string_actions["--no-doc_mask"] = p._option_string_actions["--no_doc_mask"]  # earlier spelling
    p.add_argument(
        "--hellaswag",
        metavar="FILE.jsonl",
        help="score HellaSwag instead (llm.c's hellaswag_val.jsonl layout: ctx, four endings, label): "
        "acc by summed, acc_norm by mean ending loss",
    )
    p.add_argument("--hellaswag_limit", type=positive_int, help="only the first N HellaSwag examples")
    p.add_argument("--report", help="JSON report path (default: runs/eval/<model>-<split>.json)")
    p.add_argument("--no_record", action="store_true", help="do not write the result to eval_results")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_evaluate)


def add_generate(sub: Any) -> None:
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
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (one sample)")
    _add_generation(p, samples=True)
    p.set_defaults(func=cmd_generate)


def add_chat(sub: Any) -> None:
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


def add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve generation over HTTP: the OpenAI API (/v1/...) and GET/POST /generate",
        description=(
            "An HTTP server: the OpenAI API (POST /v1/completions, POST /v1/chat/completions, "
            "GET /v1/models; streamed as server-sent events with stream: true), GET "
            "/generate?sentence=TEXT and POST /generate with a JSON body "
            '{"prompt": TEXT, "max_new_tokens": N, "temperature": T, ...}; GET /health. Concurrent '
            "requests are decoded together in one batch. Bad parameters get 400 with the reason. "
            "Bound to 127.0.0.1 unless --host says otherwise; --api_key (or $DSGPT2_API_KEY) makes "
            "every request but /health carry 'Authorization: Bearer KEY'."
        ),
    )
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default: 8000)")
    from dsgpt2.infer.settings import ServeLimits

    add_options(p, ServeLimits, only=["max_prompt_chars", "max_new_tokens", "max_concurrent", "max_batch"])
    p.add_argument(
        "--api_key",
        help=f"bearer token required of every request but /health (default: ${API_KEY_ENV}, else none)",
    )
    _add_generation(p, serving=True)
    p.set_defaults(func=cmd_serve)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="an exported model (dsgpt2 export) or a checkpoint directory (its `latest`)",
    )
    p.add_argument("--ckpt_id", help="checkpoint tag (default: the one `latest` names)")
    p.add_argument(
        "--vocab_dir",
        help="where the model's tokenizer is, if it moved (default: the model's; checked by hash)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")


def _add_generation(p: argparse.ArgumentParser, serving: bool = False, samples: bool = False) -> None:
    from dsgpt2.infer.settings import SamplingParams

    flags = ["max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed"]
    add_options(
        p.add_argument_group("sampling"),
        SamplingParams,
        only=flags + (["num_samples"] if samples else []),
        # Serving: the default request's length follows --max_tokens_limit (at most 64).
        defaults={"max_new_tokens": None} if serving else None,
    )


def _sampling(args: argparse.Namespace) -> Any:
    from dsgpt2.infer.settings import SamplingParams

    return from_namespace(SamplingParams, args)


def _load_model(args: argparse.Namespace) -> Any:

    from dsgpt2.infer.loading import load_model

    return load_model(Path(args.model), args.ckpt_id, Path(args.vocab_dir) if args.vocab_dir else None)


def cmd_export(args: argparse.Namespace) -> int:

    from dsgpt2.infer.export import export

    vocab = Path(args.vocab_dir) if args.vocab_dir else None
    result = export(Path(args.ckpt_dir), Path(args.out), args.ckpt_id, vocab, args.overwrite)
    print(
        f"exported {args.ckpt_dir}/{result['tag']} (step {result['step']}, "
        f"{result['parameters'] / 1e6:.1f}M parameters) to {result['out']}"
    )
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:

    from dsgpt2.infer.evaluate import (
        check_collections,
        default_report_path,
        evaluate,
        report_lines,
        write_report,
    )
    from dsgpt2.infer.settings import EvalRequest

    request = from_namespace(EvalRequest, args)
    config = load_config_arg(args)
    examples = None
    if args.hellaswag:
        from dsgpt2.model.hellaswag import read_examples

        examples = read_examples(Path(args.hellaswag), args.hellaswag_limit)
    else:
        check_collections(config, request)
    loaded = _load_model(args)
    split = "hellaswag" if examples else args.split
    path = Path(args.report) if args.report else default_report_path(loaded.name, split)
    check_writable(path, "--report")
    if examples:
        from dsgpt2.infer.evaluate import hellaswag_report

        report = hellaswag_report(loaded, examples, Path(args.hellaswag))
    else:
        report = evaluate(loaded, config, request, progress=not args.no_progress)
    write_report(report, path)
    print("\n".join(report_lines(report)))
    print(f"report: {path}")
    if not args.no_record:
        from dsgpt2.db.mongo import EVAL_RESULTS, connect, record_eval

        record_eval(connect(config), report)
        print(f"recorded in {config.db}.{EVAL_RESULTS}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:

    from dsgpt2.infer.generate import Generator

    prompts = list(args.prompts)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise usage("generate", f"--prompts_file {path}: file not found")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise usage("generate", f"--prompts_file {path}: cannot read it as UTF-8 text ({exc})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise usage("generate", "give PROMPT arguments or --prompts_file")
    params = _sampling(args)
    if args.stream and (args.json or params.num_samples > 1):
        raise usage("generate", "--stream prints one text as it comes: drop --json and keep --num_samples 1")
    generator = Generator(_load_model(args))

    def write(text: str) -> None:
        print(text, end="", flush=True)

    for prompt in prompts:
        if args.stream:
            write(prompt)
            c = generator.generate(prompt, params, on_text=write)[0]
            print()
            print(f"--- {c.tokens} tokens, stopped by {c.finish_reason}", file=sys.stderr)
            continue
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

    run_chat(session, lines(), interactive, lambda text: print(text, end="", flush=True))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dsgpt2.infer.generate import Generator
    from dsgpt2.infer.serve import make_app, serve
    from dsgpt2.infer.settings import SamplingParams, ServeLimits

    limits = from_namespace(ServeLimits, args)
    if args.max_new_tokens is None:
        args.max_new_tokens = min(SamplingParams().max_new_tokens, limits.max_new_tokens)
    if args.max_new_tokens > limits.max_new_tokens:
        raise usage("serve", f"--max_new_tokens {args.max_new_tokens} is above --max_tokens_limit")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = make_app(Generator(_load_model(args)), limits, _sampling(args), api_key, name=args.model)
    serve(app, args.host, args.port, authenticated=api_key is not None)
    return 0
