"""What a run tells as it goes: the progress bar on a terminal (a log line per log step and per
evaluation otherwise), ``train``/``eval``/... records in metrics.jsonl and wandb (rank 0), the block ids
each rank trained on (``--log_block_ids``), the loss plot at the end.

The losses stay on the device between log intervals: :meth:`RunLog.log_train` is the only place that
reads them (a read waits for the device).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from dsgpt2.checkpoints.options import RESOLVED
from dsgpt2.documents import SkipTally
from dsgpt2.errors import NoRoomError
from dsgpt2.files import atomic_write_text, open_records, out_of_room
from dsgpt2.model.hellaswag import accuracies
from dsgpt2.progress import on_terminal
from dsgpt2.train.config import RunOptions
from dsgpt2.train.metrics import MetricsLog, plot_losses

log = logging.getLogger(__name__)


class RunLog:
    """The records of one run, from ``start`` (step and tokens where it begins) on.

    Args:
        run: the run options (workspace, wandb, log interval, block ids, --train_iters).
        run_config: what the run's records open with (flags, database, DeepSpeed config, model).
        resolved: the run's resolved configuration (an experiment file), written to the workspace.
        rank, world: this rank among the run's ranks; only rank 0 writes records.
        flops_per_token, peak_flops: for MFU (no MFU without a known peak).
        start: the step and tokens where the run (or its resume) begins.
    """

    def __init__(
        self,
        run: RunOptions,
        run_config: dict[str, Any],
        *,
        resolved: str,
        rank: int,
        world: int,
        flops_per_token: float,
        peak_flops: float | None,
        start: tuple[int, int],
    ) -> None:
        self.run = run
        self.rank = rank
        self.world = world
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.metrics = MetricsLog(run.workspace, run.wandb, run.wandb_dir, run_config) if rank == 0 else None
        if rank == 0:
            atomic_write_text(run.workspace / RESOLVED, resolved)
        self.started = (*start, time.monotonic())
        self._last = self.started
        self.bar: Any = None
        # Without a terminal (a file, a pipe) rank 0 logs lines instead of the bar, which would show nothing.
        self.lines = rank == 0 and not on_terminal()
        self.blocks: Any = None

    @contextlib.contextmanager
    def open(self) -> Iterator[RunLog]:
        """The progress bar (rank 0, on a terminal) and this rank's block-id file, while the loop runs."""
        with contextlib.ExitStack() as stack:
            if self.rank == 0 and not self.lines:
                from tqdm import tqdm

                bar = tqdm(total=self.run.train_iters, initial=self.started[0], unit="step", desc="train")
                self.bar = stack.enter_context(bar)
            if self.run.log_block_ids:
                self.run.workspace.mkdir(parents=True, exist_ok=True)
                path = self.run.workspace / f"block_ids_rank{self.rank}.jsonl"
                self.blocks = stack.enter_context(open_records(path))
            try:
                yield self
            finally:
                self.bar = self.blocks = None

    def should_log(self, step: int) -> bool:
        r = self.run
        return step % r.log_interval == 0 or r.log_block_ids or step == 1 or step == r.train_iters

    def stepped(self, step: int, ids: list[Any]) -> None:
        """A step is done: the bar moves, its block ids are written."""
        if self.bar is not None:
            self.bar.update(1)
        if self.blocks is not None:
            try:
                self.blocks.write(json.dumps({"step": step, "block_ids": ids}) + "\n")
                self.blocks.flush()
            except OSError as exc:
                room = out_of_room(self.run.workspace, exc)
                if room is None:
                    raise
                path = self.run.workspace / f"block_ids_rank{self.rank}.jsonl"
                raise NoRoomError(
                    f"{path}: step {step}'s block ids could not be written, {room}; the "
                    "checkpoints saved are kept: free space there and run the same command to resume"
                ) from None

    def log_train(
        self,
        step: int,
        tokens: int,
        device_losses: list[torch.Tensor],
        ids: list[Any],
        lr: float,
        *,
        grad_norm: float | None = None,
        collection_tokens: dict[str, int] | None = None,
    ) -> None:
        """The ``train`` record of ``step`` (a log step): mean loss, rate, tokens/s since the last one."""
        losses = torch.stack(device_losses).float().cpu().tolist()
        loss = sum(losses) / len(losses)
        now = time.monotonic()
        _, last_tokens, last_time = self._last
        tps = (tokens - last_tokens) / max(now - last_time, 1e-9)
        self._last = (step, tokens, now)
        record: dict[str, Any] = {"event": "train", "step": step, "loss": loss, "lr": lr,
                                  "grad_norm": grad_norm, "tokens": tokens, "tokens_per_s": tps}  # fmt: skip
        if self.peak_flops:
            # Per rank: tokens/s counts every rank's tokens, and each rank has its own device.
            record["mfu"] = tps / self.world * self.flops_per_token / self.peak_flops
        if device_losses[0].is_cuda:
            # The most this rank's device allocator held since the run (or its resume) began.
            record["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        if self.run.log_block_ids:
            record.update(block_ids=ids, losses=losses)
        if collection_tokens is not None:
            record["collection_tokens"] = collection_tokens
        if self.bar is not None:
            shown = {"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", "tok_s": f"{tps:,.0f}"}
            if "mfu" in record:
                shown["mfu"] = f"{record['mfu']:.1%}"
            self.bar.set_postfix(shown)
        if self.lines:
            mfu = f", MFU {record['mfu']:.1%}" if "mfu" in record else ""
            log.info("step %d/%d: loss %.4f, lr %.2e, %s tokens/s%s", step, self.run.train_iters, loss, lr,
                     f"{tps:,.0f}", mfu)  # fmt: skip
        self.write(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        """An ``eval`` record; without a terminal also a line with its validation loss, perplexity and
        bits per byte."""
        if self.lines and record.get("val_loss") is not None:
            bpb = f", bpb {record['val_bpb']:.3f}" if record.get("val_bpb") is not None else ""
            log.info("step %d: validation loss %.4f, perplexity %.2f%s on %s tokens (--eval_iters %d)",
                     record["step"], record["val_loss"], record["val_ppl"], bpb, f"{record['val_tokens']:,}",
                     record["eval_iters"])  # fmt: skip
        self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        if self.metrics:
            self.metrics.write(record)

    def tokens_per_s(self, tokens: int) -> float:
        """Tokens/s since the run (or its resume) began."""
        return (tokens - self.started[1]) / max(time.monotonic() - self.started[2], 1e-9)

    def close(self, summary: dict[str, Any]) -> str | None:
        """The ``end`` record; the loss plot's path (rank 0, when there is one to draw)."""
        if not self.metrics:
            return None
        self.metrics.write({"event": "end", **summary})
        self.metrics.close()
        plot = plot_losses(self.metrics.path, self.run.workspace / "loss.png")
        return str(plot) if plot else None


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = [
        f"stopped: {summary['stopped']} at step {summary['step']}, {summary['tokens']:,} tokens "
        f"({summary['tokens_per_s']:,.0f} tokens/s)",
    ]
    if summary.get("val_loss") is not None:
        bpb = f", bpb {summary['val_bpb']:.3f}" if summary.get("val_bpb") is not None else ""
        lines.append(
            f"validation: loss {summary['val_loss']:.4f}, perplexity {summary['val_ppl']:.2f}{bpb} on "
            f"{summary['val_tokens']:,} tokens, the first {summary['eval_iters']} batches of the split per "
            "rank (--eval_iters; `dsgpt2 evaluate` reads all of it, so its figure differs)"
        )
    if summary.get("hellaswag_examples"):
        lines.append(f"HellaSwag: {accuracies(summary)}")
    lines.append(f"checkpoint: {summary['checkpoint']}")
    if summary.get("plot"):
        lines.append(f"loss plot: {summary['plot']}")
    if summary.get("nonfinite"):
        lines.append(f"non-finite losses skipped: {summary['nonfinite']}")
    if summary.get("skipped_documents"):
        lines.append(f"documents read: {SkipTally(summary['skipped_documents']).summary()}")
    return lines
