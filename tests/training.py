"""Training runs as the tests start them: the corpus and DeepSpeed config they train on, ds_trainer.py
forked as a user runs it (through tests/inject.py's fault hooks where asked), several ranks under the
`deepspeed` launcher or `dsgpt2 launch`, simulated nodes; and the metrics a run leaves."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, sample_corpus
from dsgpt2.train.metrics import read_metrics
from forks import python_that_forks
from pace import deadline, wait_for
from zygote import run_python

# The corpus the training tests read, one per test process (pytest's temporary directory): no test
# changes its documents, so the test modules share it instead of each building its own (about 6 s).
_CORPORA: dict[Path, dict[str, Path]] = {}


CONTEXT = 64  # the tiny preset's context in the training tests (trainer_args)


def training_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2,000 sample documents in a file-backed store, a 512-token vocabulary and a DeepSpeed config for
    the tiny preset on CPU: {"config", "tok", "ds", "base"}, built once per test process."""
    key = tmp_path_factory.getbasetemp()
    if key not in _CORPORA:
        base = tmp_path_factory.mktemp("train")
        corpus = sample_corpus(base)
        ds = base / "ds.json"
        ds.write_text(
            json.dumps(
                {
                    "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 2,
                    "gradient_clipping": 1.0,
                    "optimizer": {
                        "type": "AdamW",
                        "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True},
                    },
                    "scheduler": {
                        "type": "WarmupDecayLR",
                        "params": {"warmup_num_steps": 2, "warmup_max_lr": 3e-3},
                    },
                    "zero_optimization": {"stage": 0},
                    "steps_per_print": 1000000,
                }
            )
        )
        _CORPORA[key] = {**corpus, "ds": ds, "base": base}
    return _CORPORA[key]


def at_stage(corpus: dict[str, Path], where: Path, stage: int) -> dict[str, Path]:
    """``corpus`` with its DeepSpeed config at ZeRO ``stage`` (a copy written in ``where``)."""
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": stage}
    where.mkdir(parents=True, exist_ok=True)
    (where / "ds.json").write_text(json.dumps(ds))
    return dict(corpus, ds=where / "ds.json")


def trainer_args(corpus: dict[str, Path], run: Path, *extra: str) -> list[str]:
    """ds_trainer.py's flags for the tiny preset on ``corpus``, checkpoints and workspace in ``run``, a
    metrics record and the block ids of every step; ``extra`` after them."""
    return [
        "--deepspeed_config",
        str(corpus["ds"]),
        "--config_train",
        str(corpus["config"]),
        "--vocab_dir",
        str(corpus["tok"]),
        "--model_select",
        "tiny",
        "--context_length",
        str(CONTEXT),
        "--tr_ratio",
        "0.9",
        "--chunk_docs",
        "100",
        "--num_workers",
        "2",
        "--seed",
        "7",
        "--wandb",
        "off",
        "--eval_interval",
        "1000",
        "--eval_iters",
        "2",
        "--log_interval",
        "1",
        "--log_block_ids",
        "--ckpt_dir",
        str(run / "ckpt"),
        "--workspace",
        str(run / "ws"),
        *extra,
    ]


