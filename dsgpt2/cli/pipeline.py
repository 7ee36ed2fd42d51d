"""``dsgpt2 demo``: the whole pipeline in one process on the built-in sample corpus.

Runs on the embedded database in ``OUT/db`` (``local://``, started for the demo and stopped after
it), so it needs no server and no download; or, given a connection config, against that server (in
its own collections of the config's database). Each stage logs what it did; the
summary is printed at the end and written to ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import config_option, no_progress_option, verbose_option
from dsgpt2.corpus.ingest import ingest
from dsgpt2.corpus.readers import builtin_source
from dsgpt2.db import embedded
from dsgpt2.db.client import Connection, connect
from dsgpt2.db.config import MongoConfig, config_from_dict
from dsgpt2.db.validate import require_valid
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.settings.options import POSITIVE_INT, Checked, from_namespace, option
from dsgpt2.settings.shipped import shipped_config, shipped_config_named
from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
from dsgpt2.tokenizer.texts import download, shard_texts

log = logging.getLogger(__name__)

DEMO_DB = "dsgpt2_demo"
DEMO_COLLECTION = "stdlib"
CHAT_COLLECTION = "stdlib_chat"
DEMO_VOCAB_SIZE = 8192  # small: the demo model's embedding stays cheap on a CPU
STAGES = 10
# The pretraining recipe (model, split, steps, optimizer, learning rate, DeepSpeed config, evaluations):
# the tiny preset reaches a validation perplexity of about 110 with Muon (190 with AdamW alone) on two
# cores (the untrained model is at ~8,200, the sample's unigram distribution at ~950). It ships as an
# experiment file, and the demo reads it from there.
DEMO_RECIPE = "recipes/demo.yaml"
CHAT_STEPS = 150
PROMPT = "Return a new list"
QUESTION = "What does `json.dumps` do?"


@dataclass(frozen=True, kw_only=True)
class DemoSettings(Checked):
    """``dsgpt2 demo``: where, against which database, and how long."""

    out: Path = option(Path("runs/demo"), "output directory")
    config: str | None = config_option(
        "run against this MongoDB server and database instead (the demo's own collections there: "
        f"{DEMO_COLLECTION}, {CHAT_COLLECTION})",
        required=False,
    )
    limit: int | None = option(None, "only the first N sample documents", check=POSITIVE_INT)
    steps: int | None = option(
        None, f"training steps (default: train_iters of configs/{DEMO_RECIPE})", check=POSITIVE_INT
    )
    chat_steps: int = option(CHAT_STEPS, "conversation finetuning steps", check=POSITIVE_INT)
    no_progress: bool = no_progress_option("no progress bars")
    verbose: bool = verbose_option()


@functools.cache
def demo_recipe() -> argparse.Namespace:
    """The pretraining recipe (configs/recipes/demo.yaml, as shipped) read as ``dsgpt2 train --config``
    reads it: every trainer flag, the file's values over the defaults. Its paths are the checkout's;
    the demo puts its own in their place."""
    from dsgpt2.settings.runfile import parse_args
    from dsgpt2.train.config import TRAIN_ALIASES, trainer_parser

    argv = ["--config", str(shipped_config(DEMO_RECIPE))]
    return parse_args(trainer_parser(), argv, command=["train"], sections=None, aliases=TRAIN_ALIASES)


def run_demo(
    out: Path,
    limit: int | None = None,
    progress: bool = True,
    steps: int | None = None,
    chat_steps: int = CHAT_STEPS,
    *,
    server: MongoConfig | None = None,
) -> dict[str, Any]:
    """Run every stage on the sample corpus; return the summary.

    Args:
        out: directory for the outputs and ``summary.json``.
        limit: only the first ``limit`` sample documents and conversations (quicker runs).
        progress: show progress bars.
        steps: training steps (None: the recipe's).
        chat_steps: conversation finetuning steps.
        server: run against this server and database (in the demo's own collections) instead of
            the embedded database in ``out/db``.
    """
    out.mkdir(parents=True, exist_ok=True)
    steps = steps or demo_recipe().train_iters
    if server is not None:
        return _run_demo(
            out, limit, progress, steps, chat_steps, config=server.with_collections([DEMO_COLLECTION])
        )
    database = out.resolve() / "db"
    config = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": f"{embedded.PREFIX}{database}",
            "MONGO_CONNECTION_DB": DEMO_DB,
            "COLLECTIONS": [DEMO_COLLECTION],
        },
        env={},
    )
    try:
        conn = connect(config)
        conn.client.drop_database(DEMO_DB)  # the demo's own database: every demo starts from nothing
        return _run_demo(out, limit, progress, steps, chat_steps, config=config, conn=conn)
    finally:
        embedded.stop(database)


def _run_demo(
    out: Path,
    limit: int | None,
    progress: bool,
    steps: int,
    chat_steps: int,
    *,
    config: MongoConfig,
    conn: Connection | None = None,
) -> dict[str, Any]:
    conn = conn or connect(config)
    summary: dict[str, Any] = {"database": f"{config.display_uri} / {config.db}", "db": config.db}

    log.info(f"stage 1/{STAGES}: ingest the sample corpus (Python standard library documentation)")
    report = ingest(conn, DEMO_COLLECTION, [builtin_source("stdlib", limit)], progress=progress)
    summary["ingest"] = {
        "documents": report.count,
        "skipped": dict(report.sources[0].skipped),
        "seconds": round(report.seconds, 2),
    }

    log.info(f"stage 2/{STAGES}: validate idx, index and counts")
    require_valid(conn)
    summary["validate"] = "ok"

    log.info(f"stage 3/{STAGES}: read the corpus back through the MongoWrapper, 1000 documents per query")
    summary["read"] = _read_back(config, conn)

    log.info(f"stage 4/{STAGES}: export the vocabulary corpus to shards (2 worker processes)")
    summary["vocab_download"], summary["vocab"] = _vocabulary(config, out, progress)

    log.info(f"stage 6/{STAGES}: validation perplexity of the untrained model")
    summary["eval_before"] = _evaluate_untrained(config, conn, out / "tokenizer", progress)

    preset = demo_recipe().model_select
    log.info(f"stage 7/{STAGES}: train the {preset} GPT-2 preset with DeepSpeed on the CPU ({steps} steps)")
    summary["train"] = _train(config, out, steps, "train", vocab_dir=out / "tokenizer", pretrain=True)
    summary["train"]["preset"] = preset

    log.info(f"stage 8/{STAGES}: export the last checkpoint as a Hugging Face model; evaluate it")
    from dsgpt2.infer.export import export

    exported = export(out / "ckpt", out / "model", overwrite=True)
    summary["export"] = {"dir": exported["out"], "step": exported["step"]}
    summary["eval_after"] = _evaluate(out / "model", config, conn, progress)
    summary["sample"] = _sample(out / "model")

    summary["chat_ingest"], summary["chat"] = _chat_stages(
        config, conn, out, limit, chat_steps, progress=progress
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _read_back(config: MongoConfig, conn: Connection) -> dict[str, Any]:
    """Read every document back as training does: 1,000 per query."""
    wrapper = MongoWrapper(config, connection=conn)
    start = time.monotonic()
    docs = chars = 0
    for chunk in wrapper.iter_range(chunk=1000):
        docs += len(chunk)
        chars += sum(len(d.text) for d in chunk)
    seconds = time.monotonic() - start
    return {
        "documents": docs,
        "megabytes": round(chars / 1e6, 2),
        "queries": wrapper.total_queries,
        "queries_per_1000_docs": round(wrapper.total_queries / max(docs / 1000, 1e-9), 2),
        "skipped": dict(wrapper.skipped),
        "seconds": round(seconds, 2),
    }


def _vocabulary(config: MongoConfig, out: Path, progress: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stages 4 and 5: the vocabulary corpus in shards, then the BPE tokenizer trained on them."""
    shards = download(config, out / "vocab_corpus", workers=2, progress=progress)
    log.info(f"stage 5/{STAGES}: train the byte-level BPE tokenizer ({DEMO_VOCAB_SIZE} tokens)")
    vocab = train_vocab(
        shard_texts(out / "vocab_corpus"),
        out / "tokenizer",
        VocabSettings(vocab_size=DEMO_VOCAB_SIZE),
        source=f"shards in {out / 'vocab_corpus'}",
        progress=progress,
        overwrite=True,  # each demo trains afresh, its model too
    )
    return (
        {"shards": shards.shards, "documents": shards.documents, "dir": str(shards.out)},
        {
            "vocab_size": vocab.vocab_size,
            "seconds": round(vocab.seconds, 2),
            "dir": str(vocab.out),
            "example": _tokenize_example(vocab.out),
        },
    )


def _chat_stages(
    config: MongoConfig, conn: Connection, out: Path, limit: int | None, steps: int, *, progress: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stages 9 and 10: the conversation sample, finetuning on its replies, one exchange."""
    from dsgpt2.infer.export import export

    log.info(f"stage 9/{STAGES}: ingest the conversation sample (questions about the stdlib's API)")
    chat_config = replace(config, collections=(CHAT_COLLECTION,))
    report = ingest(conn, CHAT_COLLECTION, [builtin_source("stdlib-chat", limit)], progress=progress)
    log.info(f"stage 10/{STAGES}: finetune on the replies ({steps} steps), export, chat")
    chat = {"reply_loss_before": _evaluate(out / "model", chat_config, conn, progress, "conversation")}
    chat["train"] = _train(chat_config, out, steps, "chat", init_from=out / "model", task="conversation")
    export(out / "chat" / "ckpt", out / "chat_model", overwrite=True)
    chat["reply_loss_after"] = _evaluate(out / "chat_model", chat_config, conn, progress, "conversation")
    chat["dir"] = str(out / "chat_model")
    chat["exchange"] = _chat(out / "chat_model")
    return {"conversations": report.count}, chat


def _evaluate_untrained(config: Any, conn: Connection, tokenizer: Path, progress: bool) -> dict[str, Any]:
    """The same architecture before any step: the perplexity training starts from."""
    import torch

    from dsgpt2.infer.loading import LoadedModel
    from dsgpt2.model.gpt2 import PRESETS, build_model, gpt2_config
    from dsgpt2.tokenizer.bpe import EOT, PAD, load_tokenizer

    recipe = demo_recipe()
    preset, context = recipe.model_select, PRESETS[recipe.model_select].context
    tok = load_tokenizer(tokenizer)
    torch.manual_seed(recipe.seed)
    model = build_model(
        gpt2_config(preset, tok.get_vocab_size(), context, tok.token_to_id(EOT), tok.token_to_id(PAD))
    )
    fp = {"context": context, "tr_ratio": recipe.tr_ratio, "seed": recipe.seed}
    loaded = LoadedModel(model.eval(), tokenizer, f"untrained {preset}", {"step": 0, "fingerprint": fp})
    return _evaluate_loaded(loaded, config, conn, progress)


def _evaluate(
    model: Path, config: Any, conn: Connection, progress: bool, task: str | None = None
) -> dict[str, Any]:
    from dsgpt2.infer.loading import load_model

    return _evaluate_loaded(load_model(model), config, conn, progress, task)


def _evaluate_loaded(
    loaded: Any, config: Any, conn: Connection, progress: bool, task: str | None = None
) -> dict[str, Any]:
    from dsgpt2.db.meta import record_eval
    from dsgpt2.infer.evaluate import EvalRequest, evaluate

    report = evaluate(loaded, config, EvalRequest(task=task, workers=0), progress=progress)
    record_eval(conn, report)
    m = report["metrics"]
    bpb = round(m["bpb"], 3) if m["bpb"] is not None else None
    return {
        "loss": round(m["loss"], 4),
        "perplexity": round(m["perplexity"], 1),
        "bpb": bpb,
        "tokens": m["tokens"],
    }


def _sample(model: Path) -> dict[str, Any]:
    from dsgpt2.infer.generate import Generator, SamplingParams
    from dsgpt2.infer.loading import load_model

    (c,) = Generator(load_model(model)).generate(PROMPT, SamplingParams(max_new_tokens=40, seed=0))
    return {"prompt": PROMPT, "text": c.text, "tokens": c.tokens}


def _chat(model: Path) -> dict[str, str]:
    from dsgpt2.infer.chat import ChatSession
    from dsgpt2.infer.generate import Generator, SamplingParams
    from dsgpt2.infer.loading import load_model

    session = ChatSession(Generator(load_model(model)), SamplingParams(max_new_tokens=40, seed=0))
    return {"user": QUESTION, "bot": session.reply(QUESTION)}


def _train(
    config: Any, out: Path, steps: int, name: str, pretrain: bool = False, **model: Any
) -> dict[str, Any]:
    """Train in process (see :func:`train_config`)."""
    from dsgpt2.train.metrics import read_metrics
    from dsgpt2.train.trainer import build as build_trainer

    run = out if name == "train" else out / name
    run.mkdir(parents=True, exist_ok=True)
    # Each demo trains afresh: the checkpoints of an earlier demo in this directory go.
    shutil.rmtree(run / "ckpt", ignore_errors=True)
    cfg = train_config(run, steps, pretrain, **model)
    trainer = build_trainer(cfg, mongo=config)
    result = trainer.train()
    records = read_metrics(run / "train" / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval" and "val_ppl" in r]
    return {
        "steps": result["step"],
        "tokens": result["tokens"],
        "tokens_per_s": round(result["tokens_per_s"]),
        "val_ppl_first": round(evals[0]["val_ppl"], 1) if evals else None,
        "val_ppl_first_step": evals[0]["step"] if evals else None,
        "val_ppl": round(result["val_ppl"], 1) if result["val_ppl"] else None,
        "val_bpb": round(result["val_bpb"], 3) if result["val_bpb"] else None,
        "plot": result.get("plot"),
        "checkpoint": result["checkpoint"],
    }


def train_config(run: Path, steps: int, pretrain: bool = False, **model: Any) -> Any:
    """A demo training run's configuration, in ``run``: the recipe's split, and its evaluations and
    checkpoints spread over ``steps``; ``pretrain``: the recipe's model, schedule, optimizer and DeepSpeed
    config (as shipped) too, else the shipped CPU config's and AdamW. ``model``: ModelOptions fields, and
    ``vocab_dir`` (default: the ``init_from`` model's). No connection config file: the demo hands its
    connection config to the trainer's build."""
    from dsgpt2.train.config import (
        CheckpointOptions,
        DataOptions,
        EngineOptions,
        ModelOptions,
        OptimizerOptions,
        RunOptions,
        ScheduleOptions,
        TrainConfig,
    )

    vocab_dir = model.pop("vocab_dir", None)
    recipe = demo_recipe()
    ds_config = shipped_config("ds_config_cpu.json")
    # Finetuning on conversations: AdamW under the CPU config's scheduler, as the demo has always done,
    # ending on its last step's weights.
    model_options, schedule = ModelOptions(**model), ScheduleOptions(lr_schedule="deepspeed")
    optim = OptimizerOptions(optimizer="adamw")
    if pretrain:
        ds_config = shipped_config_named(recipe.deepspeed_config)
        model_options = from_namespace(ModelOptions, recipe, **model)
        warmup = recipe.warmup_iters if recipe.warmup_iters is None else min(recipe.warmup_iters, steps // 4)
        schedule = from_namespace(ScheduleOptions, recipe, warmup_iters=warmup)
        optim = from_namespace(OptimizerOptions, recipe)
    # As many evaluations and checkpoints as the recipe makes, over this run's steps.
    evals, saves = recipe.train_iters // recipe.eval_interval, recipe.train_iters // recipe.save_interval
    every_eval, every_save = max(1, steps // evals), max(1, steps // saves)
    return TrainConfig(
        data=from_namespace(DataOptions, recipe, config_train=None, vocab_dir=vocab_dir),
        model=model_options,
        run=from_namespace(
            RunOptions,
            recipe,
            train_iters=steps,
            eval_interval=every_eval,
            workspace=run / "train",
            ema_tail=recipe.ema_tail if pretrain else 0,  # the tail average: pretraining's
        ),
        ckpt=from_namespace(
            CheckpointOptions, recipe, ckpt_dir=run / "ckpt", save_interval=every_save, no_resume=True
        ),
        schedule=schedule,
        optim=optim,
        engine=EngineOptions(deepspeed_config=ds_config),
    )


def _tokenize_example(directory: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    text = "Return a new list containing all items from the iterable in ascending order."
    pieces = tok.convert_ids_to_tokens(tok(text).input_ids)
    return {"text": text, "tokens": len(pieces), "pieces": [p.replace("Ġ", "_") for p in pieces]}


def summary_lines(summary: dict[str, Any], out: Path) -> list[str]:
    ing, read, train = summary["ingest"], summary["read"], summary["train"]
    before, after, chat = summary["eval_before"], summary["eval_after"], summary["chat"]
    skipped = ing["skipped"] or "none"
    vocab = summary["vocab"]
    return [
        "",
        "dsgpt2 demo: summary",
        f"  database      {summary['database']}",
        f"  corpus        {ing['documents']:,} documents, {read['megabytes']} MB of text "
        f"(ingested in {ing['seconds']}s, skipped: {skipped})",
        f"  read back     {read['documents']:,} documents in {read['seconds']}s, "
        f"{read['queries_per_1000_docs']} queries per 1000 documents",
        f"  vocabulary    {vocab['vocab_size']:,} tokens in {vocab['dir']} (trained in {vocab['seconds']}s "
        f"from {summary['vocab_download']['shards']} shards)",
        f"  example       {vocab['example']['text']!r}",
        f"                → {vocab['example']['tokens']} tokens: {' '.join(vocab['example']['pieces'])}",
        f"  training      {train['steps']} steps, {train['tokens']:,} tokens, "
        f"{train['tokens_per_s']:,} tokens/s ({train['preset']} preset, DeepSpeed on the CPU)",
        f"  validation    perplexity {before['perplexity']:,} untrained → {after['perplexity']:,} after "
        f"{train['steps']} steps ({after['tokens']:,} tokens, the whole validation split; uniform guess: "
        f"{vocab['vocab_size']:,})",
        f"                bits per byte {before['bpb']} untrained → {after['bpb']} (unlike perplexity, "
        "comparable across tokenizers)",
        f"  sample        {summary['sample']['prompt']}{summary['sample']['text']!r}",
        f"  loss plot     {train['plot']}",
        f"  model         {summary['export']['dir']} (loads with transformers' from_pretrained)",
        f"  chat          {summary['chat_ingest']['conversations']:,} conversations, "
        f"{chat['train']['steps']} finetuning steps: reply loss {chat['reply_loss_before']['loss']} → "
        f"{chat['reply_loss_after']['loss']}",
        f"                user: {chat['exchange']['user']}",
        f"                bot:  {chat['exchange']['bot']}",
        f"  chat model    {chat['dir']} (try: dsgpt2 chat --model {chat['dir']})",
        f"  outputs       {out}/summary.json; evaluations recorded in {summary['db']}.eval_results",
    ]
