"""``dsgpt2 demo``: the whole pipeline in one process on the built-in sample corpus.

Runs on an in-process mongomock database, so it needs no server and no
download. Each stage logs what it did; the summary is printed at the end and
written to ``OUT/summary.json``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from dsgpt2.config import config_from_dict
from dsgpt2.ingest import ingest, sample_source
from dsgpt2.mongo import Connection, MongoWrapper
from dsgpt2.validate import require_valid
from dsgpt2.vocab import VocabSettings, download, shard_texts, train_vocab

log = logging.getLogger(__name__)

DEMO_DB = "dsgpt2_demo"
DEMO_COLLECTION = "stdlib"
DEMO_VOCAB_SIZE = 8192  # small: the demo model's embedding stays cheap on a CPU
STAGES = 7
DEMO_STEPS = 300


def run_demo(
    out: Path, limit: int | None = None, progress: bool = True, steps: int = DEMO_STEPS
) -> dict[str, Any]:
    """Run every stage on the sample corpus; return the summary.

    Args:
        out: directory for the outputs and ``summary.json``.
        limit: only the first ``limit`` sample documents (quicker runs).
        progress: show progress bars.
        steps: training steps.
    """
    out.mkdir(parents=True, exist_ok=True)
    config = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": "mongomock://",
            "MONGO_CONNECTION_DB": DEMO_DB,
            "COLLECTIONS": [DEMO_COLLECTION],
        },
        env={},
    )
    conn = Connection(config)
    summary: dict[str, Any] = {"database": f"{config.display_uri} / {DEMO_DB}"}

    log.info(f"stage 1/{STAGES}: ingest the sample corpus (Python standard library documentation)")
    report = ingest(conn, DEMO_COLLECTION, [sample_source("stdlib", limit)], progress=progress)
    summary["ingest"] = {
        "documents": report.count,
        "skipped": dict(report.sources[0].skipped),
        "seconds": round(report.seconds, 2),
    }

    log.info(f"stage 2/{STAGES}: validate idx, index and counts")
    require_valid(conn)
    summary["validate"] = "ok"

    log.info(f"stage 3/{STAGES}: read the corpus back through the MongoWrapper, 1000 documents per query")
    wrapper = MongoWrapper(config, connection=conn)
    start = time.monotonic()
    docs = chars = 0
    for chunk in wrapper.iter_range(chunk=1000):
        docs += len(chunk)
        chars += sum(len(d.text) for d in chunk)
    seconds = time.monotonic() - start
    summary["read"] = {
        "documents": docs,
        "megabytes": round(chars / 1e6, 2),
        "queries": wrapper.total_queries,
        "queries_per_1000_docs": round(wrapper.total_queries / max(docs / 1000, 1e-9), 2),
        "skipped": dict(wrapper.skipped),
        "seconds": round(seconds, 2),
    }

    log.info(f"stage 4/{STAGES}: export the vocabulary corpus to shards (2 worker processes)")
    shards = download(config, out / "vocab_corpus", workers=2, progress=progress)
    summary["vocab_download"] = {
        "shards": shards.shards,
        "documents": shards.documents,
        "dir": str(shards.out),
    }

    log.info(f"stage 5/{STAGES}: train the byte-level BPE tokenizer ({DEMO_VOCAB_SIZE} tokens)")
    vocab = train_vocab(
        shard_texts(out / "vocab_corpus"),
        out / "tokenizer",
        VocabSettings(vocab_size=DEMO_VOCAB_SIZE),
        source=f"shards in {out / 'vocab_corpus'}",
        progress=progress,
    )
    summary["vocab"] = {
        "vocab_size": vocab.vocab_size,
        "seconds": round(vocab.seconds, 2),
        "dir": str(vocab.out),
        "example": _tokenize_example(vocab.out),
    }

    log.info(f"stage 6/{STAGES}: train the tiny GPT-2 preset with DeepSpeed on the CPU ({steps} steps)")
    summary["train"] = _train(config, out, steps)

    log.info(f"stage 7/{STAGES}: export the last checkpoint as a Hugging Face model")
    from dsgpt2.export import export

    exported = export(out / "ckpt", out / "model")
    summary["export"] = {"dir": exported["out"], "step": exported["step"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _train(config: Any, out: Path, steps: int) -> dict[str, Any]:
    from dsgpt2.metrics import read_metrics
    from dsgpt2.train_args import parse
    from dsgpt2.trainer import Trainer

    (out / "mongo.json").write_text(json.dumps(config.to_dict()))
    args = parse(
        [
            "--deepspeed_config",
            str(Path(__file__).resolve().parents[1] / "configs" / "ds_config_cpu.json"),
            "--config_train",
            str(out / "mongo.json"),
            "--vocab_dir",
            str(out / "tokenizer"),
            "--model_select",
            "tiny",
            "--train_iters",
            str(steps),
            "--tr_ratio",
            "0.95",
            "--eval_interval",
            str(max(1, steps // 6)),
            "--eval_iters",
            "8",
            "--save_interval",
            str(max(1, steps // 3)),
            "--ckpt_dir",
            str(out / "ckpt"),
            "--workspace",
            str(out / "train"),
            "--wandb",
            "off",
            "--no_resume",
        ]
    )
    trainer = Trainer(args)
    trainer.build()
    result = trainer.train()
    evals = [r for r in read_metrics(out / "train" / "metrics.jsonl") if r["event"] == "eval"]
    return {
        "steps": result["step"],
        "tokens": result["tokens"],
        "tokens_per_s": round(result["tokens_per_s"]),
        "val_ppl_first": round(evals[0]["val_ppl"], 1) if evals else None,
        "val_ppl_first_step": evals[0]["step"] if evals else None,
        "val_ppl": round(result["val_ppl"], 1) if result["val_ppl"] else None,
        "plot": result.get("plot"),
        "checkpoint": result["checkpoint"],
    }


def _tokenize_example(directory: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    text = "Return a new list containing all items from the iterable in ascending order."
    pieces = tok.convert_ids_to_tokens(tok(text).input_ids)
    return {"text": text, "tokens": len(pieces), "pieces": [p.replace("Ġ", "_") for p in pieces]}


def summary_lines(summary: dict[str, Any], out: Path) -> list[str]:
    ing, read = summary["ingest"], summary["read"]
    skipped = ing["skipped"] or "none"
    return [
        "",
        "dsgpt2 demo: summary",
        f"  database      {summary['database']}",
        f"  ingest        {ing['documents']} documents in {ing['seconds']}s, skipped: {skipped}",
        f"  validate      {summary['validate']}",
        f"  read back     {read['documents']} documents, {read['megabytes']} MB of text "
        f"in {read['seconds']}s, {read['queries_per_1000_docs']} queries per 1000 documents",
        f"  vocab shards  {summary['vocab_download']['shards']} shards, "
        f"{summary['vocab_download']['documents']} documents in {summary['vocab_download']['dir']}",
        f"  tokenizer     {summary['vocab']['vocab_size']} tokens in {summary['vocab']['dir']} "
        f"(trained in {summary['vocab']['seconds']}s)",
        f"  example       {summary['vocab']['example']['text']!r}",
        f"                → {summary['vocab']['example']['tokens']} tokens: "
        f"{' '.join(summary['vocab']['example']['pieces'])}",
        f"  training      {summary['train']['steps']} steps, {summary['train']['tokens']:,} tokens, "
        f"{summary['train']['tokens_per_s']:,} tokens/s (tiny preset, CPU)",
        f"  validation    perplexity {summary['train']['val_ppl_first']} at step "
        f"{summary['train']['val_ppl_first_step']} → {summary['train']['val_ppl']} at the end "
        f"(uniform guess: {summary['vocab']['vocab_size']})",
        f"  loss plot     {summary['train']['plot']}",
        f"  checkpoint    {summary['train']['checkpoint']}",
        f"  model         {summary['export']['dir']} (loads with transformers' from_pretrained)",
        f"  outputs       {out}/summary.json",
    ]
