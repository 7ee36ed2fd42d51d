"""Run metrics: JSON lines in the run directory, wandb (offline by default), the loss plot."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from dsgpt2.errors import NoRoomError
from dsgpt2.files import open_records, out_of_room, output_writer

log = logging.getLogger(__name__)


# Dense bf16/fp16 tensor-core peaks, TFLOP/s, by a piece of torch.cuda.get_device_name(); the
# first piece found wins, so the more specific names come first.
HALF_PRECISION_PEAKS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 125.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),
    ("T4", 65.0),
)


def device_peak_tflops(name: str, precision: str) -> float | None:
    """The peak TFLOP/s of a GPU named ``name`` at ``precision``; None where unknown (fp32, CPUs)."""
    if precision not in ("bf16", "fp16"):
        return None
    return next((peak for piece, peak in HALF_PRECISION_PEAKS if piece in name), None)


def peak_flops(flag_tflops: float | None, device: str, ds_config: dict[str, Any]) -> float | None:
    """FLOP/s that MFU divides by: ``--peak_tflops``, else the GPU's known peak; None: no MFU."""
    if flag_tflops is not None:
        return flag_tflops * 1e12
    if device != "cuda":
        return None
    import torch

    from dsgpt2.optim.ds_config import precision

    name = torch.cuda.get_device_name()
    peak = device_peak_tflops(name, precision(ds_config))
    if peak is None:
        log.info("no known peak FLOP/s for %s at %s: MFU not logged (set --peak_tflops)", name,
                 precision(ds_config))  # fmt: skip
        return None
    return peak * 1e12


class MetricsLog:
    """Writes one JSON object per event to ``run_dir/metrics.jsonl`` and mirrors it to wandb."""

    def __init__(
        self, run_dir: Path, wandb_mode: str, wandb_dir: Path | None, config: dict[str, Any]
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._made = not self.path.exists()
        self._f = open_records(self.path)  # open for the whole run; a torn last line, one readers skip
        self._wandb: Any = None
        if wandb_mode != "off":
            self._wandb = _start_wandb(wandb_mode, wandb_dir or run_dir, config)

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        try:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as exc:
            raise self._unwritten(exc) from None
        if self._wandb is not None:
            numbers = {
                k: v for k, v in record.items() if isinstance(v, int | float) and k not in ("time", "step")
            }
            if numbers:
                self._wandb.log(numbers, step=record.get("step"))

    def _unwritten(self, exc: OSError) -> Exception:
        """What the run says where a record could not be written: a full disk in one line (a file this
        run made and wrote nothing to removed); any other error as it is."""
        room = out_of_room(self.path.parent, exc)
        if room is None:
            return exc
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(OSError):
            if self._made and self.path.stat().st_size == 0:
                self.path.unlink()
        return NoRoomError(
            f"{self.path}: a record could not be written, {room}; the checkpoints saved are kept: free space "
            "there and run the same command to resume"
        )

    def close(self) -> None:
        self._f.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(mode: str, directory: Path, config: dict[str, Any]) -> Any:
    # Never prompt: offline unless asked, and no login questions in any mode.
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["WANDB_MODE"] = mode
    try:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        return wandb.init(project="dsgpt2", dir=str(directory), config=config, mode=mode, reinit=True)
    except Exception as exc:  # wandb is optional to a run: its failure must not end training
        log.warning("wandb disabled: %s", exc)
        return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``path``; a line that is no whole record (a run killed while writing it) is
    skipped, with a warning that names it."""
    records, damaged = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                damaged.append(number)
    if damaged:
        lines = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        log.warning("%s: %d line(s) that are no whole record skipped (line %s)", path, len(damaged), lines)
    return records


def plot_losses(metrics_path: Path, out: Path) -> Path | None:
    """Plot training and validation loss against step into ``out`` (PNG); the validation curve's
    label carries its last bits per byte (the figure that compares runs of different tokenizers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [
        (r["step"], r["loss"]) for r in records if r.get("event") == "train" and math.isfinite(r["loss"])
    ]
    evals = [r for r in records if r.get("event") == "eval" and "val_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in evals]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if val:
        bpb = evals[-1].get("val_bpb")
        last = f" (step {evals[-1]['step']}: {bpb:.3f} bits per byte)" if bpb is not None else ""
        ax.plot(*zip(*val, strict=True), marker="o", label=f"validation loss{last}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with output_writer(out, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out
