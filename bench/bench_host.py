"""Host work per optimizer step (``host``): our trainer ÷ a plain compiled loop, counted on the CPU.

On a GPU every op the host dispatches outside the compiled graph costs launch time whether or not the
device is busy; when the host's share of a step grows past the device's, the GPU waits. On the CPU the
device *is* the host and the time hides this, but the count does not: the profiler sees every aten op a
step dispatches, and which of them ran inside a compiled graph.

The model is 112m-shaped and narrow: 12 layers and 12 heads (the same parameter tensors as 112m) at width
96 and context 128, at the shipped GPU config's micro-batch × accumulation. Both sides are compiled:

- ours: ``ds_trainer.py``'s ``main`` in process with the shipped ``ds_config.json`` (its ZeRO stage,
  micro-batch and accumulation; fp32 and torch's fused AdamW, as a CPU needs), streaming the sample
  corpus from ``local://``; ``--optimizer adamw``, the plain loop's (and once more with Muon, a new
  run's default: an info line);
- anchor: the plain loop of :mod:`bench.bench_gpu` (fp32 on the CPU, fused AdamW, clipping) on the same
  model.

Per optimizer step, over steady steps, the profiler's count of aten ops:

- every op dispatched, those a compiled graph calls (its extern kernels: matmuls, attention, and the
  views and allocations beneath them) and those outside any graph, an op called by another op counted as
  well: each is a pass through torch's dispatcher on the host (the target's figure, for AdamW and Muon);
- the top-level ops outside compiled graphs, what would run eagerly between the graphs (an info line);

and host time. Each run's loss at its first and last step beside it: a run whose loss did not fall marks
its figures FAIL.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.bench_gpu import Settings, _config, _corpus
from bench.common import Metric, learnt, loss_column

ROOT = Path(__file__).resolve().parent.parent
RATIO_TARGET = 1.3
WIDTH = 96
PROFILED = 3  # steps inside the profiler
COMPILED_SCOPES = ("CompiledFunction", "Torch-Compiled Region", "## Call CompiledFxGraph")


def host_settings() -> Settings:
    from dsgpt2.settings.shipped import shipped_config

    ds = json.loads(shipped_config("ds_config.json").read_text())
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    return Settings("cpu", "112m", 128, micro, accum, 4, 6, "ds_config.json", 1, (1,))


def host(texts: list[str], results: Path) -> list[Metric]:
    s = host_settings()
    work = results / "host"
    tokenizer = results / "vocab_bench_tok"
    if not (tokenizer / "tokenizer.json").exists():
        from bench import bench_vocab

        bench_vocab.run(texts, results, repeats=1)
    store_config = _corpus(texts, work, tokenizer, (s.warmup + s.steps + PROFILED) * s.tokens_per_step)
    model_config = work / "narrow.json"
    # No dropout, as the presets (a config file's missing keys would take GPT2Config's 0.1).
    model_config.write_text(json.dumps({"n_layer": 12, "n_head": 12, "n_embd": WIDTH, "resid_pdrop": 0.0,
                                        "embd_pdrop": 0.0, "attn_pdrop": 0.0}))  # fmt: skip
    spec = {"settings": asdict(s), "tokenizer": str(tokenizer), "store": str(store_config),
            "model_config": str(model_config), "work": str(work)}  # fmt: skip
    ours, plain = spawn("ours", spec), spawn("plain", spec)
    muon = spawn("ours", {**spec, "optimizer": "muon", "work": str(work / "muon")})
    for name, r in (("ours", ours), ("plain", plain), ("muon", muon)):
        top = ", ".join(f"{op} {n:.0f}" for op, n in r["top"][:6])
        print(f"   {name:<6} {r['ops']:>8,.0f} ops/step dispatched, {r['outside']:>6,.0f} outside compiled "
              f"graphs, {r['host_ms']:>7.1f} ms/step, {loss_column(r)}; most: {top}", flush=True)  # fmt: skip
    shape = f"12 layers × width {WIDTH}, context {s.context}, {s.micro} × {s.accum}, compiled"

    return [
        Metric("host: aten ops dispatched per step", ours["ops"], plain["ops"], "ops", f"<= {RATIO_TARGET}",
               ours["ops"] <= RATIO_TARGET * plain["ops"] and learnt(ours, plain),
               f"{shape}; ours {loss_column(ours)}, plain {loss_column(plain)}"),
        Metric("host: aten ops dispatched per step, ours with Muon", muon["ops"], plain["ops"], "ops",
               f"<= {RATIO_TARGET}", muon["ops"] <= RATIO_TARGET * plain["ops"] and learnt(muon, plain),
               f"{shape}; Muon, a new run's default, against the plain AdamW loop; {loss_column(muon)}"),
        Metric("host: top-level ops per step outside compiled graphs", ours["outside"], plain["outside"],
               "ops", "info", learnt(ours, plain), shape),
        Metric("host: time per step (CPU)", ours["host_ms"], plain["host_ms"], "ms", "info",
               learnt(ours, plain), shape),
    ]  # fmt: skip


def spawn(side: str, spec: dict[str, Any]) -> dict[str, Any]:
    """``python -m bench.bench_host SIDE SPEC`` in a fresh process: its result."""
    proc = subprocess.run([sys.executable, "-m", "bench.bench_host", side, json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def dispatched(events: Any) -> Counter:
    """Every aten op the host dispatched, by name (``events``: the profiler's): those a compiled graph
    calls (its extern kernels, matmuls included) as well as those outside any, and those another op calls
    beneath it (each one a pass through the dispatcher)."""
    return Counter(e.name for e in events if e.name.startswith("aten::"))


def outside_compiled(events: Any) -> Counter:
    """Top-level aten ops not run by a compiled graph, by name (``events``: the profiler's)."""
    counts: Counter = Counter()
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent, inside = e.cpu_parent, False
        while parent is not None and not inside:
            inside = parent.name.startswith("aten::") or parent.name.startswith(COMPILED_SCOPES)
            parent = parent.cpu_parent
        if not inside:
            counts[e.name] += 1
    return counts


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` ((start, end) pairs): time the device was busy, kernels
    on several streams counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class _Window:
    """Steps ``warmup``+1 .. ``warmup``+``steps`` timed; the next ``PROFILED`` steps under the profiler.
    Where CUDA exists the profiler also records the kernels: ``busy`` is the share of the window's wall
    time in which one ran."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.times: list[float] = []
        self.prof: Any = None
        self.counts: Counter = Counter()
        self.outside: Counter = Counter()
        self.busy: float | None = None
        self.opened = 0.0

    def after_step(self, step: int) -> None:
        import torch

        cuda = torch.cuda.is_available()
        if self.warmup <= step <= self.warmup + self.steps:
            self.times.append(time.perf_counter())
        if step == self.warmup + self.steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.opened = time.perf_counter()
        elif step == self.warmup + self.steps + PROFILED and self.prof is not None:
            if cuda:
                torch.cuda.synchronize()
            wall_us = 1e6 * (time.perf_counter() - self.opened)
            self.prof.__exit__(None, None, None)
            events = self.prof.events()
            self.counts, self.outside = dispatched(events), outside_compiled(events)
            if cuda:
                kernels = [(e.time_range.start, e.time_range.end) for e in events
                           if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
                self.busy = covered(kernels) / wall_us
            self.prof = None

    def result(self) -> dict[str, Any]:
        host_ms = 1000 * (self.times[-1] - self.times[0]) / (len(self.times) - 1)
        per_step = {op: n / PROFILED for op, n in self.counts.items()}
        return {"ops": sum(per_step.values()), "outside": sum(self.outside.values()) / PROFILED,
                "host_ms": host_ms, "busy": self.busy,
                "top": sorted(per_step.items(), key=lambda kv: -kv[1])}  # fmt: skip


def _ours(s: Settings, spec: dict[str, Any]) -> dict[str, Any]:
    """The trainer in process, profiled, and its first and last loss. ``bench host``: the narrow model
    (``model_config``) under the shipped GPU config made a CPU's (:func:`spec_ds_config`); ``bench
    train_gpu``'s ``busy`` run: its preset under its ``ds_config`` as they are."""
    from dsgpt2.train.metrics import read_metrics
    from dsgpt2.train.trainer import main

    work = Path(spec["work"]) / "ours"
    shutil.rmtree(work, ignore_errors=True)
    window = _Window(s.warmup, s.steps)
    total = s.warmup + s.steps + PROFILED + 1  # the last step's validation and save: past the window
    ds = spec.get("ds_config") or spec_ds_config(s, work)
    given = spec.get("model_config")
    model = ["--model_config", given] if given else ["--model_select", s.preset]
    argv = ["--deepspeed_config", ds, "--config_train", spec["store"],
            "--vocab_dir", spec["tokenizer"], *model,
            "--context_length", s.context, "--train_iters", total, "--log_interval", 10 * total,
            "--eval_interval", 10 * total, "--save_interval", 10 * total, "--workspace", work / "ws",
            "--ckpt_dir", work / "ckpt", "--no_resume", "--wandb", "off",
            "--data_mode", "streaming", "--num_workers", s.workers, "--compile",
            "--optimizer", spec.get("optimizer", "adamw")]  # fmt: skip
    code = main([str(a) for a in argv], after_step=window.after_step)
    if code != 0:
        raise RuntimeError(f"ds_trainer.py exited {code}")
    losses = [r["loss"] for r in read_metrics(work / "ws" / "metrics.jsonl") if r["event"] == "train"]
    return {**window.result(), "first_loss": losses[0], "last_loss": losses[-1]}


def spec_ds_config(s: Settings, work: Path) -> Path:
    from dsgpt2.settings.shipped import shipped_config

    work.mkdir(parents=True, exist_ok=True)
    ds = json.loads(shipped_config(s.ds_config).read_text())
    # On a CPU: fp32 (the trainer refuses bf16 without a GPU) and torch's fused AdamW, as the plain
    # loop's (DeepSpeed's fused one is CUDA's); the ZeRO stage, micro-batch and accumulation stay the
    # shipped config's.
    ds.pop("bf16", None)
    ds.pop("torch_autocast", None)
    ds["optimizer"]["params"].update(torch_adam=True, fused=True)
    path = work / "ds.json"
    path.write_text(json.dumps(ds))
    return path


def _plain(s: Settings, spec: dict[str, Any]) -> dict[str, Any]:
    """The plain loop of :mod:`bench.bench_gpu` on the narrow model (fp32 on the CPU), profiled, and its
    first and last loss."""
    import torch

    from bench.bench_gpu import text_batches
    from dsgpt2.model.gpt2 import build_model, param_groups

    config = _config(replace(s, preset="112m"), Path(spec["tokenizer"]))
    config.update(json.loads(Path(spec["model_config"]).read_text()))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = build_model(config).train()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    forward = torch.compile(model)
    batches = text_batches(Path(spec["tokenizer"]), s.micro, s.context, 32)
    window = _Window(s.warmup, s.steps)
    steps = s.warmup + s.steps + PROFILED + 1  # the last one's loss read past the window, as ours
    losses = []
    for i in range(steps):
        for k in range(s.accum):
            x = batches[(i * s.accum + k) % len(batches)]
            loss = forward(input_ids=x, labels=x, use_cache=False).loss / s.accum
            loss.backward()
            if i in (0, steps - 1):  # the first and last steps: outside the window
                losses.append((i, float(loss) * s.accum))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.after_step(i + 1)
    first = [x for i, x in losses if i == 0]
    last = [x for i, x in losses if i == steps - 1]
    return {**window.result(), "first_loss": sum(first) / len(first), "last_loss": sum(last) / len(last)}


if __name__ == "__main__" and sys.argv[1:2] in (["ours"], ["plain"]):
    spec = json.loads(sys.argv[2])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = Settings(**{**spec["settings"], "sweep": tuple(spec["settings"]["sweep"])})
    result = (_ours if sys.argv[1] == "ours" else _plain)(settings, spec)
    print(json.dumps(result))
