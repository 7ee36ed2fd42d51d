"""Several ranks and nodes: two CPU ranks (gloo) under the `deepspeed` launcher and `dsgpt2 launch`,
simulated nodes with disks of their own, a node lost mid-run, a resume on another number of ranks,
an experiment file under the launcher, HellaSwag scored across ZeRO-3 ranks. Each launch costs a few
processes' start-up (torch, DeepSpeed and transformers imported in each): one run serves every check
it can."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, check_lineage, run_cli, store_config
from dsgpt2.corpus.ingest import ingest
from dsgpt2.corpus.readers import builtin_source
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.train.metrics import read_metrics
from forks import python_that_forks
from pace import deadline
from training import (
    at_stage,
    deepspeed_command,
    launch,
    launch_and_stop,
    launch_nodes,
    steps,
    stop_rank_1,
    train,
    trainer_args,
    training_corpus,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2,000 sample documents in a file-backed store, and a 512-token vocabulary."""
    return training_corpus(tmp_path_factory)


def test_a_nan_on_one_rank_of_two_is_skipped_by_both_and_trains_the_same_model_at_zero_0_and_1(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Micro-batch 3 of 4 is NaN on rank 1 only. Both ranks skip it, in order, and draw another; at ZeRO 0
    the step drops its gradients and recomputes micro-batches 1 and 2 (no hook), at ZeRO 1 the guard's
    hooks zero it: the same losses, nothing non-finite in the weights; each checkpoint resumes on one
    rank."""
    runs = {}
    for stage in (0, 1):
        ds = json.loads(corpus["ds"].read_text())
        ds["gradient_accumulation_steps"] = 4
        ds["zero_optimization"] = {"stage": stage}
        where = tmp_path / f"zero{stage}"
        where.mkdir()
        (where / "ds.json").write_text(json.dumps(ds))
        nan = ("--nonfinite_at", "3", "--nonfinite_rank", "1")
        done = launch(dict(corpus, ds=where / "ds.json"), where, 2, "--train_iters", "3",
                      "--save_interval", "100", "--num_workers", "1", faults=nan)  # fmt: skip
        assert "non-finite losses skipped: 1" in done.stdout
        records = read_metrics(where / "ws" / "metrics.jsonl")
        assert [(r["step"], r["micro"]) for r in records if r["event"] == "nonfinite"] == [(0, 3)]
        runs[stage] = steps(where)
    assert sorted(runs[0]) == sorted(runs[1]) == [1, 2, 3]
    for step in (1, 2, 3):
        a, b = runs[0][step], runs[1][step]
        assert a["block_ids"] == b["block_ids"], step
        for x, y in zip(a["losses"], b["losses"], strict=True):
            assert math.isfinite(x) and abs(x - y) <= 1e-5, (step, x, y)
    # Each checkpoint resumes on one rank: at ZeRO 0 every rank held the whole Muon state; ZeRO 1 cut
    # it per rank, and the resume converts it to DeepSpeed's universal form first.
    for stage in (0, 1):
        where = tmp_path / f"zero{stage}"
        resumed = train(dict(corpus, ds=where / "ds.json"), where, "--train_iters", "4", "--save_interval",
                        "100", "--num_workers", "1")  # fmt: skip
        assert "was saved by 2 rank(s); this run has 1" in resumed.stderr
        assert ("global_step3.universal" in resumed.stderr) == (stage == 1), resumed.stderr[-3000:]
        assert sorted(steps(where)) == [1, 2, 3, 4] and math.isfinite(steps(where)[4]["loss"])


def test_ctrl_c_under_the_launcher_saves_every_rank_names_sigint_and_exits_as_one_process_then_resumes(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT to the launch's process group) with two ranks: `dsgpt2 launch` ends as a single
    process does (both ranks save after the same step, the log says SIGINT, exit 0); under the plain
    `deepspeed` command, whose launcher passes the SIGINT on as a SIGTERM, the ranks still name SIGINT and
    save, and the run resumes from the first stop; a SIGTERM to one rank stops both at one step."""
    proc, out, stops = launch_and_stop([sys.executable, "-m", "dsgpt2", "launch"], corpus, tmp_path)
    assert proc.returncode == 0, out[-3000:]
    assert len(stops) == 2 and all("trainer: SIGINT: saving a checkpoint" in s for s in stops), out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    first = max(steps(tmp_path))
    assert f"stopped: SIGINT at step {first}" in out

    plain = [str(Path(sys.executable).parent / "deepspeed")]
    proc, out, stops = launch_and_stop(plain, corpus, tmp_path, after=first)
    assert len(stops) == 2 and all("trainer: SIGINT: saving a checkpoint" in s for s in stops), out[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / f'global_step{first}'}" in out
    second = max(steps(tmp_path))
    assert first + 1 in steps(tmp_path) and second >= first + 2
    # DeepSpeed's runner does not end as one process does (why `dsgpt2 launch`): it dies of the SIGINT
    # itself, or, when its node launcher ended first, exits with the launcher's 1.
    assert proc.returncode in (-signal.SIGINT, 1), proc.returncode

    # The signal to one process alone, not to a group: its launch may be made of forks (tests/forks.py).
    launch = [python_that_forks(), "-m", "dsgpt2", "launch"]
    proc, out, stops = launch_and_stop(launch, corpus, tmp_path, after=second, stop=stop_rank_1)
    assert proc.returncode == 0, out[-3000:]
    said = {("[rank 1]" in s, s.split("dsgpt2.train.trainer: ")[1]) for s in stops}
    assert said == {
        (True, "SIGTERM: saving a checkpoint after the current step, then exiting"),
        (False, "stopping with the other ranks (SIGTERM): saving a checkpoint"),
    }, out[-3000:]
    assert f"stopped: SIGTERM at step {max(steps(tmp_path))}" in out


def test_two_nodes_each_with_its_own_disk_read_the_epoch_once(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Two nodes (1 + 2 ranks), streaming and cached, each with its own cache directory (node-local
    disks): one cache per node, built by the node's first rank; across the 3 ranks, epoch 0's blocks
    are exactly those of a one-rank run's epoch 0, none twice."""
    cfg, _ = store_config(tmp_path, ["small"])
    ingest(Connection(load_config(cfg)), "small", [builtin_source("stdlib", 150)])
    small = dict(corpus, config=cfg)
    common = ("--chunk_docs", "10", "--save_interval", "1000", "--num_workers", "1")
    train(small, tmp_path / "one", "--train_iters", "40", *common)
    whole = [tuple(b) for r in read_metrics(tmp_path / "one" / "ws" / "block_ids_rank0.jsonl")
             for b in r["block_ids"] if b[0] == 0]  # fmt: skip
    for mode in ("streaming", "cached"):
        caches = [tmp_path / mode / "node0-disk", tmp_path / mode / "node1-disk"]
        run = tmp_path / mode / "two"
        out = [o for o, _ in launch_nodes(small, run, [["--cache_dir", str(c)] for c in caches],
                                           "--train_iters", "24", *common, "--data_mode", mode)]  # fmt: skip
        read = []
        for rank in range(3):
            records = read_metrics(run / "ws" / f"block_ids_rank{rank}.jsonl")
            assert records[-1]["block_ids"][-1][0] >= 1, f"{mode}: rank {rank} did not finish epoch 0"
            read += [tuple(b) for r in records for b in r["block_ids"] if b[0] == 0]
        assert len(read) == len(set(read)), f"{mode}: a block was read twice"
        assert set(read) == set(whole), mode
        if mode == "cached":
            assert all((c / "cache.json").is_file() for c in caches)
            assert "2 cache directories, built by ranks 0, 1" in out[0]
            assert not list(caches[1].glob(".rank-*"))


# Three two-node launches, two of them waiting out a 60 s --dist_timeout: beside another suite on the
# same cores it needs more than the per-test hang guard.
@pytest.mark.timeout(1200)
def test_a_lost_node_ends_the_other_within_dist_timeout_and_both_resume_exactly(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Node 1 (ranks 1 and 2) is killed at once after step 6 of 12, its checkpoint at step 4:
    node 0 ends within --dist_timeout, one line and exit 3, the checkpoint intact; the same two
    commands resume, to the straight run's blocks and losses. A node that never comes: the one
    launched ends after --dist_timeout with one line."""
    from dsgpt2.checkpoints.format import complete_tags

    cfg, _ = store_config(tmp_path, ["small"])
    ingest(Connection(load_config(cfg)), "small", [builtin_source("stdlib", 150)])
    small = dict(corpus, config=cfg)
    common = ("--chunk_docs", "10", "--save_interval", "4", "--num_workers", "1", "--train_iters", "12")
    timeout = ("--dist_timeout", "60")
    launch_nodes(small, tmp_path / "straight", [[], []], *common, *timeout)

    run = tmp_path / "lost"
    kill = [[], ["--kill_group_after", "6"]]
    nodes = launch_nodes(small, run, [[], []], *common, *timeout, faults=kill, expect=(3, -9))
    (out, end), (_, killed) = nodes
    assert end - killed < 60
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "rank 0 of 3 stops at step 7: a rank or node of the run died" in errors[0]
    assert f"the last whole checkpoint, {run / 'ckpt'}/global_step4, is kept" in errors[0]
    assert complete_tags(run / "ckpt") == ["global_step4"]
    assert (run / "ckpt" / "latest").read_text().strip() == "global_step4"

    launch_nodes(small, run, [[], []], *common, *timeout)
    straight, resumed = steps(tmp_path / "straight"), steps(run)
    assert sorted(resumed) == sorted(straight) == list(range(1, 13))
    for step in straight:
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= 1e-6, step
    for rank in range(3):
        ids = [{r["step"]: r["block_ids"] for r in read_metrics(d / "ws" / f"block_ids_rank{rank}.jsonl")}
               for d in (tmp_path / "straight", run)]  # fmt: skip
        assert ids[0] == ids[1], f"rank {rank} read other blocks"

    start = time.monotonic()
    alone = tmp_path / "alone"
    [(out, end)] = launch_nodes(small, alone, [[]], *common, "--dist_timeout", "10", expect=(3,))
    assert end - start < 10 + deadline(60)  # the launch's own start-up, then the timeout
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "stops at start-up: only 1 of 3 ranks joined the run within --dist_timeout 10 s" in errors[0]


def test_dsgpt2_train_under_the_launcher_reads_an_experiment_file_and_records_the_resolved_one(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """`deepspeed --module dsgpt2 train --config run.toml` on two ranks in cached mode: the file's flags,
    the command line over them; the resolved configuration in the run directory and the checkpoint runs
    again; one token cache for both ranks."""
    import socket

    import yaml

    from dsgpt2.optim.ds_config import read_ds_config
    from dsgpt2.train.config import parse

    flags = trainer_args(corpus, tmp_path, "--train_iters", "50", "--save_interval", "2",
                         "--num_workers", "1", "--data_mode", "cached")  # fmt: skip
    lines, i = {}, 0
    while i < len(flags):  # `--name value` / `--name` pairs, the TOML a user would write (the last wins)
        name = flags[i][2:]
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value = flags[i + 1]
            lines[name] = f"{name} = {value if value.isdigit() else json.dumps(value)}"
            i += 2
        else:
            lines[name] = f"{name} = true"
            i += 1
    run_file = tmp_path / "run.toml"
    run_file.write_text("\n".join(lines.values()) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [*deepspeed_command(), "--num_gpus", "2", "--master_port", str(port)]
    result = subprocess.run(
        [*launcher, "--module", "dsgpt2", "train", "--config", str(run_file), "--train_iters", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=deadline(300),
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "2 rank(s)" in result.stdout + result.stderr
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"  # 4 from the command line
    # Cached mode: one token cache built by rank 0 for both, one verdict on the corpus, disjoint chunks
    # (streaming: the elastic test).
    chunks = []
    for rank in range(2):
        records = read_metrics(tmp_path / "ws" / f"block_ids_rank{rank}.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        chunks.append({c for r in records for _, c, _ in r["block_ids"]})
    assert chunks[0] and chunks[1] and chunks[0].isdisjoint(chunks[1])
    assert (tmp_path / "ws" / "cache" / "cache.json").is_file()
    resolved = tmp_path / "ws" / "config.yaml"
    values = yaml.safe_load(resolved.read_text())
    assert values["train_iters"] == 4 and values["save_interval"] == 2 and values["context_length"] == 64
    assert values["log_block_ids"] is True and values["config_train"] == str(corpus["config"])
    assert (tmp_path / "ckpt" / "global_step4" / "config.yaml").read_text() == resolved.read_text()
    # The resolved file runs the same configuration again.
    again = parse(["--config", str(resolved)])
    from_file = parse(["--config", str(run_file), "--train_iters", "4"])
    # What the run decided of what the file left open (Muon, WSD, their settings), as it did: from the
    # DeepSpeed config it read.
    from_file.settle(None, None, read_ds_config(corpus["ds"]))
    assert again.to_dict() == from_file.to_dict()


def test_hellaswag_at_each_evaluation_on_two_zero3_ranks_equals_evaluating_the_checkpoint(
    corpus: dict[str, Path], tmp_path: Path, sample_texts: list[str]
) -> None:
    """--hellaswag on two gloo ranks under ZeRO-3: nine examples, four scored on each rank (the one
    left over left out, so both ranks run the same forwards), logged at every evaluation; the final
    record's accuracies are those `dsgpt2 evaluate --hellaswag` takes of the final checkpoint."""
    from corpora import examples

    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples(sample_texts, 9)))
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": 3}
    (tmp_path / "ds3.json").write_text(json.dumps(ds))
    staged = dict(corpus, ds=tmp_path / "ds3.json")
    result = launch(staged, tmp_path, 2, "--train_iters", "4", "--eval_interval", "2", "--save_interval",
                     "100", "--num_workers", "1", "--hellaswag", str(path))  # fmt: skip
    assert "HellaSwag: acc" in result.stdout + result.stderr
    evals = [r for r in read_metrics(tmp_path / "ws" / "metrics.jsonl") if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["hellaswag_examples"] == 8 and "val_loss" in r for r in evals)
    end = [r for r in read_metrics(tmp_path / "ws" / "metrics.jsonl") if r["event"] == "end"][-1]
    assert end["hellaswag_acc"] == evals[-1]["hellaswag_acc"]

    report = tmp_path / "report.json"
    alone = run_cli("evaluate", "--model", str(tmp_path / "ckpt"), "--config", str(corpus["config"]),
                    "--hellaswag", str(path), "--hellaswag_limit", "8", "--report", str(report),
                    "--no_record")  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    metrics = json.loads(report.read_text())["metrics"]
    assert metrics["hellaswag_examples"] == 8
    assert metrics["hellaswag_acc"] == evals[-1]["hellaswag_acc"]
    assert metrics["hellaswag_acc_norm"] == evals[-1]["hellaswag_acc_norm"]


def test_a_zero_2_run_resumes_on_another_number_of_ranks_from_its_universal_form_reading_every_block_once(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """ZeRO 1 and 2 cut the optimizer state per rank (ZeRO 1: the NaN test's checkpoint). Two ZeRO 2 Muon
    ranks stop mid-epoch; one rank resumes, from the checkpoint's universal form, converted once beside
    it: the epoch's blocks, set-wise, are exactly those of a one-rank straight run, none twice; then two
    ranks again, from the one rank's checkpoint. The form carries the weights and every optimizer state
    (Muon's momentum, laid out as Muon reads it, and the AdamW moments of the other weights): resumed from
    it on the same two ranks, a run takes the same steps as one resumed from the checkpoint itself. A
    damaged shard: one line, before any conversion."""
    cfg, _ = store_config(tmp_path, ["small"])
    ingest(Connection(load_config(cfg)), "small", [builtin_source("stdlib", 150)])
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": 2}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    small = dict(corpus, config=cfg, ds=tmp_path / "ds.json")
    common = ("--chunk_docs", "10", "--save_interval", "1000", "--num_workers", "1", "--optimizer", "muon")

    def epoch0(run: Path, rank: int = 0, after: int = 0) -> list[tuple[int, int, int]]:
        records = read_metrics(run / "ws" / f"block_ids_rank{rank}.jsonl")
        return [tuple(b) for r in records if r["step"] > after for b in r["block_ids"] if b[0] == 0]

    train(small, tmp_path / "straight", "--train_iters", "40", *common)
    whole = epoch0(tmp_path / "straight")
    assert len(whole) == len(set(whole))
    last = read_metrics(tmp_path / "straight" / "ws" / "block_ids_rank0.jsonl")[-1]
    assert last["block_ids"][-1][0] == 1  # the straight run got past epoch 0

    elastic = tmp_path / "elastic"
    launch(small, elastic, 2, "--train_iters", "4", *common)
    ranks = [epoch0(elastic, 0), epoch0(elastic, 1)]
    assert ranks[0] and ranks[1] and {c for _, c, _ in ranks[0]}.isdisjoint({c for _, c, _ in ranks[1]})
    before = ranks[0] + ranks[1]
    for name in ("native", "partitioned"):
        shutil.copytree(elastic / "ckpt", tmp_path / name / "ckpt")
    resumed = train(small, elastic, "--train_iters", "40", *common)
    assert "was saved by 2 rank(s); this run has 1" in resumed.stderr
    converted = [line for line in resumed.stderr.splitlines() if "universal form" in line]
    assert len(converted) == 1 and "global_step4.universal" in converted[0], resumed.stderr[-3000:]
    both = before + epoch0(elastic, 0, after=4)
    assert len(both) == len(set(both)), "a block was trained twice"
    assert set(both) == set(whole), "a block was skipped"
    # Two ranks, then one, the leftovers of their epoch dealt anew: replayed as they were read.
    check_lineage(elastic / "ckpt", elastic / "ws", cfg, {"small": 150}, ranks=2)

    # The same two ranks, from the checkpoint and from its universal form.
    shutil.copytree(elastic / "ckpt" / "global_step4.universal",
                    tmp_path / "universal" / "ckpt" / "global_step4.universal")  # fmt: skip
    launch(small, tmp_path / "native", 2, "--train_iters", "6", *common)
    from_form = ("--ckpt_id", "global_step4.universal")
    launch(small, tmp_path / "universal", 2, "--train_iters", "6", *from_form, *common)
    native, universal = steps(tmp_path / "native"), steps(tmp_path / "universal")
    for step in (5, 6):  # step 6's loss is of the weights step 5's optimizer state moved
        assert native[step]["block_ids"] == universal[step]["block_ids"]
        for a, b in zip(native[step]["losses"], universal[step]["losses"], strict=True):
            assert abs(a - b) <= 1e-5, (step, a, b)

    grown = launch(small, elastic, 2, "--train_iters", "42", *common)  # one rank to two
    assert "global_step40.universal" in grown.stdout + grown.stderr and 42 in steps(elastic)

    # A damaged shard of the partitioned optimizer state: one line, before any conversion.
    partitioned = tmp_path / "partitioned"
    (partitioned / "ckpt" / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    refused = train(small, partitioned, "--train_iters", "8", *common, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is truncated or grown" in last, last


def test_nodes_started_with_different_settings_are_refused_in_one_line(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Node 1 typed another --train_iters: every rank would train to its own schedule (or, another
    context, ZeRO stage, wait on the others until --dist_timeout). Refused at the start on every rank,
    naming the setting and the ranks; each node may name its own paths (--cache_dir). A node whose
    connection config names another collection (or whose --vocab_dir holds another tokenizer) would train
    on other documents (other token ids) beside the rest, exit 0: refused the same way."""
    cfg, _ = store_config(tmp_path, ["small"])
    ingest(Connection(load_config(cfg)), "small", [builtin_source("stdlib", 150)])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(cfg.read_text()), "COLLECTIONS": ["other"]}))
    ingest(Connection(load_config(other)), "other", [builtin_source("stdlib", 150)])
    small = dict(corpus, config=cfg)
    common = ("--chunk_docs", "10", "--num_workers", "1", "--dist_timeout", "60")
    per_node = [["--train_iters", "30", "--cache_dir", str(tmp_path / "a")],
                ["--train_iters", "40", "--cache_dir", str(tmp_path / "b")]]  # fmt: skip
    started = time.monotonic()
    nodes = launch_nodes(small, tmp_path / "run", per_node, *common, expect=(2, 2))
    assert max(end for _, end in nodes) - started < deadline(120)  # at the start, not after a timeout
    said = ("the ranks were started with different settings: --train_iters is 30 on rank 0 and 40 on "
            "rank(s) 1, 2; start every node with the same command and files")  # fmt: skip
    for out, _ in nodes:
        assert said in out and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "run" / "ckpt" / "latest").exists()

    per_node = [[], ["--config_train", str(other)]]
    nodes = launch_nodes(small, tmp_path / "corpus", per_node, *common, "--train_iters", "30", expect=(2, 2))
    said = ("the ranks were started with different settings: the connection config's COLLECTIONS is "
            "['small'] on rank 0 and ['other'] on rank(s) 1, 2; start every node with the same command and "
            "files")  # fmt: skip
    for out, _ in nodes:
        errors = [line for line in out.splitlines() if "error:" in line]
        assert errors and all(said in e for e in errors), out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "corpus" / "ckpt" / "latest").exists()


def test_nodes_that_each_name_their_own_checkpoint_directory_are_refused_in_one_line(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Each node's --ckpt_dir on its own disk: rank 0 would mark every checkpoint whole with the files it
    sees (its own) while the other ranks' ZeRO shards lie on the other disk, and no node could resume.
    Refused at the start on every rank, before a step or a file of a checkpoint."""
    cfg, _ = store_config(tmp_path, ["small"])
    ingest(Connection(load_config(cfg)), "small", [builtin_source("stdlib", 150)])
    small = at_stage(dict(corpus, config=cfg), tmp_path, 1)
    disks = [tmp_path / "node0-disk" / "ckpt", tmp_path / "node1-disk" / "ckpt"]
    common = ("--chunk_docs", "10", "--num_workers", "1", "--dist_timeout", "60", "--train_iters", "4")
    nodes = launch_nodes(small, tmp_path / "run", [["--ckpt_dir", str(d)] for d in disks], *common,
                         expect=(2, 2))  # fmt: skip
    for (out, _), disk in zip(nodes, disks, strict=True):  # each node names its own
        said = (
            f"--ckpt_dir {disk} is not shared by every node: rank(s) 1, 2 do not see the files rank 0 writes"
        )
        errors = [line for line in out.splitlines() if "error:" in line]
        assert errors and all(said in e and "gridfs:RUN" in e for e in errors), out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    assert not disks[0].exists() and not list(disks[1].rglob("*.pt"))
    assert not (tmp_path / "run" / "ws" / "metrics.jsonl").exists() or not [
        r for r in read_metrics(tmp_path / "run" / "ws" / "metrics.jsonl") if r["event"] == "train"
    ]
