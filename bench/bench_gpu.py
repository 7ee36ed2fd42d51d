"""Training throughput (``train_gpu``): our trainer ÷ a plain PyTorch loop of the same model.

Where CUDA exists: the 112m preset at context 1024 in bf16 with the shipped ``ds_config.json`` as it is
(DeepSpeed ZeRO 1 with its fused AdamW, its micro-batch and accumulation: 131 k tokens per optimizer
step), and, compiled, at the former 16 × 2 (a 32 k-token step) for comparison. On the CPU the same
comparison on the tiny preset at context 128 in fp32 (``ds_config_cpu.json``).

The corpus is the sample texts repeated until the measured window fits inside one epoch, so no epoch
boundary falls inside the figure.

- ours: ``ds_trainer.py`` as a user starts it, streaming the sample corpus from a file-backed
  database (local://), tokenizing in its DataLoader workers; tokens/s over the steady steps, read from
  its ``metrics.jsonl``. With ``--optimizer adamw``, the plain loop's optimizer; ``ours compiled
  muon`` the same run with Muon, a new run's default (÷ ours with AdamW; target 0.97 on a GPU).
- anchor: a plain loop of the same ``GPT2LMHeadModel`` (SDPA attention) on blocks of the sample
  corpus's tokens already on the device: bf16 autocast and ``torch.optim.AdamW(fused=True)`` on the
  GPU, the same micro-batch and accumulation, gradient clipping at 1.0, nothing else. Each side runs in
  a fresh process.
- every run's loss at its first and last step beside its speed: a run whose loss did not fall (a
  compiled graph with no gradient trains nothing at full speed) is marked FAIL, and so is every ratio
  made of its figure.
- both eager and under ``torch.compile``; MFU from the FLOPs per token of the model config
  (``dsgpt2.model.gpt2.flops_per_token``) and the device's peak (GPU only);
- the DataLoader workers one device needs: our eager run with several worker counts, the fewest
  within 5 % of the fastest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.common import Metric, learnt, loss_column

ROOT = Path(__file__).resolve().parent.parent
TARGET_TOKENS_PER_S = 0.45e6  # 112m on one H100
RATIO_TARGET = 0.95
BUSY_TARGET = 0.95
MUON_TARGET = 0.97  # Muon's tokens/s ÷ AdamW's, the trainer compiled at 112m


@dataclass(frozen=True)
class Settings:
    device: str
    preset: str
    context: int
    micro: int
    accum: int
    warmup: int  # steps left out of the figure (compilation, the loader's first chunks)
    steps: int  # steps measured
    ds_config: str
    workers: int  # the default run's DataLoader workers
    sweep: tuple[int, ...]  # worker counts tried

    @property
    def tokens_per_step(self) -> int:
        return self.micro * self.accum * self.context


CPU = Settings("cpu", "tiny", 128, 8, 1, 20, 60, "ds_config_cpu.json", 2, (0, 1, 2))
FORMER_GPU_SHAPE = (16, 2)  # micro × accumulation of the GPU config before it stepped on 131 k tokens


def gpu_settings() -> Settings:
    """112m at context 1024 with the shipped GPU config's own micro-batch and accumulation."""
    from dsgpt2.settings.shipped import shipped_config

    ds = json.loads(shipped_config("ds_config.json").read_text())
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    warmup, steps = (int(n) for n in os.environ.get("BENCH_GPU_STEPS", "10,40").split(","))
    return Settings("cuda", "112m", 1024, micro, accum, warmup, steps, "ds_config.json", 4, (1, 2, 4, 8))


# The shipped GPU config before it moved to ZeRO 0 under torch autocast: DeepSpeed's bf16 optimizer at
# ZeRO 1, whose gradients pass through its own hooks and the micro-step guard's (``ours compiled zero1``).
ZERO1_BF16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}


def _wanted(name: str) -> bool:
    """Whether run ``name`` is one ``BENCH_GPU_RUNS`` (comma-separated names; default: all) asks for."""
    runs = os.environ.get("BENCH_GPU_RUNS")
    return runs is None or name in [r.strip() for r in runs.split(",")]


