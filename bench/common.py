"""Timing and reporting helpers shared by the benchmarks."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Metric:
    """One benchmark line: our figure, the anchor's, their ratio and the target."""

    name: str
    ours: float
    anchor: float
    unit: str
    target: str
    passed: bool
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.anchor if self.anchor else float("inf")

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        note = f"  ({self.note})" if self.note else ""
        return (
            f"{self.name:<48} ours={self.ours:>12.4g} {self.unit:<10} anchor={self.anchor:>12.4g} "
            f"ratio={self.ratio:>8.3f}  target {self.target:<14} {verdict}{note}"
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_times(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median times of ``a`` and ``b`` run alternately, so that machine noise hits both alike."""
    a()
    b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


def write_results(metrics: list[Metric], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([m.to_dict() for m in metrics], indent=2) + "\n")
