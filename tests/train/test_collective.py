"""The run's own collectives over a real gloo group of two processes: a peer that dies or freezes
ends the other within the group's timeout, and a long single-rank work (a cache build) does not."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from pace import deadline

# Rank 1 works alone for WORK seconds (ticking) while rank 0 waits, under a TIMEOUT-second group;
# FAULT: none, or what happens to rank 1 a second into its work.
SCRIPT = """
import datetime, os, signal, sys, time
import torch.distributed as dist
from dsgpt2.errors import PeerLostError
from dsgpt2.collective import Rounds, peer_lost

rank, timeout, work, fault = int(os.environ["RANK"]), float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if fault == "freezes-in-a-group":  # as the trainer starts: the timeout of the groups made later too
    from dsgpt2.collective import every_group_times_out_after
    every_group_times_out_after(int(timeout))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
rounds = Rounds(every=timeout / 4)
try:
    if fault == "freezes-in-a-group":  # a group of its own, as DeepSpeed's for ZeRO 1-3
        group = dist.new_group([0, 1])
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        import torch
        dist.all_reduce(torch.ones(4), group=group)
    if rank == 1:
        start = time.monotonic()
        while time.monotonic() - start < work:
            time.sleep(0.05)
            rounds.tick()
            if time.monotonic() - start > 1 and fault != "none":
                os.kill(os.getpid(), signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
    print("outcomes", rounds.finish(f"rank {rank}"), flush=True)
    # As the trainer ends: a group left to interpreter exit can abort the process (gloo's threads).
    dist.barrier()
    dist.destroy_process_group()
except RuntimeError as exc:
    lost = peer_lost(exc, int(timeout), "step 3", None)
    if lost is None:
        raise
    print(lost, flush=True)
    sys.exit(lost.exit_code)
"""


def _two_ranks(timeout: float, work: float, fault: str) -> tuple[subprocess.CompletedProcess, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-c", SCRIPT, str(timeout), str(work), fault]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]  # fmt: skip
    start = time.monotonic()
    out, _ = procs[0].communicate(timeout=deadline(120))
    elapsed = time.monotonic() - start
    if procs[1].poll() is None:
        procs[1].kill()  # frozen: SIGKILL reaches a stopped process
    procs[1].communicate(timeout=deadline(60))
    return subprocess.CompletedProcess(cmd, procs[0].returncode, out), elapsed


@pytest.mark.slow
def test_a_long_single_rank_work_outlasts_the_timeout_without_ending_the_run() -> None:
    done, elapsed = _two_ranks(timeout=2, work=6, fault="none")
    assert done.returncode == 0, done.stdout
    assert "outcomes ['rank 0', 'rank 1']" in done.stdout
    assert elapsed > 6


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "said"),
    [
        ("dies", "rank 0 of 2 stops at step 3: a rank or node of the run died (its connection from"),
        ("freezes", "stops at step 3: another rank or node stopped answering for --dist_timeout 3 s"),
        # Under a group made after the start (DeepSpeed's, at ZeRO 1-3): torch's own 30 minutes without
        # the trainer's default.
        ("freezes-in-a-group", "another rank or node stopped answering for --dist_timeout 3 s"),
    ],
)
def test_a_peer_that_dies_or_freezes_mid_work_ends_the_other_in_bounded_time(fault: str, said: str) -> None:
    lost, elapsed = _two_ranks(timeout=3, work=30, fault=fault)
    assert lost.returncode == 3, lost.stdout
    assert said in lost.stdout and "Traceback" not in lost.stdout
    assert elapsed < deadline(15) + 1 + 2 * 3  # start-up, the work's first second, a timeout or two


def test_a_rank_unlinks_its_deepspeed_shm_buffer_only_where_all_ranks_share_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSpeed's CPU allreduce leaves a 66 MB buffer per rank in /dev/shm; the trainer removes its
    rank's name once the ranks have mapped them, and only where DeepSpeed made them (LOCAL_SIZE equal
    to WORLD_SIZE), so that every rank takes the same barrier or none does."""
    from pathlib import Path

    from dsgpt2.collective import SHM_BUFFER, release_shared_buffer

    port = str(os.getpid())
    env = {"MASTER_ADDR": "test-addr", "MASTER_PORT": port, "RANK": "1", "WORLD_SIZE": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = Path(SHM_BUFFER.format(uid=os.getuid(), addr="test-addr", port=port, rank=1))
    path.write_bytes(b"buffer")
    try:
        monkeypatch.setenv("LOCAL_SIZE", "1")  # ranks on two machines: no buffer of this run
        assert not release_shared_buffer() and path.exists()
        monkeypatch.setenv("LOCAL_SIZE", "2")
        assert not release_shared_buffer("cuda") and path.exists()  # NCCL ranks: none of DeepSpeed's
        assert release_shared_buffer() and not path.exists()
        assert not release_shared_buffer()
    finally:
        path.unlink(missing_ok=True)


def test_a_port_taken_before_a_lone_process_listens_is_chosen_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process without a launcher picks its own MASTER_PORT; another process may take it before the
    group listens (EADDRINUSE): another port is chosen. A port the launcher gave is not this one's to
    change: the error stands."""
    import deepspeed

    from dsgpt2.train.engine import start_process_group

    calls: list[str] = []

    def init(**kw: object) -> None:
        calls.append(os.environ["MASTER_PORT"])
        if len(calls) == 1:
            raise RuntimeError("The server socket has failed to listen ... code: -98, name: EADDRINUSE")

    monkeypatch.setattr(deepspeed, "init_distributed", init)
    import torch.distributed.distributed_c10d as c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):  # given back as they were
        monkeypatch.setattr(c10d, name, getattr(c10d, name, None), raising=False)
    monkeypatch.setenv("MASTER_PORT", "1")
    start_process_group("gloo", 30, own_port=True)
    assert len(calls) == 2 and calls[0] == "1" and calls[1] != "1"
    calls.clear()
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(RuntimeError, match="EADDRINUSE"):
        start_process_group("gloo", 30, own_port=False)
    assert calls == ["1"]


def test_ranks_reading_other_documents_or_token_ids_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Paths may differ between nodes, what they hold may not: a node whose connection config names other
    collections or a FILTER, or whose --vocab_dir holds another tokenizer, would train on other documents
    or token ids beside the others. Where a node reaches the database (its address, its patience) is its
    own."""
    from dsgpt2 import collective
    from dsgpt2.db.config import MongoConfig
    from dsgpt2.errors import ConfigError

    def ranks(rank0: tuple[MongoConfig, str], rank1: tuple[MongoConfig, str]) -> None:
        """Rank 0 started with ``rank0`` (connection config, tokenizer hash), ranks 1 and 2 with ``rank1``."""
        told: list[dict] = []
        monkeypatch.setattr(collective, "gather", lambda value: told.append(value) or [value])
        for config, tokenizer in (rank1, rank0):
            collective.same_on_every_rank({"seed": 7}, {"zero_optimization": {"stage": 0}},
                                          corpus=config.corpus_keys(), tokenizer=tokenizer)  # fmt: skip
        monkeypatch.setattr(collective, "gather", lambda value: [value, told[0], told[0]])
        config, tokenizer = rank0
        collective.same_on_every_rank({"seed": 7}, {"zero_optimization": {"stage": 0}},
                                      corpus=config.corpus_keys(), tokenizer=tokenizer)  # fmt: skip

    news = MongoConfig(uri="mongodb://u:pw@node0:27017", db="corpus", collections=("news",))
    reached_otherwise = MongoConfig(uri="mongodb://u:pw@10.0.0.9:27017", db="corpus", collections=("news",),
                                    retries=9, read_preference="secondaryPreferred")  # fmt: skip
    ranks((news, "abc"), (reached_otherwise, "abc"))
    wiki = MongoConfig(uri=news.uri, db="corpus", collections=("wiki",))
    english = MongoConfig(uri=news.uri, db="corpus", collections=("news",), filter='{"lang": "en"}')
    for rank1, said in [
        ((wiki, "abc"), "the connection config's COLLECTIONS is ['news'] on rank 0 and ['wiki'] on rank(s) "
                        "1, 2"),
        ((english, "abc"), "the connection config's FILTER is {} on rank 0 and {'lang': 'en'} on rank(s) "
                           "1, 2"),
        ((news, "def"), "the tokenizer (the SHA-256 of --vocab_dir's tokenizer.json) is 'abc' on rank 0 and "
                        "'def' on rank(s) 1, 2"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            ranks((news, "abc"), rank1)
        line = str(refused.value)
        assert line.startswith("the ranks were started with different settings: ") and said in line, line
        assert "pw" not in line and "\n" not in line