def train_gpu(texts: list[str], results: Path) -> list[Metric]:
    import torch

    s = gpu_settings() if torch.cuda.is_available() else CPU
    work = results / "train_gpu"
    tokenizer = results / "vocab_bench_tok"
    if not (tokenizer / "tokenizer.json").exists():
        from bench import bench_vocab

        bench_vocab.run(texts, results, repeats=1)
    store_config = _corpus(texts, work, tokenizer, (s.warmup + s.steps) * s.tokens_per_step)
    where = f"{s.preset}, context {s.context}, {'bf16' if s.device == 'cuda' else 'fp32'} on {_device_name()}"
    runs: dict[str, dict[str, Any]] = {}
    for compiled in (False, True):
        tag = "compiled" if compiled else "eager"
        if _wanted(f"plain {tag}"):
            runs[f"plain {tag}"] = _report(f"plain {tag}", _plain(s, tokenizer, compiled))
        if _wanted(f"ours {tag}"):
            runs[f"ours {tag}"] = _report(
                f"ours {tag}", _ours(s, tokenizer, store_config, work / f"ours_{tag}", s.workers, compiled)
            )
    if _wanted("ours compiled muon"):
        runs["ours compiled muon"] = _report("ours compiled muon", _ours(
            s, tokenizer, store_config, work / "ours_muon", s.workers, True, optimizer="muon"))  # fmt: skip
    if s.device == "cuda" and _wanted("ours compiled zero1"):
        runs["ours compiled zero1"] = _report("ours compiled zero1", _ours(
            s, tokenizer, store_config, work / "ours_zero1", s.workers, True, ZERO1_BF16))  # fmt: skip
    for w in s.sweep:
        if w != s.workers and _wanted(f"ours {w} workers"):
            runs[f"ours {w} workers"] = _report(
                f"ours {w} workers", _ours(s, tokenizer, store_config, work / f"ours_w{w}", w, False)
            )
    former = replace(s, micro=FORMER_GPU_SHAPE[0], accum=FORMER_GPU_SHAPE[1])
    if s.device == "cuda" and (former.micro, former.accum) != (s.micro, s.accum):
        if _wanted("plain compiled 16x2"):
            runs["plain compiled 16x2"] = _report("plain compiled 16x2", _plain(former, tokenizer, True))
        if _wanted("ours compiled 16x2"):
            runs["ours compiled 16x2"] = _report("ours compiled 16x2", _ours(
                former, tokenizer, store_config, work / "ours_16x2", s.workers, True))  # fmt: skip
    if _wanted("busy"):
        # Run on a CPU too (no kernels to time there), so that the profiled run cannot break unseen.
        busy_run = _busy(s, tokenizer, store_config, work / "busy")
        runs["ours compiled busy"] = _report("ours compiled busy", busy_run)
    print("--", where, flush=True)
    for name, r in runs.items():
        print("   " + _line(name, r), flush=True)

    metrics = []
    shape = f"{s.micro} × {s.accum}, {s.tokens_per_step:,} tokens per step"
    for tag in ("eager", "compiled"):
        if f"ours {tag}" not in runs or f"plain {tag}" not in runs:
            continue
        ours, plain = runs[f"ours {tag}"], runs[f"plain {tag}"]
        metrics.append(
            Metric(
                f"trainer ÷ plain loop ({tag})",
                ours["tokens_per_s"],
                plain["tokens_per_s"],
                "tokens/s",
                f">= {RATIO_TARGET}",
                ours["tokens_per_s"] >= RATIO_TARGET * plain["tokens_per_s"] and learnt(ours, plain),
                f"{where}, {shape}; ours {loss_column(ours)}, plain {loss_column(plain)}",
            )
        )
        if ours.get("mfu") is not None:
            metrics.append(
                Metric(
                    f"MFU ({tag}; ÷ plain loop's)",
                    ours["mfu"],
                    plain["mfu"],
                    "share",
                    "info",
                    True,
                    f"{ours['flops_per_token'] / 1e6:.0f} MFLOP/token, peak {ours['peak_tflops']:.0f} "
                    "TFLOP/s",
                )
            )
    if "ours compiled zero1" in runs and "plain compiled" in runs:
        metrics.append(
            Metric(
                "former config (ZeRO 1, DeepSpeed bf16) ÷ plain loop (compiled)",
                runs["ours compiled zero1"]["tokens_per_s"],
                runs["plain compiled"]["tokens_per_s"],
                "tokens/s",
                "info",
                learnt(runs["ours compiled zero1"], runs["plain compiled"]),
                f"{where}, {shape}; ours {loss_column(runs['ours compiled zero1'])}",
            )
        )
    if "ours compiled 16x2" in runs and "plain compiled 16x2" in runs:
        metrics.append(
            Metric(
                "trainer ÷ plain loop (compiled, former 16 × 2)",
                runs["ours compiled 16x2"]["tokens_per_s"],
                runs["plain compiled 16x2"]["tokens_per_s"],
                "tokens/s",
                "info",
                learnt(runs["ours compiled 16x2"], runs["plain compiled 16x2"]),
                f"{where}, {former.tokens_per_step:,} tokens per step: DeepSpeed's cost per step unamortized",
            )
        )
    if "ours compiled muon" in runs and "ours compiled" in runs:
        muon_run, adamw_run = runs["ours compiled muon"], runs["ours compiled"]
        muon, adamw = muon_run["tokens_per_s"], adamw_run["tokens_per_s"]
        metrics.append(
            Metric("Muon ÷ AdamW (ours compiled)", muon, adamw, "tokens/s",
                   f">= {MUON_TARGET}" if s.device == "cuda" else "info",
                   (muon >= MUON_TARGET * adamw or s.device != "cuda") and learnt(muon_run, adamw_run),
                   f"{where}, {shape}; Muon {loss_column(muon_run)}")
        )  # fmt: skip
    busy_run = runs.get("ours compiled busy")
    if busy_run is not None and busy_run.get("busy") is not None:
        busy = busy_run["busy"]
        metrics.append(
            Metric("GPU busy (kernel time ÷ wall, ours compiled)", busy, BUSY_TARGET, "share",
                   f">= {BUSY_TARGET}", busy >= BUSY_TARGET and learnt(busy_run),
                   f"{where}, {shape}, steady steps profiled; {loss_column(busy_run)}")
        )  # fmt: skip
    ours_runs = [runs[k]["tokens_per_s"] for k in ("ours eager", "ours compiled")
                 if k in runs and learnt(runs[k])]  # fmt: skip
    if s.device == "cuda" and ours_runs:
        best = max(ours_runs)
        h100 = "H100" in _device_name()
        metrics.append(
            Metric(
                "112m tokens/s on one GPU (best of ours)",
                best,
                TARGET_TOKENS_PER_S,
                "tokens/s",
                ">= 0.45M (H100)" if h100 else "info",
                best >= TARGET_TOKENS_PER_S or not h100,
                _device_name(),
            )
        )
    names = {w: "ours eager" if w == s.workers else f"ours {w} workers" for w in s.sweep}
    sweep = {w: runs[name]["tokens_per_s"] for w, name in names.items() if name in runs}
    if not sweep:
        return metrics
    fastest = max(sweep.values())
    needed = min(w for w, tps in sweep.items() if tps >= 0.95 * fastest)
    metrics.append(
        Metric(
            "DataLoader workers one device needs",
            needed,
            max(sweep),
            "workers",
            "info",
            True,
            "fewest within 5% of the fastest; tokens/s: "
            + ", ".join(f"{w}: {tps:,.0f}" for w, tps in sweep.items()),
        )
    )
    return metrics


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def _corpus(texts: list[str], work: Path, tokenizer: Path, tokens: int) -> Path:
    """The sample corpus, repeated until it holds 1.25 × ``tokens`` (the training split included), in a
    database in ``work/db`` (``local://``); the config file naming it."""
    from dsgpt2.db.client import connect
    from dsgpt2.db.config import config_from_dict
    from dsgpt2.tokenizer.bpe import load_tokenizer

    have = sum(len(e.ids) + 1 for e in load_tokenizer(tokenizer).encode_batch(texts))
    texts = texts * max(1, -(-int(1.25 * tokens / 0.9) // have))

    work.mkdir(parents=True, exist_ok=True)
    data = {"MONGO_CONNECTION_STRING": f"local://{work / 'db'}", "MONGO_CONNECTION_DB": "bench",
            "COLLECTIONS": ["s"]}  # fmt: skip
    conn = connect(config_from_dict(data, env={}))
    conn.client.drop_database("bench")
    coll = conn.db["s"]
    coll.create_index("idx", unique=True)
    coll.insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
    conn.db["meta_info"].update_one({"collection": "s"}, {"$set": {"count": len(texts)}}, upsert=True)
    path = work / "mongo.json"
    path.write_text(json.dumps(data))
    return path


def _busy(s: Settings, tokenizer: Path, store_config: Path, run: Path) -> dict[str, Any]:
    """Our trainer, compiled, in process under the profiler (:mod:`bench.bench_host`): the share of the
    wall time of ``PROFILED`` steady steps in which a kernel ran, and tokens/s over the timed steps."""
    from bench.bench_host import spawn
    from dsgpt2.settings.shipped import shipped_config

    run.mkdir(parents=True, exist_ok=True)
    ds = json.loads(shipped_config(s.ds_config).read_text())
    ds.update(train_micro_batch_size_per_gpu=s.micro, gradient_accumulation_steps=s.accum)
    (run / "ds.json").write_text(json.dumps(ds))
    spec = {"settings": asdict(s), "tokenizer": str(tokenizer), "store": str(store_config), "work": str(run),
            "ds_config": str(run / "ds.json"), "model_config": ""}  # fmt: skip
    r = spawn("ours", spec)
    return {"tokens_per_s": s.tokens_per_step / (r["host_ms"] / 1000), "busy": r["busy"],
            "first_loss": r["first_loss"], "last_loss": r["last_loss"]}  # fmt: skip


def _line(name: str, r: dict[str, Any]) -> str:
    mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
    busy = f", GPU busy {r['busy']:.1%}" if r.get("busy") is not None else ""
    return f"{name:<20} {r['tokens_per_s']:>12,.0f} tokens/s{mfu}{busy}; {loss_column(r)}"


def _report(name: str, r: dict[str, Any]) -> dict[str, Any]:
    """``r``, its line printed as soon as it is measured."""
    print("   " + _line(name, r), flush=True)
    return r


def _ours(
    s: Settings,
    tokenizer: Path,
    store_config: Path,
    run: Path,
    workers: int,
    compiled: bool,
    ds_changes: dict[str, Any] | None = None,
    *,
    optimizer: str = "adamw",
) -> dict:
    """``ds_trainer.py`` for warmup + steps; tokens/s and MFU over the measured steps. ``ds_changes``:
    sections that replace the shipped config's, its torch_autocast section dropped (the former config).
    ``optimizer``: AdamW, the plain loop's, unless a run names Muon (the default of a new run)."""
    from dsgpt2.settings.shipped import shipped_config
    from dsgpt2.train.metrics import read_metrics

    run.mkdir(parents=True, exist_ok=True)
    ds = json.loads(shipped_config(s.ds_config).read_text())
    ds.update(train_micro_batch_size_per_gpu=s.micro, gradient_accumulation_steps=s.accum)
    if ds_changes:
        ds.pop("torch_autocast", None)
        ds.update(ds_changes)
    (run / "ds.json").write_text(json.dumps(ds))
    total = s.warmup + s.steps
    args = ["--deepspeed_config", run / "ds.json", "--config_train", store_config, "--vocab_dir", tokenizer,
            "--model_select", s.preset, "--context_length", s.context, "--train_iters", total,
            "--log_interval", 5, "--eval_interval", 10 * total, "--eval_iters", 1,
            "--save_interval", 10 * total, "--workspace", run / "ws", "--ckpt_dir", run / "ckpt",
            "--no_resume", "--wandb", "off", "--num_workers", workers, "--data_mode", "streaming",
            "--optimizer", optimizer, "--compile" if compiled else "--no_compile"]  # fmt: skip
    # A fresh run each time: the bench run again would otherwise meet its own checkpoints (--no_resume).
    shutil.rmtree(run / "ckpt", ignore_errors=True)
    (run / "ws" / "metrics.jsonl").unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "ds_trainer.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"ds_trainer.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [r for r in read_metrics(run / "ws" / "metrics.jsonl") if r.get("event") == "train"]
    first = next(r for r in records if r["step"] >= s.warmup)
    last = records[-1]
    tps = (last["tokens"] - first["tokens"]) / (last["time"] - first["time"])
    return {"tokens_per_s": tps, **_mfu(s, tokenizer, tps), "logged_mfu": last.get("mfu"),
            "first_loss": records[0]["loss"], "last_loss": last["loss"]}  # fmt: skip


def _mfu(s: Settings, tokenizer: Path, tps: float) -> dict[str, Any]:
    """MFU at ``tps`` on this GPU in bf16, as the trainer logs it; none on the CPU."""
    import torch

    from dsgpt2.train.metrics import device_peak_tflops

    peak = device_peak_tflops(torch.cuda.get_device_name(), "bf16") if s.device == "cuda" else None
    if not peak:
        return {"mfu": None}
    fpt = _flops_per_token(s, tokenizer)
    return {"mfu": tps * fpt / (peak * 1e12), "flops_per_token": fpt, "peak_tflops": peak}


def _flops_per_token(s: Settings, tokenizer: Path) -> float:
    from dsgpt2.model.gpt2 import flops_per_token

    return flops_per_token(_config(s, tokenizer), s.context)


def _config(s: Settings, tokenizer: Path) -> Any:
    """The model config our trainer builds for this preset and tokenizer."""
    from dsgpt2.model.gpt2 import gpt2_config
    from dsgpt2.tokenizer.bpe import EOT, PAD, load_tokenizer

    tok = load_tokenizer(tokenizer)
    return gpt2_config(s.preset, tok.get_vocab_size(), s.context, tok.token_to_id(EOT), tok.token_to_id(PAD))


def _plain(s: Settings, tokenizer: Path, compiled: bool) -> dict:
    """The plain loop in a fresh process (``python -m bench.bench_gpu plain ...``)."""
    spec = json.dumps({"settings": asdict(s), "tokenizer": str(tokenizer), "compiled": compiled})
    proc = subprocess.run([sys.executable, "-m", "bench.bench_gpu", "plain", spec], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"plain loop failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def text_batches(tokenizer: Path, micro: int, context: int, count: int) -> list[Any]:
    """Up to ``count`` (micro, context) blocks of the sample corpus's tokens, its documents end to end with
    end-of-text between them (as many as the corpus fills): what the plain loops learn from, so that a
    loop whose loss does not fall shows as one."""
    import numpy as np
    import torch

    from dsgpt2.corpus.builtin import stdlib_documents
    from dsgpt2.corpus.cleaning import clean_text
    from dsgpt2.tokenizer.bpe import EOT, load_tokenizer

    tok = load_tokenizer(Path(tokenizer))
    eot, want = tok.token_to_id(EOT), count * micro * context
    ids: list[int] = []
    documents = (clean_text(t) for t in stdlib_documents())
    while len(ids) < want and (texts := [t for _, t in zip(range(256), documents, strict=False)]):
        for e in tok.encode_batch(texts):
            ids.extend(e.ids)
            ids.append(eot)
    blocks = torch.from_numpy(np.asarray(ids[: len(ids) // (micro * context) * micro * context]))
    return list(blocks.view(-1, micro, context)[:count])


def plain_loop(s: Settings, tokenizer: Path, compiled: bool) -> dict[str, Any]:
    """nanoGPT's loop on the HF model: tokens/s (and MFU on a GPU) over ``s.steps`` steps, and the loss of
    its first and last steps."""
    import torch

    from dsgpt2.model.gpt2 import build_model, param_groups

    cuda = s.device == "cuda"
    config = _config(s, tokenizer)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = build_model(config).to(s.device).train()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8,
                            fused=cuda)  # fmt: skip
    forward = torch.compile(model) if compiled else model
    batches = [b.to(s.device) for b in text_batches(tokenizer, s.micro, s.context, 32)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    losses: dict[int, Any] = {}

    def step(i: int) -> None:
        total = 0.0
        for k in range(s.accum):
            x = batches[(i * s.accum + k) % len(batches)]
            with autocast:
                loss = forward(input_ids=x, labels=x, use_cache=False).loss / s.accum
            loss.backward()
            total = total + loss.detach()
        losses[i] = total  # on the device: read after the timed window
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for i in range(s.warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(s.warmup, s.warmup + s.steps):
        step(i)
    sync()
    tps = s.steps * s.tokens_per_step / (time.perf_counter() - start)
    last = s.warmup + s.steps - 1
    return {"tokens_per_s": tps, **_mfu(s, tokenizer, tps), "first_loss": float(losses[0]),
            "last_loss": float(losses[last])}  # fmt: skip


if __name__ == "__main__" and sys.argv[1:2] == ["plain"]:
    spec = json.loads(sys.argv[2])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = plain_loop(Settings(**{**spec["settings"], "sweep": tuple(spec["settings"]["sweep"])}),
                        Path(spec["tokenizer"]), spec["compiled"])  # fmt: skip
    print(json.dumps(result))
