"""Recipe: does the fast recipe (``configs/recipes/fast.yaml``: Muon, the default optimizer) train a better
model than the AdamW one (``configs/recipes/adamw.yaml``) for the same compute?

Both recipes as shipped (their optimizer, schedule and rates), on the same documents, tokenizer, batch,
tokens and seeds; the held-out documents are the validation split (never trained on), validated every
``STEPS / 20`` steps on the same batches. Per corpus and shape:

- held-out perplexity at equal steps, fast ÷ AdamW (geometric mean over the seeds; target <= 0.9);
- the steps the fast recipe needs to reach AdamW's final held-out loss ÷ AdamW's steps (per seed, linear
  between two validations, the mean; where it never does: above 1, and the line says so; target <= 0.7);
- wall time per step, fast ÷ AdamW (median tokens/s of the logged steps; Newton–Schulz costs compute).

Two corpora of real text: the built-in sample (the standard library's docstrings and code) and reference
prose built from files every Python installation has (the language reference of ``pydoc_data``; the
licences of ``/usr/share/common-licenses`` where the machine has them). Two shapes: the tiny preset and
a wider one (4 layers of 128) that still trains on two cores in minutes.

``BENCH_RECIPE_STEPS`` (1,000), ``BENCH_RECIPE_SEEDS`` (1,2,3), ``BENCH_RECIPE_SHAPES`` (tiny,wide) and
``BENCH_RECIPE_CORPORA`` (stdlib,prose) choose a shorter run: the whole is 24 trainings (about an hour
and a half on two cores).

A screen of the fast recipe's options: ``BENCH_RECIPE_VARIANTS`` names variants, each the fast recipe with
flags typed after it (``polar=--muon_ns polar_express|all=--muon_ns polar_express --muon_cautious``), each
measured as the fast recipe is, against AdamW and against the fast recipe as shipped.
``BENCH_RECIPE_REUSE=1`` reads back a training whose run folder holds its result (``result.json``) rather
than training it again: two processes (each one thread, ``OMP_NUM_THREADS=1``) given other seeds share
the work, and a last one with every seed prints the table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Metric

STEPS = int(os.environ.get("BENCH_RECIPE_STEPS", "1000"))
SEEDS = tuple(int(s) for s in os.environ.get("BENCH_RECIPE_SEEDS", "1,2,3").split(","))
SHAPES = tuple(os.environ.get("BENCH_RECIPE_SHAPES", "tiny,wide").split(","))
CORPORA = tuple(os.environ.get("BENCH_RECIPE_CORPORA", "stdlib,prose").split(","))
RECIPES = {"adamw": "adamw.yaml", "fast": "fast.yaml"}
VARIANTS = {
    name.strip(): tuple(flags.split())
    for name, _, flags in (
        v.partition("=") for v in os.environ.get("BENCH_RECIPE_VARIANTS", "").split("|") if v
    )
}
if taken := sorted(set(VARIANTS) & set(RECIPES)):
    raise SystemExit(
        f"BENCH_RECIPE_VARIANTS: {', '.join(taken)}: a shipped recipe's name; name the variant otherwise"
    )
REUSE = os.environ.get("BENCH_RECIPE_REUSE") == "1"
WIDE = {
    "n_layer": 4,
    "n_embd": 128,
    "n_head": 4,
    "n_positions": 128,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
EVALS = 20


def prose_texts(limit: int = 4000) -> list[str]:
    """Documents of prose from files on this machine: paragraphs of Python's language reference
    (``pydoc_data.topics``), of the descriptions (READMEs) of the installed packages and of the licences
    in /usr/share/common-licenses, joined into documents of about 1,500 characters (code blocks and
    lines shorter than a sentence left out)."""
    import importlib.metadata
    import pydoc_data.topics

    sources = list(pydoc_data.topics.topics.values())
    described = {
        d.metadata["Name"]: d.metadata.get_payload() or "" for d in importlib.metadata.distributions()
    }
    sources += [re.sub(r"```.*?```", "", described[name], flags=re.S) for name in sorted(described)]
    licences = Path("/usr/share/common-licenses")
    if licences.is_dir():
        sources += [p.read_text(errors="replace") for p in sorted(licences.iterdir()) if p.is_file()]
    docs: list[str] = []
    for text in sources:
        current: list[str] = []
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if len(para) < 40:
                continue
            current.append(para)
            if sum(map(len, current)) >= 1500:
                docs.append("\n\n".join(current))
                current = []
        if current:
            docs.append("\n\n".join(current))
    return docs[:limit]


def _recipe(name: str) -> Any:
    """The recipe ``name`` as parsed: a shipped one, or a variant (the fast recipe and its flags)."""
    from dsgpt2.settings.runfile import parse_args
    from dsgpt2.settings.shipped import shipped_config
    from dsgpt2.train.config import TRAIN_ALIASES, trainer_parser

    path = Path(shipped_config(f"recipes/{RECIPES.get(name, RECIPES['fast'])}"))
    argv = ["--config", str(path), *VARIANTS.get(name, ())]
    return parse_args(trainer_parser(), argv, command=["train"], sections=None, aliases=TRAIN_ALIASES)


def _ds_config(path: str) -> Path:
    """A recipe's DeepSpeed config: a shipped one (``configs/...``) wherever dsgpt2 is installed, else
    the file a variant names."""
    from dsgpt2.settings.shipped import shipped_config_named

    return shipped_config_named(path) if Path(path).parts[0] == "configs" else Path(path)


def _train(store: str, recipe: str, shape: str, seed: int, tokenizer: Path, run: Path) -> dict[str, Any]:
    """One training of ``recipe`` (as shipped, for STEPS steps): its validation losses by step, its final
    validation bits per byte and its median tokens/s."""
    from dsgpt2.db.config import config_from_dict
    from dsgpt2.settings.options import from_namespace
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
    from dsgpt2.train.metrics import read_metrics
    from dsgpt2.train.trainer import build

    r = _recipe(recipe)
    # What a result to reuse must be of: the steps, the flags, and the recipe's options as parsed now
    # (a shipped recipe that changed since is trained again).
    options = {
        k: v
        for k, v in sorted(vars(r).items())
        if k != "config" and isinstance(v, (bool, int, float, str, type(None)))
    }
    made = {"steps": STEPS, "flags": list(VARIANTS.get(recipe, ())), "options": options}
    if REUSE and (run / "result.json").exists():
        got = json.loads((run / "result.json").read_text())
        if {k: got.get(k) for k in made} == made:
            return {**got, "evals": {int(k): v for k, v in got["evals"].items()}}
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    mongo = config_from_dict({"MONGO_CONNECTION_STRING": store, "MONGO_CONNECTION_DB": "recipe",
                              "COLLECTIONS": ["docs"]}, env={})  # fmt: skip
    model: dict[str, Any] = {"model_select": "tiny"}
    if shape == "wide":
        (run / "model.json").write_text(json.dumps({"model_type": "gpt2", **WIDE}))
        model = {"model_config": run / "model.json"}
    warmup = min(r.warmup_iters, STEPS // 4) if r.warmup_iters is not None else None
    cfg = TrainConfig(
        data=from_namespace(DataOptions, r, config_train=None, vocab_dir=tokenizer, seed=seed),
        model=from_namespace(ModelOptions, r, **model),
        run=from_namespace(
            RunOptions,
            r,
            train_iters=STEPS,
            eval_interval=max(1, STEPS // EVALS),
            eval_iters=16,
            eval_batch_size=16,  # every variant validates on the same blocks, whatever its micro-batch
            log_interval=10,
            workspace=run / "train",
            wandb="off",
        ),
        ckpt=from_namespace(CheckpointOptions, r, ckpt_dir=run / "ckpt", save_interval=STEPS, no_resume=True),
        schedule=from_namespace(ScheduleOptions, r, warmup_iters=warmup),
        optim=from_namespace(OptimizerOptions, r),
        engine=from_namespace(EngineOptions, r, deepspeed_config=_ds_config(r.deepspeed_config)),
    )
    build(cfg, mongo=mongo).train()
    records = read_metrics(run / "train" / "metrics.jsonl")
    validations = [r for r in records if r.get("event") == "eval" and r.get("val_loss")]
    evals = {r["step"]: r["val_loss"] for r in validations}
    if max(evals, default=0) != STEPS:  # stopped early (a signal saves and ends a run): no result to keep
        raise SystemExit(f"{run}: the training ended at step {max(evals, default=0)} of {STEPS}")
    rates = [r["tokens_per_s"] for r in records if r.get("event") == "train" and r["step"] > 10]
    got = {
        "evals": evals,
        "bpb": validations[-1]["val_bpb"],
        "tokens_per_s": statistics.median(rates),
        **made,
    }
    (run / "result.json").write_text(json.dumps(got))
    return got


def steps_to_reach(evals: dict[int, float], target: float) -> float:
    """The first step at which ``evals`` (validation loss by step) reaches ``target``, linear between two
    validations; inf where it never does."""
    points = sorted(evals.items())
    for (s0, l0), (s1, l1) in zip([(0, float("inf")), *points], points, strict=False):
        if l1 <= target:
            if not np.isfinite(l0):
                return float(s1)
            return s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
    return float("inf")


def _store(conn: Any, texts: list[str]) -> None:
    coll = conn.db["docs"]
    if coll.estimated_document_count() == len(texts):
        return
    coll.drop()
    coll.insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
    coll.create_index("idx", unique=True)
    conn.db["meta_info"].update_one({"collection": "docs"}, {"$set": {"count": len(texts)}}, upsert=True)


def recipe(texts: list[str], results: Path) -> list[Metric]:
    from dsgpt2.db import embedded
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import config_from_dict
    from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab

    metrics: list[Metric] = []
    corpora = {"stdlib": texts, "prose": prose_texts()}
    for corpus in CORPORA:
        docs = corpora[corpus]
        work = results / "recipe" / corpus
        work.mkdir(parents=True, exist_ok=True)
        store = f"local://{work / 'db'}"
        conn = Connection(config_from_dict({"MONGO_CONNECTION_STRING": store, "MONGO_CONNECTION_DB": "recipe",
                                            "COLLECTIONS": ["docs"]}, env={}))  # fmt: skip
        _store(conn, docs)
        tokenizer = work / "tok"
        if not (tokenizer / "tokenizer.json").exists():
            train_vocab(docs, tokenizer, VocabSettings(vocab_size=8192), "recipe", progress=False)
        for shape in SHAPES:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ("adamw", "fast", *VARIANTS)}
            for seed in SEEDS:
                for name in runs:
                    got = _train(store, name, shape, seed, tokenizer, work / f"{shape}-{name}-{seed}")
                    runs[name].append(got)
                    final = got["evals"][max(got["evals"])]
                    rate = got["tokens_per_s"]
                    print(f"   recipe {corpus} {shape} seed {seed} {name}: held-out ppl {np.exp(final):.2f} "
                          f"at step {max(got['evals'])}, {rate:,.0f} tokens/s", flush=True)  # fmt: skip
            metrics += _metrics(corpus, shape, len(docs), runs)
            for name in VARIANTS:
                metrics += _metrics(corpus, shape, len(docs), runs, name)
        embedded.stop(work / "db")
    return metrics + muon_step_cost()


def _metrics(
    corpus: str, shape: str, documents: int, runs: dict[str, list[dict[str, Any]]], name: str = "fast"
) -> list[Metric]:
    """The lines of one recipe (``name``: the fast one, or a variant of it) against AdamW, and a variant's
    held-out perplexity against the fast recipe as shipped."""
    final = {n: [r["evals"][max(r["evals"])] for r in rs] for n, rs in runs.items()}
    ppl = {n: float(np.exp(np.mean(losses))) for n, losses in final.items()}  # geometric mean
    reach = [steps_to_reach(f["evals"], target) / max(a["evals"])
             for f, a, target in zip(runs[name], runs["adamw"], final["adamw"], strict=True)]  # fmt: skip
    rate = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in runs.items()}
    bpb = {n: float(np.mean([r["bpb"] for r in rs])) for n, rs in runs.items()}
    where = (f"{corpus}, {shape} ({'2 x 64' if shape == 'tiny' else '4 x 128'}), {documents} documents, "
             f"{STEPS} steps of 16 x 128 tokens, seeds {', '.join(map(str, SEEDS))}")  # fmt: skip
    mean_reach = float(np.mean(reach))
    reach_note = ", ".join("never" if not np.isfinite(x) else f"{x:.2f}" for x in reach)
    label = "fast" if name == "fast" else f"fast {name} ({' '.join(VARIANTS[name])})"
    lines = [
        Metric(f"recipe: held-out ppl, {label} ÷ AdamW ({corpus}, {shape})", ppl[name], ppl["adamw"], "ppl",
               "<= 0.9", ppl[name] <= 0.9 * ppl["adamw"], where),
        Metric(f"recipe: held-out bpb, {label} ÷ AdamW ({corpus}, {shape})", bpb[name], bpb["adamw"], "bpb",
               "info", True, "final validation bits per byte, mean over the seeds"),
        Metric(f"recipe: steps to AdamW's final loss, {label} ({corpus}, {shape})", mean_reach * STEPS, STEPS,
               "steps", "<= 0.7", mean_reach <= 0.7, f"per seed: {reach_note}"),
        Metric(f"recipe: seconds per token, {label} ÷ AdamW ({corpus}, {shape})", 1 / rate[name],
               1 / rate["adamw"], "s/token", "info", True, "median tokens/s of the logged steps"),
    ]  # fmt: skip
    if name != "fast":
        seeds = ", ".join(f"{np.exp(v - f):.3f}" for v, f in zip(final[name], final["fast"], strict=True))
        lines.append(Metric(f"recipe: held-out ppl, {label} ÷ fast ({corpus}, {shape})", ppl[name],
                            ppl["fast"], "ppl", "info", True, f"per seed: {seeds}"))  # fmt: skip
    return lines


def muon_step_cost(repeats: int = 30) -> list[Metric]:
    """The optimizer step alone, on random gradients, at the tiny preset and at 4 x 128: Muon as the
    trainer builds it at ZeRO 0 (one batched Newton–Schulz per shape, AdamW's part fused) and DeepSpeed's
    own, matrix by matrix, each ÷ AdamW (torch's, as the CPU configs run it). The mean of ``repeats``
    steps after three warm-up steps (the Newton–Schulz compile): SOAP-Muon's eigendecompositions, one
    step in ten, count at their share."""
    import time

    import torch
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from transformers import GPT2Config, GPT2LMHeadModel

    from dsgpt2.model.gpt2 import param_groups
    from dsgpt2.optim.muon import batched_muon_class, muon_param_groups

    def mean_step(optimizer: Any, params: list[Any]) -> float:
        for p in params:
            p.grad = torch.randn_like(p)
        for _ in range(3):
            optimizer.step()
        start = time.perf_counter()
        for _ in range(repeats):
            optimizer.step()
        return (time.perf_counter() - start) / repeats

    metrics = []
    shapes = {
        "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2},
        "wide": {"n_layer": 4, "n_embd": 128, "n_head": 4},
    }
    for shape, dims in shapes.items():
        torch._dynamo.reset()  # each shape's Newton–Schulz compiled afresh, as in a run
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=128, **dims))
        params = list(model.parameters())
        adamw = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
        settings: dict[str, Any] = {"muon_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.1, "scale": "rms"}

        def batched(model: Any = model, settings: dict[str, Any] = settings, **extra: Any) -> Any:
            # as the trainer builds it: AdamW's part fused
            return batched_muon_class()(
                muon_param_groups(model, {}, 1e-3, **settings, **extra),
                adam_optimizer=torch.optim.AdamW,
                adam_optimizer_kwargs={"fused": True},
            )

        each = MuonWithAuxAdam(
            muon_param_groups(model, {}, 1e-3, **settings), adam_optimizer=torch.optim.AdamW
        )
        anchor = mean_step(adamw, params)
        recipe: dict[str, Any] = {"ns": "polar_express", "momentum_warmup": 300}
        variants = {
            "batched per shape": batched(),
            "DeepSpeed's, matrix by matrix": each,
            "batched, --muon_ns polar_express": batched(ns="polar_express"),
            "batched, --muon_cautious": batched(cautious=True),
            "batched, polar_express, cautious, momentum warmup": batched(
                ns="polar_express", cautious=True, momentum_warmup=300
            ),
            "batched, the recipe's (polar_express, momentum warmup)": batched(**recipe),
            "batched, the recipe's, --muon_normuon": batched(**recipe, normuon=True),
            "batched, the recipe's, --muon_soap": batched(**recipe, soap=True),
        }
        where = f"{shape} ({dims['n_layer']} x {dims['n_embd']}), vocabulary 8,192, mean of {repeats} steps"
        metrics += [
            Metric(f"recipe: Muon step ÷ AdamW step ({shape}, {how})", mean_step(optimizer, params), anchor,
                   "s", "info", True, where)
            for how, optimizer in variants.items()
        ]  # fmt: skip
    return metrics