def train(
    corpus: dict[str, Path], run: Path, *extra: str, check: bool = True, faults: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``python ds_trainer.py`` as a user runs it (a fork of tests/zygote.py's pre-imported interpreter);
    with ``faults``, through tests/inject.py's hooks."""
    script = [str(ROOT / "tests" / "inject.py"), *faults, "--"] if faults else [str(ROOT / "ds_trainer.py")]
    result = run_python([*script, *trainer_args(corpus, run, *extra)], cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def steps(run: Path) -> dict[int, dict]:
    """The last train record of each step (a resumed run repeats the steps after its checkpoint)."""
    return {r["step"]: r for r in read_metrics(run / "ws" / "metrics.jsonl") if r["event"] == "train"}


def wait_for_steps(run: Path, count: int, proc: subprocess.Popen, after: int = 0) -> None:
    """Until ``proc`` (training into ``run``) has logged ``count`` steps past step ``after``."""
    metrics = run / "ws" / "metrics.jsonl"
    done = lambda: metrics.exists() and len([s for s in steps(run) if s > after]) >= count  # noqa: E731
    wait_for(done, 240, f"{count} training step(s)", proc)


def deepspeed_command(*faults: str) -> list[str]:
    """The `deepspeed` launcher as a user types it, its processes forks of tests/forks.py's server;
    real processes where ``faults`` kill a process group (tests/inject.py's --kill_group_after)."""
    script = str(Path(sys.executable).parent / "deepspeed")
    if "--kill_group_after" in faults:
        return [script]
    return [python_that_forks(), script]


def launch(
    corpus: dict[str, Path], run: Path, ranks: int, *extra: str, faults: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``ranks`` CPU ranks training into ``run`` under the `deepspeed` launcher, run to the end (exit 0);
    with ``faults``, through tests/inject.py's hooks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [*deepspeed_command(*faults), "--num_gpus", str(ranks), "--master_port", str(port)]
    script = [str(ROOT / "tests" / "inject.py"), *faults, "--"] if faults else [str(ROOT / "ds_trainer.py")]
    result = subprocess.run([*launcher, *script, *trainer_args(corpus, run, *extra)],
                            cwd=ROOT, capture_output=True, text=True, timeout=deadline(300))  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # DeepSpeed's CPU allreduce buffers (66 MB a rank) are not left in /dev/shm after the run.
    assert list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*")) == []
    return result


def ctrl_c(proc: subprocess.Popen, run: Path) -> None:
    """SIGINT to the launch's process group, as a terminal's Ctrl-C sends it."""
    os.killpg(proc.pid, signal.SIGINT)


def stop_rank_1(proc: subprocess.Popen, run: Path) -> None:
    """SIGTERM to rank 1 of the launch training into ``run`` alone (a scheduler that signals one process):
    the process its node launcher started, a real one or tests/forked_python.py passing it on to a fork."""
    import psutil

    def rank_1(p: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            line = p.cmdline()
            return "--local_rank=1" in line and str(run / "ws") in line
        return False

    ranks = [p for p in psutil.process_iter() if rank_1(p)]
    [rank] = [p for p in ranks if p.parent() not in ranks]  # not its DataLoader workers
    rank.send_signal(signal.SIGTERM)


def launch_and_stop(
    launcher: list[str], corpus: dict[str, Path], run: Path, after: int = 0, stop: Any = ctrl_c
) -> tuple[subprocess.Popen, str, list[str]]:
    """``launcher`` (2 CPU ranks) training into ``run``, ``stop``-ped once it has taken 2 steps past step
    ``after``: the launcher, what it printed once every process of its group closed its output, and
    the ranks' stop lines. Both ranks saved the same step, which ``latest`` names."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = trainer_args(
        corpus, run, "--train_iters", "100000", "--save_interval", "100000", "--num_workers", "1"
    )
    command = [*launcher, "--num_gpus", "2", "--master_port", str(port), str(ROOT / "ds_trainer.py"), *args]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    import psutil

    try:
        wait_for_steps(run, 2, proc, after=after)
        stop(proc, run)
        # Every rank and the launcher hold the pipe: it closes when the last of them ends.
        out = proc.communicate(timeout=deadline(120))[0]
    finally:
        # `dsgpt2 launch` runs the launcher in a process group of its own: the whole tree goes.
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    stops = [line for line in out.splitlines() if "dsgpt2.train.trainer: " in line and "saving" in line]
    last = max(steps(run))
    assert (run / "ckpt" / "latest").read_text() == f"global_step{last}", out[-3000:]
    for rank in range(2):
        assert [r["step"] for r in read_metrics(run / "ws" / f"block_ids_rank{rank}.jsonl")][-1] == last
    return proc, out, stops


def launch_nodes(
    corpus: dict[str, Path],
    run: Path,
    per_node: list[list[str]],
    *extra: str,
    faults: list[list[str]] | None = None,
    expect: tuple[int, ...] = (0, 0),
) -> list[tuple[str, float]]:
    """One `deepspeed --no_ssh --node_rank R` launch per simulated node (a hostfile with 1 and 2
    slots: world 3), all at once, each its own process group; ``per_node``: each node's own flags,
    ``faults``: each node's tests/inject.py flags. Returns each node's output and when it ended."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hostfile = run / "hostfile"
    run.mkdir(parents=True, exist_ok=True)
    hostfile.write_text("node0 slots=1\nnode1 slots=2\n")
    every_fault = [flag for node in faults or () for flag in node]
    launcher = [*deepspeed_command(*every_fault), "--hostfile", str(hostfile), "--no_ssh",
                "--master_addr", "127.0.0.1", "--master_port", str(port)]  # fmt: skip
    nodes, logs = [], []
    for rank, own in enumerate(per_node):
        inject = [str(ROOT / "tests" / "inject.py"), *faults[rank], "--"] if faults and faults[rank] else []
        script = inject or [str(ROOT / "ds_trainer.py")]
        argv = [*launcher, "--node_rank", str(rank), *script, *trainer_args(corpus, run, *extra, *own)]
        logs.append(open(run / f"node{rank}.log", "w+"))  # noqa: SIM115 - closed below
        nodes.append(subprocess.Popen(argv, cwd=ROOT, stdout=logs[-1], stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    ended = [0.0] * len(nodes)
    end_by = time.monotonic() + deadline(400)
    while not all(ended) and time.monotonic() < end_by:
        for i, node in enumerate(nodes):
            if not ended[i] and node.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.2)
    results = []
    for node, log, end in zip(nodes, logs, ended, strict=True):
        if not end:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        log.seek(0)
        results.append((log.read(), end))
        log.close()
    for (out, end), code, node in zip(results, expect, nodes, strict=True):
        assert end, "a node did not end: " + out[-3000:]
        assert node.returncode == code, out[-3000:]
    return results
