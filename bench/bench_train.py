"""Training-path benchmarks.

- tokenize + pack: MB/s of our chunk path (``encode_batch_fast``, ids, packing into
  blocks) ÷ raw ``Tokenizer.encode_batch`` on the same texts (target ≥ 0.9); tiktoken on
  the same vocabulary is printed as a second anchor.
- cached loader: tokens/s of micro-batches from the token cache (``CachedChunks`` through
  ``BlockStream``) ÷ nanoGPT's ``get_batch`` on an ``np.memmap`` of the same tokens (≥ 1.0).
- DeepSpeed overhead: training tokens/s of the DeepSpeed engine (ZeRO 0, 1, 2) ÷ a plain
  PyTorch AdamW loop on the same model and batches (≥ 0.95).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Metric, database_uri, paired_times


def tokenize_pack(texts: list[str], tokenizer_dir: Path, repeats: int = 5) -> list[Metric]:
    from tokenizers import Tokenizer

    from bench.tiktoken_vocab import encoding_from_vocab
    from dsgpt2.data.packing import pack
    from dsgpt2.tokenizer.bpe import load_tokenizer

    ours_tok = load_tokenizer(tokenizer_dir)
    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    size = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    chunks = [texts[i : i + 1000] for i in range(0, len(texts), 1000)]

    def ours() -> None:
        for chunk in chunks:
            ids = [e.ids for e in ours_tok.encode_batch_fast(chunk, add_special_tokens=False)]
            pack(ids, 1024, 0, 1)

    def anchor() -> None:
        for chunk in chunks:
            raw.encode_batch(chunk, add_special_tokens=False)

    t_ours, t_raw = paired_times(ours, anchor, repeats)
    enc = encoding_from_vocab(tokenizer_dir)
    t_tk, _ = paired_times(
        lambda: enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1), anchor, 3
    )
    return [
        Metric(
            "tokenize + pack (÷ raw encode_batch)",
            size / t_ours,
            size / t_raw,
            "MB/s",
            ">= 0.9",
            t_raw / t_ours >= 0.9,
            "same chunks of 1,000 documents",
        ),
        Metric(
            "tokenize + pack (÷ tiktoken)",
            size / t_ours,
            size / t_tk,
            "MB/s",
            "info",
            True,
            "tiktoken built from our vocab.json/merges.txt",
        ),
    ]


def cached_loader(
    cache_dir: Path, table: Any, context: int, micro: int = 8, batches: int = 2000, repeats: int = 5
) -> Metric:
    import torch

    from dsgpt2.data.cache import CachedChunks
    from dsgpt2.data.dealing import ChunkOrders
    from dsgpt2.data.loader import BlockStream

    data = CachedChunks(cache_dir, "train", table)
    schedule = ChunkOrders(table, [(0,)], seed=0)
    tokens = np.memmap(cache_dir / "tokens.bin", dtype=data.dtype, mode="r")
    rng = np.random.default_rng(0)

    def ours() -> None:
        stream = iter(BlockStream(data, schedule, rank=0, world=1, micro_batch=micro, workers=0))
        for _ in range(batches):
            b = next(stream)
            assert b.input_ids.shape == (micro, context)

    def nanogpt() -> None:
        # nanoGPT's get_batch: random offsets into one memmap, x and y stacked per batch.
        for _ in range(batches):
            ix = rng.integers(0, len(tokens) - context - 1, micro)
            x = torch.stack([torch.from_numpy(tokens[i : i + context].astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(tokens[i + 1 : i + 1 + context].astype(np.int64)) for i in ix])
            assert x.shape == y.shape

    t_ours, t_anchor = paired_times(ours, nanogpt, repeats)
    n = batches * micro * context
    return Metric(
        "cached loader (÷ nanoGPT get_batch)",
        n / t_ours,
        n / t_anchor,
        "tokens/s",
        ">= 1.0",
        t_anchor / t_ours >= 1.0,
        f"micro-batch {micro} × {context} tokens",
    )


def deepspeed_overhead(rounds: int = 8, window: int = 10) -> list[Metric]:
    """Each engine and the plain loop train side by side: ``rounds`` alternating windows of
    ``window`` steps each, so that the machine's noise hits all of them alike; medians compared."""
    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dsgpt2.model.gpt2 import param_groups
    from dsgpt2.train.trainer import ensure_distributed_env

    ensure_distributed_env()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=4096)
    micro, context = 8, 128
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 4096, (micro, context), generator=gen) for _ in range(window)]
    lr, wd = 1e-3, 0.1

    def fresh() -> Any:
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg)

    plain_model = fresh()
    opt = torch.optim.AdamW(param_groups(plain_model, wd), lr=lr, betas=(0.9, 0.95))

    def plain() -> None:
        for x in data:
            loss = plain_model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def make_engine(stage: int) -> Any:
        model = fresh()
        ds = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            # DeepSpeed's own AdamW, as the shipped GPU configs use (the CPU config trades its
            # compiled op for torch's AdamW, which needs no build).
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": wd}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        }
        eng, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, wd), config=ds)

        def run() -> None:
            for x in data:
                loss = eng(input_ids=x, labels=x).loss
                eng.backward(loss)
                eng.step()

        return run

    runs = {"plain": plain, **{f"zero{s}": make_engine(s) for s in (0, 1, 2)}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    tokens = window * micro * context
    t_anchor = statistics.median(times["plain"])
    metrics = []
    for stage in (0, 1, 2):
        t_ours = statistics.median(times[f"zero{stage}"])
        metrics.append(
            Metric(
                f"DeepSpeed overhead (ZeRO {stage})",
                tokens / t_ours,
                tokens / t_anchor,
                "tokens/s",
                ">= 0.95",
                t_anchor / t_ours >= 0.95,
                "4-layer 256-wide GPT-2 on the CPU vs plain AdamW",
            )
        )
    return metrics


def data_stall(texts: list[str], tokenizer_dir: Path, steps: int = 120) -> Metric:
    """End-to-end tokens/s (database → tokenize → pack → step) ÷ the same steps on synthetic tokens."""
    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dsgpt2.data.dealing import ChunkOrders
    from dsgpt2.data.loader import BlockStream
    from dsgpt2.data.sources import StreamingChunks, make_spec
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import config_from_dict
    from dsgpt2.model.gpt2 import param_groups
    from dsgpt2.tokenizer.bpe import load_vocab_size
    from dsgpt2.train.trainer import ensure_distributed_env

    ensure_distributed_env()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": database_uri(),
            "MONGO_CONNECTION_DB": "bench_stall",
            "COLLECTIONS": ["s"],
        },
        env={},
    )
    conn = Connection(config)
    conn.client.drop_database(config.db)
    conn.db["s"].insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
    conn.db["meta_info"].insert_one({"collection": "s", "count": len(texts)})
    vocab = load_vocab_size(tokenizer_dir)
    spec = make_spec(tokenizer_dir, context=128, chunk_docs=500, tr_ratio=0.99, seed=0)
    micro = 8
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=vocab)
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1), config=ds)

    def step(x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
        loss = eng(input_ids=x, attention_mask=mask, labels=labels).loss
        eng.backward(loss)
        eng.step()

    synthetic = [torch.randint(0, vocab, (micro, 128)) for _ in range(steps)]
    ones = torch.ones(micro, 128, dtype=torch.long)
    for x in synthetic[:5]:
        step(x, x, ones)
    start = time.perf_counter()
    for x in synthetic:
        step(x, x, ones)
    t_anchor = time.perf_counter() - start

    source = StreamingChunks(config, (len(texts),), tokenizer_dir, spec, "train")
    schedule = ChunkOrders(source.table, [(0,)], seed=0)
    stream = iter(BlockStream(source, schedule, rank=0, world=1, micro_batch=micro, workers=2))
    for _ in range(5):  # the workers start and fill their prefetch queue, as at a run's start
        b = next(stream)
        step(b.input_ids, b.labels, b.attention_mask)
    start = time.perf_counter()
    for _ in range(steps):
        b = next(stream)
        step(b.input_ids, b.labels, b.attention_mask)
    t_ours = time.perf_counter() - start
    n = steps * micro * 128
    return Metric(
        "data stall (streaming ÷ synthetic)",
        n / t_ours,
        n / t_anchor,
        "tokens/s",
        ">= 0.95",
        t_anchor / t_ours >= 0.95,
        "local:// database, 2 DataLoader workers, same engine and model",
    )


def index_memory(child_total: int | None = None) -> Metric | dict[str, int]:
    """Trainer RSS with the index state of 10k vs 100k documents (fresh processes)."""
    import json
    import subprocess
    import sys

    if child_total is not None:
        return _index_rss(child_total)
    rss = {}
    for total in (10_000, 100_000):
        code = f"import json, bench.bench_train as b; print(json.dumps(b.index_memory({total})))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        rss[total] = json.loads(out.stdout.strip().splitlines()[-1])["rss"]
    growth = rss[100_000] / rss[10_000]
    return Metric(
        "memory vs corpus size (100k ÷ 10k)",
        rss[100_000] / 1e6,
        rss[10_000] / 1e6,
        "MB RSS",
        "<= 1.05",
        growth <= 1.05,
        "trainer process with its data index, model and engine built",
    )


def _index_rss(total: int) -> dict[str, int]:
    import gc

    from transformers import GPT2Config, GPT2LMHeadModel

    from dsgpt2.data.dealing import ChunkOrders
    from dsgpt2.data.loader import BlockStream
    from dsgpt2.data.sources import DataSpec, StreamingChunks
    from dsgpt2.db.config import config_from_dict

    config = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": "mongodb://127.0.0.1:1",
            "MONGO_CONNECTION_DB": "x",
            "COLLECTIONS": ["a", "b"],
        },
        env={},
    )
    spec = DataSpec(context=128, chunk_docs=1000, tr_ratio=0.99, seed=0, eot=0, pad=1)
    counts = (total // 2, total - total // 2)  # read from meta_info in a real run: two numbers
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=128, vocab_size=4096))
    source = StreamingChunks(config, counts, Path("."), spec, "train")
    schedule = ChunkOrders(source.table, [(0, 1)], seed=0)
    stream = BlockStream(source, schedule, rank=0, world=1, micro_batch=8, workers=0)
    orders = [stream.schedule.rank_chunks(0, epoch, 0, 1) for epoch in range(3)]
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert model is not None and orders
    return {"rss": rss}
