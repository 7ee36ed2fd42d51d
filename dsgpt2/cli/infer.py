"""The model commands: export, evaluate, generate, chat, serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import (
    Command,
    Flags,
    check_writable,
    config_option,
    load_connection,
    no_progress_option,
    usage,
    verbose_option,
)
from dsgpt2.errors import ConfigError
from dsgpt2.files import not_a_file
from dsgpt2.infer.settings import EvalRequest, SamplingParams, ServeLimits
from dsgpt2.settings.options import NON_NEGATIVE_INT, PORT, POSITIVE_INT, Checked, from_namespace, option
from dsgpt2.train.config import RunOptions

log = logging.getLogger("dsgpt2")
API_KEY_ENV = "DSGPT2_API_KEY"
SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed")


def ckpt_id_option() -> Any:
    """The ``--ckpt_id`` field of a command that reads a checkpoint directory (export, the model's)."""
    return option(None, "checkpoint tag (default: the one `latest` names)")


@dataclass(frozen=True, kw_only=True)
class ExportSettings:
    """``dsgpt2 export``: the checkpoint and the directory it becomes."""

    ckpt_dir: Path = option(help="checkpoint directory of a training run, or its gridfs:RUN in the database")
    ckpt_id: str | None = ckpt_id_option()
    config: str | None = config_option(
        "connection config of the database, for a --ckpt_dir gridfs:RUN or a tokenizer kept there",
        required=False,
    )
    out: Path = option(help="output directory")
    vocab_dir: Path | None = option(
        None,
        "where the run's tokenizer is, if it moved, or its gridfs:NAME in the database (default: the one "
        "the run trained with; checked by its hash)",
    )
    overwrite: bool = option(False, "replace an export of another checkpoint at --out")
    verbose: bool = verbose_option()


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """The model a command loads (evaluate, generate, chat, serve)."""

    model: str = option(
        help="an exported model (dsgpt2 export), a checkpoint directory (its `latest`) or a run's gridfs:RUN "
        "in the database",
        metavar="DIR",
    )
    ckpt_id: str | None = ckpt_id_option()
    db_config: str | None = option(
        None,
        "connection config of the database, for a --model gridfs:RUN or a tokenizer kept there (evaluate: "
        "default its --config)",
    )
    vocab_dir: Path | None = option(
        None,
        "where the model's tokenizer is, if it moved, or its gridfs:NAME in the database (default: the "
        "model's; checked by hash)",
    )
    verbose: bool = verbose_option()

    def load(self, config: str | None = None) -> Any:
        """The model; ``config``: the connection config to read a stored checkpoint through where
        ``--db_config`` names none."""
        from dsgpt2.checkpoints.copies import readable
        from dsgpt2.infer.loading import load_model

        db_config = self.db_config or config
        where = readable(Path(self.model), self.ckpt_id, db_config, "--model", "--db_config")
        loaded = load_model(where, self.ckpt_id, self.vocab_dir, db_config=db_config)
        if where != Path(self.model):  # a stored checkpoint: named by its location, not this machine's copy
            loaded.name = f"{self.model.rstrip('/')}/{Path(loaded.name).name}"
        return loaded


@dataclass(frozen=True, kw_only=True)
class EvaluateSettings:
    """``dsgpt2 evaluate``: the corpus and what becomes of the result (what to evaluate on:
    :class:`EvalRequest`; HellaSwag instead: the trainer's --hellaswag flags)."""

    config: str = config_option("connection config of the corpus")
    report: Path | None = option(None, "JSON report path (default: runs/eval/<model>-<split>.json)")
    no_record: bool = option(False, "do not write the result to eval_results")
    json: bool = option(False, "print the report (the --report file's JSON) instead of lines")
    no_progress: bool = no_progress_option()


# The trainer scores HellaSwag besides its validation; `dsgpt2 evaluate` scores it instead.
HELLASWAG = {
    "hellaswag": "score HellaSwag instead (llm.c's hellaswag_val.jsonl layout: ctx, four endings, label): "
    "acc by summed, acc_norm by mean ending loss",
    "hellaswag_limit": "only the first N HellaSwag examples",
}


@dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    """``dsgpt2 generate``: the prompts and how the text is printed (how it is sampled:
    :class:`SamplingParams`)."""

    prompts: tuple[str, ...] = option((), "prompt texts", positional=True, metavar="PROMPT")
    prompts_file: Path | None = option(None, "a file with one prompt per line")
    json: bool = option(False, "print JSON lines instead of text")
    stream: bool = option(False, "print the text as it is generated (one sample)")


@dataclass(frozen=True, kw_only=True)
class ChatSettings(Checked):
    """``dsgpt2 chat``: who speaks."""

    user: str = option("user", "the user's speaker name")
    bot: str = option("bot", "the model's speaker name")

    def check(self) -> None:
        if self.user == self.bot:  # the user's turns would read as the model's own
            raise ConfigError(f"--user and --bot are both {self.user!r}; give the two speakers two names")


@dataclass(frozen=True, kw_only=True)
class ServeSettings(Checked):
    """``dsgpt2 serve``: where it listens and who may ask (what a request may ask: :class:`ServeLimits`)."""

    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port", check=PORT)
    shutdown_grace: int = option(
        30,
        "seconds the requests in flight get to finish after Ctrl-C or SIGTERM; then they are cut off",
        check=NON_NEGATIVE_INT,
    )
    api_key: str | None = option(
        None, f"bearer token required of every request but /health (default: ${API_KEY_ENV}, else none)"
    )
    read_timeout: int = option(
        30, "seconds a client has to send a request whole (its head and body) from its first byte; then 408",
        check=POSITIVE_INT,
    )  # fmt: skip
    allow_origin: tuple[str, ...] = option(
        (),
        "a web page's origin whose scripts may call the server from a browser (CORS), e.g. "
        "http://localhost:3000, or * for any (repeatable; default: none)",
        repeat=True,
        metavar="ORIGIN",
    )

    def check(self) -> None:
        from dsgpt2.infer.connections import origin_problem

        for origin in self.allow_origin:
            if (problem := origin_problem(origin)) is not None:
                raise ConfigError(f"--allow_origin {problem}")


def cmd_export(args: argparse.Namespace) -> int:
    from dsgpt2.accelerator import prepare_deepspeed_environment

    # It reads DeepSpeed's checkpoints, and transformers imports DeepSpeed where it is installed: named
    # first, the CPU accelerator is no warning on a machine without a GPU.
    prepare_deepspeed_environment()
    from dsgpt2.checkpoints.copies import readable
    from dsgpt2.infer.export import export

    s = from_namespace(ExportSettings, args)
    ckpt_dir = readable(s.ckpt_dir, s.ckpt_id, s.config, "--ckpt_dir")
    result = export(ckpt_dir, s.out, s.ckpt_id, s.vocab_dir, s.overwrite, db_config=s.config)
    print(
        f"exported {s.ckpt_dir}/{result['tag']} (step {result['step']}, "
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

    source, output = from_namespace(ModelSource, args), from_namespace(EvaluateSettings, args)
    request = from_namespace(EvalRequest, args)
    # --hellaswag and --hellaswag_limit are the trainer's flags, read here as a run reads them.
    trainer = from_namespace(RunOptions, args)
    if output.report is not None:  # before any work; the default path is known once the model is
        inputs = {"--config": output.config, "--model": source.model, "--hellaswag": trainer.hellaswag}
        check_writable(output.report, "--report", inputs)
    examples = None
    if trainer.hellaswag:
        from dsgpt2.model.hellaswag import read_examples

        examples = read_examples(trainer.hellaswag, trainer.hellaswag_limit)
    config = load_connection(output.config)
    if examples is None:
        check_collections(config, request)
    loaded = source.load(output.config)
    split = "hellaswag" if examples else request.split
    path = output.report or default_report_path(loaded.name, split)
    if output.report is None:
        check_writable(path, "--report")
    if examples:
        from dsgpt2.infer.evaluate import hellaswag_report

        report = hellaswag_report(loaded, examples, trainer.hellaswag)
        from dsgpt2.errors import DsGpt2Error
        from dsgpt2.infer.evaluate import contamination

        # Whether the run trained on the set's passages: what `dsgpt2 decontaminate` marked. The score
        # stands without it: a corpus that cannot be read is said, not an error.
        try:
            report["contamination"] = contamination(config, loaded.run, trainer.hellaswag)
        except DsGpt2Error as exc:
            report["contamination"] = {"set": str(trainer.hellaswag), "error": str(exc)}
    else:
        report = evaluate(loaded, config, request, progress=not output.no_progress)
    write_report(report, path)
    if output.json:
        print(json.dumps(report, ensure_ascii=False, default=str))
    else:
        print("\n".join(report_lines(report)))
        print(f"report: {path}")
    if not output.no_record:
        from dsgpt2.db.client import EVAL_RESULTS, connect
        from dsgpt2.db.meta import record_eval

        record_eval(connect(config), report)
        if not output.json:
            print(f"recorded in {config.db}.{EVAL_RESULTS}")
    return 0


# How a sample ended (its finish_reason, as the OpenAI API names it), as the command's last line says it.
_ENDED = {
    "stop": "ended at <|endoftext|> or a stop text",
    "length": "ended at --max_new_tokens",
}


def cmd_generate(args: argparse.Namespace) -> int:
    from dsgpt2.infer.generate import Generator

    s = from_namespace(GenerateSettings, args)
    prompts = list(s.prompts)
    if s.prompts_file:
        path = s.prompts_file
        why = not_a_file(path)
        if why is not None:
            raise usage("generate", f"--prompts_file {path}: {why}; give a file with one prompt per line")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise usage("generate", f"--prompts_file {path}: cannot read it as UTF-8 text ({exc})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise usage("generate", f"--prompts_file {path} holds no prompt (every line is blank)")
    if not prompts:
        raise usage("generate", "give PROMPT arguments or --prompts_file")
    params = from_namespace(SamplingParams, args)
    if s.stream and (s.json or params.num_samples > 1):
        raise usage(
            "generate", "--stream prints one text as it comes: leave out --json and keep --num_samples 1"
        )
    generator = Generator(from_namespace(ModelSource, args).load())

    def write(text: str) -> None:
        print(text, end="", flush=True)

    for prompt in prompts:
        if s.stream:
            write(prompt)
            c = generator.generate(prompt, params, on_text=write)[0]
            print()
            print(f"--- {c.tokens} tokens, {_ENDED.get(c.finish_reason, c.finish_reason)}", file=sys.stderr)
            continue
        completions = generator.generate(prompt, params)
        for i, c in enumerate(completions):
            if s.json:
                print(json.dumps({"prompt": prompt, "sample": i, **vars(c)}, ensure_ascii=False))
            else:
                head = f"[{i + 1}/{len(completions)}] " if len(completions) > 1 else ""
                print(f"{head}{prompt}{c.text}")
                print(
                    f"--- {c.tokens} tokens, {_ENDED.get(c.finish_reason, c.finish_reason)}", file=sys.stderr
                )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from dsgpt2.infer.chat import ChatSession, run_chat
    from dsgpt2.infer.generate import Generator

    s = from_namespace(ChatSettings, args)
    generator = Generator(from_namespace(ModelSource, args).load())
    session = ChatSession(generator, from_namespace(SamplingParams, args), s.user, s.bot)
    interactive = sys.stdin.isatty()

    def lines() -> Any:
        while True:
            if interactive:
                print(f"{s.user}> ", end="", flush=True)
            # Undecodable bytes kept as surrogates whatever the locale: run_chat says so for the line.
            line = sys.stdin.buffer.readline().decode("utf-8", "surrogateescape")
            if not line:
                return
            yield line

    run_chat(session, lines(), interactive, lambda text: print(text, end="", flush=True))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dsgpt2.infer.generate import Generator
    from dsgpt2.infer.serve import make_app, serve
    from dsgpt2.listen import check_bind

    s, limits = from_namespace(ServeSettings, args), from_namespace(ServeLimits, args)
    source = from_namespace(ModelSource, args)
    asked = args.max_new_tokens  # None: not given, and the default request follows --max_tokens_limit
    length = min(SamplingParams().max_new_tokens, limits.max_new_tokens) if asked is None else asked
    if length > limits.max_new_tokens:
        raise usage("serve", f"--max_new_tokens {length} is above --max_tokens_limit")
    params = from_namespace(SamplingParams, args, max_new_tokens=length)
    if s.api_key is not None and not s.api_key.strip():  # `--api_key "$KEY"`, $KEY unset: not an open server
        raise usage("serve", "--api_key is empty; give a key, or leave the flag out to serve without one")
    api_key = s.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and API_KEY_ENV in os.environ:  # set empty: as unset (an env file's way), but said
        log.warning("$%s is set but empty: serving without an API key", API_KEY_ENV)
    check_bind(s.host, s.port)  # a busy port said now, not after the model has loaded
    started = time.monotonic()
    log.info("loading the model %s (the server answers once it is loaded)", source.model)
    app = make_app(
        Generator(source.load()), limits, params, api_key, name=source.model, origins=s.allow_origin
    )
    log.info("model loaded in %.1f s", time.monotonic() - started)
    serve(app, s.host, s.port, authenticated=api_key is not None, grace=s.shutdown_grace,
          read_timeout=s.read_timeout)  # fmt: skip
    return 0


EXPORT = Command(
    "export",
    help="turn a training checkpoint into a Hugging Face model directory",
    description="Export a checkpoint (any ZeRO stage) as safetensors weights, config and tokenizer: the "
    "directory loads with transformers' GPT2LMHeadModel.from_pretrained and "
    "pipeline('text-generation'), without dsgpt2.",
    settings=(ExportSettings,),
    handler=cmd_export,
)


EVALUATE = Command(
    "evaluate",
    help="loss, perplexity and bits per byte of a model on the validation split or any collection",
    description="Evaluate a checkpoint or an exported model: mean loss per token, perplexity and bits per "
    "byte (comparable across tokenizers) over every block of a split, made as in training. By default "
    "the validation split of the run that trained the model (its collections, split seed and ratio, "
    "context and task). Writes a JSON report and records the result in the eval_results collection of "
    "the database.",
    epilog="examples:\n"
    "  dsgpt2 evaluate --model runs/model --config configs/mongo.json\n"
    "  dsgpt2 evaluate --model runs/ckpt --config c.json --collection news --split all",
    settings=(
        ModelSource,
        Flags(EvaluateSettings, only=["config"]),
        EvalRequest,
        Flags(RunOptions, only=list(HELLASWAG), helps=HELLASWAG),
        Flags(EvaluateSettings, only=["report", "no_record", "json", "no_progress"]),
    ),
    handler=cmd_evaluate,
)


GENERATE = Command(
    "generate",
    help="sample text from a checkpoint or an exported model",
    description="Continue each prompt (from the arguments, or one per line of --prompts_file) with "
    "sampled text; generation stops at end-of-text or --max_new_tokens. The same seed, "
    "prompt and model give the same text.",
    settings=(
        ModelSource,
        GenerateSettings,
        Flags(SamplingParams, only=[*SAMPLING, "num_samples"], group="sampling"),
    ),
    handler=cmd_generate,
)


CHAT = Command(
    "chat",
    help="talk with a conversation-finetuned model (stdin, interactive or piped)",
    description="Read a line, answer it, keep the dialogue within the model's context (oldest turns go "
    "first). /reset forgets the conversation, /quit ends it. Works from a pipe: one answer "
    "per input line.",
    settings=(
        ModelSource,
        ChatSettings,
        Flags(SamplingParams, only=SAMPLING, group="sampling"),
    ),
    handler=cmd_chat,
)


SERVE_LIMITS = ["max_prompt_chars", "max_new_tokens", "max_concurrent", "max_batch", "max_sequences",
                "max_body_bytes"]  # fmt: skip
SERVE = Command(
    "serve",
    help="serve generation over HTTP: the OpenAI API (/v1/...) and GET/POST /generate",
    description="An HTTP server: the OpenAI API (POST /v1/completions, POST /v1/chat/completions, "
    "GET /v1/models; streamed as server-sent events with stream: true), GET "
    "/generate?sentence=TEXT and POST /generate with a JSON body "
    '{"prompt": TEXT, "max_new_tokens": N, "temperature": T, ...}; GET /health. Concurrent '
    "requests are decoded together in one batch. Bad parameters get 400 with the reason. "
    "Bound to 127.0.0.1 unless --host says otherwise; --api_key (or $DSGPT2_API_KEY) makes "
    "every request but /health carry 'Authorization: Bearer KEY'.",
    settings=(
        ModelSource,
        Flags(ServeSettings, only=["host", "port"]),
        Flags(
            ServeLimits,
            only=SERVE_LIMITS,
        ),
        Flags(ServeSettings, only=["api_key", "shutdown_grace", "read_timeout", "allow_origin"]),
        # Serving: the default request's length follows --max_tokens_limit (at most 64) unless given.
        Flags(SamplingParams, only=SAMPLING, defaults={"max_new_tokens": None}, group="sampling"),
    ),
    handler=cmd_serve,
)
