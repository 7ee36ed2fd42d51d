"""Timing and reporting helpers shared by the benchmarks."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


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


def loss_fell(first: float | None, last: float | None) -> bool:
    """Whether a training run learnt: its last step's loss at least 1 % below its first. A run whose
    gradients vanish moves by the noise of its batches only (9.137 → 9.135 over 32 steps at 112m)."""
    return first is not None and last is not None and math.isfinite(last) and last < 0.99 * first


def learnt(*runs: dict[str, Any]) -> bool:
    """Whether every one of ``runs`` learnt (its loss fell): only then are its figures figures."""
    return all(loss_fell(r.get("first_loss"), r.get("last_loss")) for r in runs)


def loss_column(r: dict[str, Any]) -> str:
    """A run's first and last loss for its report line; FAIL where it did not fall (its speed is then
    no figure)."""
    first, last = r.get("first_loss"), r.get("last_loss")
    if first is None or last is None:
        return "loss not recorded: FAIL"
    verdict = "" if loss_fell(first, last) else ": FAIL, did not fall"
    return f"loss {first:.3f} → {last:.3f}{verdict}"


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


class _Answer:
    def __init__(self, docs: list[Any]) -> None:
        self._docs = docs

    def batch_size(self, _n: int) -> _Answer:
        return self

    def __iter__(self) -> Any:
        return iter(self._docs)


_DATABASE: dict[str, Any] = {}


def database_uri() -> str:
    """``local://`` on a temporary directory: the embedded database the benchmarks of this process share,
    stopped and removed when the process ends."""
    if "uri" not in _DATABASE:
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        from dsgpt2.db import embedded

        directory = Path(tempfile.mkdtemp(prefix="dsgpt2-bench-db-"))
        owner = os.getpid()

        def remove() -> None:
            if os.getpid() == owner:  # not in a forked worker
                embedded.stop(directory)
                shutil.rmtree(directory, ignore_errors=True)

        atexit.register(remove)
        _DATABASE["uri"] = f"{embedded.PREFIX}{directory}"
    return str(_DATABASE["uri"])


class instant_backend:
    """Answer every ``find()`` from answers recorded beforehand: a server at no cost.

    ``warm`` makes the queries to record; inside the block the same queries are answered from
    the recording (an unrecorded one fails), in this process and in the processes it forks. What
    remains to be timed is dsgpt2's own path, not a server's reads.
    """

    def __init__(self, warm: Callable[[], object]) -> None:
        self._warm = warm

    def __enter__(self) -> instant_backend:
        from pymongo.collection import Collection

        self._cls, self._find = Collection, Collection.find
        answers: dict[str, list[Any]] = {}
        real = self._find

        def record(coll: Any, filt: Any = None, *a: Any, **k: Any) -> Any:
            key = repr((coll.full_name, filt, a, k))
            docs = answers[key] = list(real(coll, filt, *a, **k))
            return _Answer(docs)

        Collection.find = record
        try:
            self._warm()
        finally:
            Collection.find = lambda coll, filt=None, *a, **k: _Answer(
                answers[repr((coll.full_name, filt, a, k))]
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self._cls.find = self._find
