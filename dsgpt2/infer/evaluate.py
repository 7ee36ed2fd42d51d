"""``dsgpt2 evaluate``: loss, perplexity and bits per byte of a model on a split of the corpus.

The blocks are made exactly as in training (same chunks, split, packing and,
for conversations, reply-only labels): by default the validation split of the
run that trained the model, read back from the run's data fingerprint. The
loss is the mean negative log-likelihood per predicted token over every
block, summed in float64; perplexity is its exponential. Bits per byte divides
the summed loss (in bits) by the UTF-8 bytes the predicted tokens stand for: unlike
perplexity it compares models of different tokenizers. No dropout, a fixed
order: the same model and data give the same figures.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from dsgpt2.data.loader import Batch, iter_eval_batches
from dsgpt2.data.sources import DataSpec, StreamingChunks, fingerprint, make_spec
from dsgpt2.data.split import DEFAULT_CHUNK_DOCS, DEFAULT_SEED, DEFAULT_TR_RATIO
from dsgpt2.db.config import MongoConfig
from dsgpt2.errors import ConfigError
from dsgpt2.files import output_writer
from dsgpt2.infer.loading import LoadedModel
from dsgpt2.infer.settings import EvalRequest
from dsgpt2.model.gpt2 import batch_nll, bits_per_byte, perplexity
from dsgpt2.model.loss import with_chunked_loss
from dsgpt2.progress import progress as progress_display
from dsgpt2.tokenizer.bpe import load_tokenizer
from dsgpt2.tokenizer.token_bytes import token_bytes

log = logging.getLogger(__name__)


@dataclass
class EvalMetrics:
    loss: float  # mean negative log-likelihood per predicted token (nats)
    perplexity: float
    tokens: int  # predicted tokens
    blocks: int
    bpb: float | None = None  # bits per UTF-8 byte of the text (None: a tokenizer not byte-level)
    bytes: int = 0  # the UTF-8 bytes the predicted tokens stand for
    documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def evaluate_batches(
    model: Any,
    batches: Iterable[Batch],
    max_batches: int | None = None,
    progress: bool = True,
    stats: dict[str, Any] | None = None,
    *,
    doc_mask_eot: int | None = None,
    bytes_of: torch.Tensor | None = None,
) -> EvalMetrics:
    """Loss, perplexity and bits per byte of ``model`` over ``batches`` (``stats``: what the batches
    skipped; ``bytes_of`` (V,): each token id's bytes, on the model's device; without it no bits per
    byte)."""
    device = str(next(model.parameters()).device)
    model.eval()
    total, tokens, blocks = 0.0, 0, 0
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)  # read once, at the end
    started = time.monotonic()
    bar = progress_display("evaluate", "batch", total=max_batches, enabled=progress)
    with torch.no_grad():
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            nll, n, n_bytes = batch_nll(model, batch, device, doc_mask_eot, token_bytes=bytes_of)
            total += float(nll)
            if n_bytes is not None:
                total_bytes += n_bytes
            tokens += n
            blocks += len(batch.input_ids)
            bar.update(1)
            if tokens:
                bar.set_postfix(loss=f"{total / tokens:.4f}")
    bar.close()
    if tokens == 0:
        skipped = (stats or {}).get("skipped")
        why = f"; documents skipped: {skipped} (a conversation task on text documents?)" if skipped else ""
        raise ConfigError(
            "nothing to evaluate: the selected split holds no tokens with a label (an empty split, "
            f"or --tr_ratio 1 leaves no validation documents: try --split all){why}"
        )
    loss, n_bytes = total / tokens, int(total_bytes)
    bpb = bits_per_byte(total, n_bytes) if bytes_of is not None else None
    seconds = time.monotonic() - started
    return EvalMetrics(loss, perplexity(loss), tokens, blocks, bpb, n_bytes, seconds=seconds)


def eval_spec(loaded: LoadedModel, request: EvalRequest) -> DataSpec:
    """The data spec: the request's choices over the training run's, over defaults."""
    run = loaded.run.get("fingerprint", {})
    context = request.context or run.get("context") or loaded.context
    if context > loaded.context:
        raise ConfigError(f"--context_length {context}: the model has {loaded.context} positions")
    if not run and request.split != "all" and (request.tr_ratio is None or request.seed is None):
        # A model exported elsewhere, or an export without its dsgpt2_run.json: whose split is unknown.
        log.warning(
            "%s records no training run (no dsgpt2_run.json): its %s split is cut by --tr_ratio %s "
            "--split_seed %s, which may not be the run's; give the run's to evaluate on its held-out ones",
            loaded.name, request.split, request.tr_ratio or DEFAULT_TR_RATIO,
            DEFAULT_SEED if request.seed is None else request.seed,
        )  # fmt: skip
    return make_spec(
        loaded.tokenizer_dir,
        context=context,
        chunk_docs=run.get("chunk_docs", DEFAULT_CHUNK_DOCS),
        tr_ratio=request.tr_ratio or run.get("tr_ratio", DEFAULT_TR_RATIO),
        seed=request.seed if request.seed is not None else run.get("seed", DEFAULT_SEED),
        task=request.task or run.get("task", "lm"),
        reply_speakers=request.reply_speakers or run.get("reply_speakers", "bot"),
    )


def check_collections(config: MongoConfig, request: EvalRequest) -> None:
    """Before the model loads: every collection to evaluate on exists (an absent one would read as an
    empty split).

    Raises:
        CorpusError: one line naming the missing collections and those the database holds.
    """
    from dsgpt2.db.client import connect, require_collections

    require_collections(connect(config, create=False), request.collections or config.collections)


def evaluate(
    loaded: LoadedModel, config: MongoConfig, request: EvalRequest, progress: bool = True
) -> dict[str, Any]:
    """Evaluate ``loaded`` on the corpus of ``config``; return the report."""
    from dataclasses import replace

    from dsgpt2.db.wrapper import MongoWrapper

    if request.collections:
        config = replace(config, collections=tuple(request.collections))
    counts = MongoWrapper(config).counts
    spec = eval_spec(loaded, request)
    window = request.window
    if window is not None:
        window = (window[0], min(window[1], sum(counts)))
        if window[0] >= window[1]:
            raise ConfigError(f"--start {window[0]} is past the end of the corpus ({sum(counts)} documents)")
    run_fp = loaded.run.get("fingerprint")
    trained_on = (run_fp or {}).get("collections")
    # Only where it saw some of these documents: a split of collections it never read leaks nothing.
    overlap = trained_on is not None and set(trained_on) & set(config.collections)
    if request.split != "all" and overlap and trained_on != list(config.collections):
        log.warning(
            "the model trained on %s, not %s: its %s split of these collections is not the one it "
            "held out (use --split all to evaluate on every document)",
            trained_on,
            list(config.collections),
            request.split,
        )
    dataset = StreamingChunks(config, counts, loaded.tokenizer_dir, spec, request.split, window=window)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = with_chunked_loss(loaded.model.to(device), request.loss_chunk)
    stats: dict[str, Any] = {}
    batches = iter_eval_batches(dataset, 0, 1, request.batch_size, request.workers, stats=stats)
    doc_mask = request.doc_mask if request.doc_mask is not None else bool(loaded.run.get("doc_mask"))
    eot = spec.eot if doc_mask else None
    ids = token_bytes(load_tokenizer(loaded.tokenizer_dir))
    bytes_of = None if ids is None else torch.tensor(ids, dtype=torch.int64, device=device)
    metrics = evaluate_batches(model, batches, request.max_batches, progress, stats, doc_mask_eot=eot,
                               bytes_of=bytes_of)  # fmt: skip
    if not math.isfinite(metrics.loss):  # a figure no one should record or compare
        raise ConfigError(
            f"the model's loss is not finite ({metrics.loss}) on {metrics.tokens:,} tokens: its "
            "weights are damaged or its training diverged; export it again from a checkpoint whose loss was "
            "finite"
        )
    metrics.documents = stats.get("documents", 0)
    metrics.skipped = stats.get("skipped", {})
    return {
        "model": loaded.name,
        "step": loaded.run.get("step"),
        "task": spec.task,
        "split": request.split,
        "window": list(window) if window else None,
        "db": config.db,
        "collections": list(config.collections),
        "filter": config.filter_query,
        "data_fingerprint": fingerprint(config, loaded.tokenizer_dir, spec),
        "counts": list(counts),
        "batch_size": request.batch_size,
        "doc_mask": doc_mask,
        "max_batches": request.max_batches,
        "metrics": asdict(metrics),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def hellaswag_report(loaded: LoadedModel, examples: list[Any], path: Path) -> dict[str, Any]:
    """HellaSwag accuracy of ``loaded`` on ``examples`` (see :mod:`dsgpt2.model.hellaswag`)."""
    from dsgpt2.model.hellaswag import encoder, result, score

    started = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = loaded.model.to(device).eval()
    with torch.no_grad():
        total = score(model, encoder(loaded.tokenizer_dir), examples, device, loaded.context)
    return {
        "model": loaded.name,
        "step": loaded.run.get("step"),
        "split": "hellaswag",
        "hellaswag": str(path),
        "metrics": {**result(total), "seconds": time.monotonic() - started},
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def default_report_path(model_name: str, split: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name.strip("/")).strip("_.")[-80:] or "model"
    return Path("runs/eval") / f"{slug}-{split}.json"


def write_report(report: dict[str, Any], path: Path) -> None:
    """The report at ``path``, whole or not at all (a full disk: NoRoomError)."""
    with output_writer(path) as f:
        f.write(json.dumps(report, indent=2) + "\n")


def report_lines(report: dict[str, Any]) -> list[str]:
    from dsgpt2.model.hellaswag import accuracies

    m = report["metrics"]
    if "hellaswag" in report:
        return [
            f"{report['model']} (step {report['step']}) on HellaSwag ({report['hellaswag']}): "
            f"{accuracies(m)} in {m['seconds']:.1f}s",
            *(contamination_lines(report["contamination"]) if "contamination" in report else []),
        ]
    bpb = f", bpb {m['bpb']:.3f}" if m.get("bpb") is not None else ""
    window = report.get("window")
    if report.get("max_batches") is not None:
        covers = f"its first {report['max_batches']} batches (--max_batches)"
    elif window:
        covers = f"its documents in [{window[0]}, {window[1]}) of the index"
    else:
        # Training's validation figures read --eval_iters batches of it: a sample, so they differ.
        covers = "all of it"
    lines = [
        f"{report['model']} (step {report['step']}) on the {report['split']} split of "
        f"{report['db']}.{','.join(report['collections'])} [{report['task']}]",
        f"loss {m['loss']:.4f}, perplexity {m['perplexity']:.2f}{bpb} over {m['tokens']:,} tokens, "
        f"{covers} ({m['blocks']} blocks, {m['documents']} documents) in {m['seconds']:.1f}s",
    ]
    if m["skipped"]:
        from dsgpt2.documents import SKIP_REASONS

        why = "; ".join(f"{n} {SKIP_REASONS.get(r, r)}" for r, n in sorted(m["skipped"].items()))
        lines.append(f"documents not read: {why}")
    return lines


def contamination(config: MongoConfig, run: dict[str, Any], hellaswag: Path) -> dict[str, Any]:
    """Whether the run behind a model trained on documents marked as sharing an n-gram with the set
    named as ``hellaswag`` (``dsgpt2 decontaminate``), and how many: the marked documents of its
    training split (the run's collections, FILTER, split ratio and seed) below the high-water marks its
    checkpoint records, or every marked one of the split where it records none. Whether the run's
    steps reached each of them is what ``dsgpt2 lineage`` answers."""
    import numpy as np

    from dsgpt2.curation.decontaminate import META, iter_marked, set_name
    from dsgpt2.data.split import split_mask
    from dsgpt2.db.client import connect
    from dsgpt2.db.meta import read_meta

    name = set_name(Path(hellaswag))
    fp = run.get("fingerprint") or {}
    names = list(fp.get("collections") or config.collections)
    out: dict[str, Any] = {"set": name, "collections": names}
    conn = connect(config)
    checked = [n for n, m in read_meta(conn, names).items() if name in (m.get(META) or {})]
    out["checked"] = sorted(checked)
    if not checked:
        return out
    marks = _checkpoint_marks(run, names)
    out["marks"] = marks
    query = json.loads(fp["filter"]) if fp.get("filter") else None
    tr_ratio, seed = fp.get("tr_ratio", DEFAULT_TR_RATIO), fp.get("seed", DEFAULT_SEED)
    trained = marked = 0
    for c in checked:
        idx = np.array(iter_marked(conn, c, name, query), dtype=np.int64)
        if marks is not None:
            idx = idx[idx < marks.get(c, 0)]
        marked += len(idx)
        trained += int(split_mask(idx, tr_ratio, seed, c).sum()) if len(idx) else 0
    out.update(documents=trained, marked=marked)
    return out


def _checkpoint_marks(run: dict[str, Any], names: list[str]) -> dict[str, int] | None:
    """Per collection, the end of what the run's checkpoint had taken in; None when the model names no
    checkpoint that can still be read."""
    from dsgpt2.checkpoints.format import read_client_state
    from dsgpt2.data.table import ChunkTable
    from dsgpt2.errors import DsGpt2Error

    where = run.get("checkpoint")
    if not where:
        return None
    try:
        data = read_client_state(Path(where).parent, Path(where).name)["data"]
        table = ChunkTable.from_dict(data["table"])
    except (OSError, KeyError, ValueError, RuntimeError, DsGpt2Error):
        return None
    return {n: m for n, m in zip(table.names, table.marks, strict=True) if n in names}


def contamination_lines(note: dict[str, Any]) -> list[str]:
    """One line: what :func:`contamination` found, or that no decontamination against the set ran."""
    if "error" in note:
        return [f"contamination: not known, the corpus could not be read ({note['error']})"]
    name, where = note["set"], ", ".join(note["collections"])
    if not note.get("checked"):
        return [
            f"contamination: no decontamination against {name!r} was run on {where}: whether the run "
            f"trained on its passages is unknown (`dsgpt2 decontaminate --against FILE` marks them)"
        ]
    scope = (
        "below its checkpoint's high-water marks" if note.get("marks") is not None else "now in the corpus"
    )
    if not note["documents"]:
        checked = ", ".join(note["checked"])
        return [f"contamination: the run's training split held no document contaminated by {name!r} "
                f"(decontaminated: {checked}; {note['marked']} marked {scope})"]  # fmt: skip
    return [
        f"contamination: the run's training split held {note['documents']} documents contaminated by "
        f"{name!r} (of {note['marked']} marked {scope} in {', '.join(note['checked'])}): this score may be "
        "inflated; `dsgpt2 lineage --doc` tells the steps that read one"
    ]
