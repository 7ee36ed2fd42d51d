"""Checkpoints and tokenizers in the database (``--ckpt_dir gridfs:RUN``, ``--vocab_dir gridfs:NAME``):
nodes that share the database and no directory save, lose a node and resume; damaged or unfinished stored
checkpoints are never resumed, a replaced stored tokenizer never read for the model's."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_cli
from dsgpt2.checkpoints.format import CHECKPOINTS
from dsgpt2.db.blobs import BlobStore
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.tokenizer.bpe import tokenizer_digest
from dsgpt2.tokenizer.stored import StoredTokenizer
from dsgpt2.train.metrics import read_metrics
from training import launch_nodes, steps, train, trainer_args, training_corpus
from zygote import run_python

BUCKET = CHECKPOINTS.name

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return training_corpus(tmp_path_factory)


def test_a_run_saves_to_the_database_and_resumes_from_it_on_a_machine_without_its_files(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    run = f"t{tmp_path.name}"
    conn = Connection(load_config(corpus["config"]))
    StoredTokenizer(conn, run).push(corpus["tok"])  # the tokenizer too
    where = ("--ckpt_dir", f"gridfs:{run}", "--vocab_dir", f"gridfs:{run}", "--save_interval", "2",
             "--keep_last", "2")  # fmt: skip
    first = train(corpus, tmp_path / "a", "--train_iters", "6", *where, "--optimizer", "adamw")
    assert f"stored checkpoint gridfs:{run}/global_step6" in first.stderr, first.stderr[-3000:]
    store = BlobStore(Connection(load_config(corpus["config"])), BUCKET)
    tags = {n.split("/")[1] for n in store.names(run + "/") if n.count("/") == 2}
    assert tags == {"global_step4", "global_step6"}  # --keep_last 2
    assert store.get_text(f"{run}/latest", tmp_path / "x") == "global_step6"
    resolved = yaml.safe_load(store.get_text(f"{run}/global_step6/config.yaml", tmp_path / "y") or "")
    assert resolved["ckpt_dir"] == resolved["vocab_dir"] == f"gridfs:{run}"  # as given, not a node's copy
    shutil.rmtree(tmp_path / "a")  # nothing of the first machine is left
    second = train(corpus, tmp_path / "b", "--train_iters", "8", *where)
    assert "resumed from" in second.stderr and "at step 6" in second.stderr, second.stderr[-3000:]
    # Its optimizer, read from the stored checkpoint before anything is downloaded.
    assert "was trained with --optimizer adamw" in second.stderr, second.stderr[-3000:]
    assert sorted(steps(tmp_path / "b")) == [7, 8]
    # Read where it is stored, from a directory that never held it.
    out = tmp_path / "hf"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # this machine's copies
    read = ("--ckpt_dir", f"gridfs:{run}")
    exported = run_cli("export", *read, "--config", str(corpus["config"]), "--out", str(out), env=env)
    assert exported.returncode == 0 and "step 8" in exported.stdout, exported.stderr[-2000:]
    assert (out / "config.json").is_file() and (tmp_path / "cache" / "dsgpt2" / "gridfs-tokenizers").is_dir()
    assert json.loads((out / "dsgpt2_run.json").read_text())["vocab_dir"] == f"gridfs:{run}"
    report = ("--no_record", "--report", str(tmp_path / "eval.json"), "--no_progress")
    evaluated = run_cli(
        "evaluate", "--model", f"gridfs:{run}", "--config", str(corpus["config"]), *report, env=env
    )
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads((tmp_path / "eval.json").read_text())["model"] == f"gridfs:{run}/global_step8"
    lacking = run_cli("export", *read, "--out", str(tmp_path / "hf2"), env=env)
    assert lacking.returncode == 2 and "add --config" in lacking.stderr.strip().splitlines()[-1]
    # A typo in the name lists the runs stored there.
    typo = run_cli("export", "--ckpt_dir", f"gridfs:{run}x", "--config", str(corpus["config"]), "--out",
                   str(tmp_path / "hf2"), env=env)  # fmt: skip
    last = typo.stderr.strip().splitlines()[-1]
    assert (
        typo.returncode == 2 and "the runs stored there: " in last and f"did you mean gridfs:{run}?" in last
    )
    # The replay of its reading names the run where it is stored, not this machine's copy.
    doc = f"{load_config(corpus['config']).collections[0]}:1"
    traced = run_cli("lineage", *read, "--config", str(corpus["config"]), "--doc", doc, env=env)
    assert traced.returncode == 0 and f"to gridfs:{run}/global_step8: " in traced.stdout, traced.stderr[
        -2000:
    ]
    # The stored tokenizer replaced: the model is pinned to the one it trained with.
    other = tmp_path / "other"
    shutil.copytree(corpus["tok"], other)
    (other / "tokenizer.json").write_text(json.dumps(json.loads((other / "tokenizer.json").read_text())))
    StoredTokenizer(conn, run).push(other, overwrite=True)
    replaced = run_cli(
        "export", *read, "--config", str(corpus["config"]), "--out", str(tmp_path / "hf3"), env=env
    )
    last = replaced.stderr.strip().splitlines()[-1]
    assert replaced.returncode == 2 and "Traceback" not in replaced.stderr, replaced.stderr[-2000:]
    assert (
        tokenizer_digest(other) in last
        and tokenizer_digest(corpus["tok"]) in last
        and f"gridfs:{run}" in last
    )
    info = run_cli("info", "--config", str(corpus["config"]))
    assert f"checkpoints gridfs:{run}: latest global_step8" in info.stdout, info.stdout
    assert f"last run: gridfs:{run} (step 8" in info.stdout, info.stdout
    assert f"tokenizer gridfs:{run}: hash {tokenizer_digest(other)}" in info.stdout, info.stdout
    # A run started from it (--init_from its checkpoint, no --vocab_dir) takes the tokenizer it names.
    tune = trainer_args(
        corpus,
        tmp_path / "c",
        "--train_iters",
        "1",
        "--init_from",
        str(tmp_path / "b" / "ws" / "gridfs" / run),
    )
    del tune[tune.index("--vocab_dir") : tune.index("--vocab_dir") + 2]
    tuned = run_python([str(ROOT / "ds_trainer.py"), *tune], cwd=ROOT)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert list((tmp_path / "c" / "ws" / "gridfs-tokenizers").rglob("tokenizer.json")), tuned.stderr[-3000:]


def test_a_damaged_stored_file_is_refused_in_one_line_and_another_checkpoint_named(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    run = f"d{tmp_path.name}"
    where = ("--ckpt_dir", f"gridfs:{run}", "--save_interval", "2")
    train(corpus, tmp_path / "a", "--train_iters", "4", *where)
    conn = Connection(load_config(corpus["config"]))
    files = conn.db[f"{BUCKET}.files"]
    model = files.find_one({"filename": f"{run}/global_step4/mp_rank_00_model_states.pt"})
    chunk = conn.db[f"{BUCKET}.chunks"].find_one({"files_id": model["_id"], "n": 0})
    data = bytearray(chunk["data"])
    data[100] ^= 0xFF
    conn.db[f"{BUCKET}.chunks"].update_one({"_id": chunk["_id"]}, {"$set": {"data": bytes(data)}})
    refused = train(corpus, tmp_path / "b", "--train_iters", "6", *where, check=False)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "global_step4/mp_rank_00_model_states.pt is damaged" in last and "--ckpt_id global_step2" in last
    resumed = train(corpus, tmp_path / "b", "--train_iters", "6", *where, "--ckpt_id", "global_step2")
    assert "at step 2" in resumed.stderr and sorted(steps(tmp_path / "b")) == [3, 4, 5, 6]
    # A stored checkpoint of another model than the run builds: refused in one line, nothing written.
    deeper = tmp_path / "deeper.json"
    deeper.write_text(json.dumps({"n_layer": 3, "n_embd": 64, "n_head": 2, "n_positions": 128}))
    other = train(
        corpus, tmp_path / "c", "--train_iters", "8", *where, "--model_config", str(deeper), check=False
    )
    last = other.stderr.strip().splitlines()[-1]
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert (
        f"gridfs:{run}/global_step6 holds another model than this run builds (layers 2 there, 3 here" in last
    )
    assert conn.db[f"{BUCKET}.files"].count_documents({"filename": {"$regex": f"^{run}/global_step8"}}) == 0


def test_two_nodes_sharing_only_the_database_save_there_and_one_of_them_resumes_alone(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Two simulated nodes (ranks 0 | 1, 2) at ZeRO 1, each with a working directory of its own and the
    checkpoints in the database: every rank's shard is stored, the marker lists them all. Node 1 is
    gone: node 0 resumes alone from the database, through the checkpoint's universal form (made once,
    stored for any node), and the steps go on."""
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": 1}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    staged = dict(corpus, ds=tmp_path / "ds.json")
    run = f"n{tmp_path.name}"
    StoredTokenizer(Connection(load_config(corpus["config"])), run).push(corpus["tok"])
    common = ("--ckpt_dir", f"gridfs:{run}", "--vocab_dir", f"gridfs:{run}", "--save_interval", "2",
              "--num_workers", "1")  # fmt: skip
    disks = [["--workspace", str(tmp_path / f"node{n}")] for n in (0, 1)]
    launch_nodes(staged, tmp_path / "both", disks, "--train_iters", "4", *common, "--keep_last", "1")
    store = BlobStore(Connection(load_config(corpus["config"])), BUCKET)
    shards = {n.rsplit("/", 1)[1] for n in store.names(f"{run}/global_step4/") if "optim_states" in n}
    assert shards == {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)}
    # Each node fetched the tokenizer, and staged only its own ranks' files, of what --keep_last keeps.
    for n in (0, 1):
        assert sorted(p.name for p in (tmp_path / f"node{n}" / "gridfs" / run).glob("global_step*")) == [
            "global_step4"
        ]
    assert all(list((tmp_path / f"node{n}" / "gridfs-tokenizers").rglob("tokenizer.json")) for n in (0, 1))
    assert not list((tmp_path / "node1").rglob("zero_pp_rank_0_*")) and list(
        (tmp_path / "node0").rglob("zero_pp_rank_0_*")
    )

    alone = train(staged, tmp_path / "both", "--train_iters", "6", *common, *disks[0])
    assert "saved by 3 rank(s); this run has 1" in alone.stderr and "universal form" in alone.stderr
    assert f"{run}/global_step4.universal/dsgpt2_complete.json" in store.names(f"{run}/")
    metrics = read_metrics(tmp_path / "node0" / "metrics.jsonl")
    assert [r["step"] for r in metrics if r["event"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_a_save_killed_while_uploading_never_becomes_latest_and_the_resume_is_exact(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Killed as it uploads the checkpoint of step 4: the stored latest stays step 2, the local copy's
    complete step 4 is not taken for one, and the resumed run takes the straight run's steps."""
    run = f"k{tmp_path.name}"
    where = ("--ckpt_dir", f"gridfs:{run}", "--save_interval", "2")
    train(corpus, tmp_path / "straight", "--train_iters", "6", "--save_interval", "100")
    # A save uploads the model states, the resolved config and their manifest, then the marker and
    # latest: 5 uploads; the 7th is the second file of step 4.
    dies = ("--die_uploading", "7")
    killed = train(corpus, tmp_path / "a", "--train_iters", "6", *where, faults=dies, check=False)
    assert killed.returncode == 17, killed.stderr[-3000:]
    store = BlobStore(Connection(load_config(corpus["config"])), BUCKET)
    assert store.get_text(f"{run}/latest", tmp_path / "x") == "global_step2"
    assert f"{run}/global_step4/dsgpt2_complete.json" not in store.names(f"{run}/")

    resumed = train(corpus, tmp_path / "a", "--train_iters", "6", *where)
    assert "at step 2" in resumed.stderr, resumed.stderr[-3000:]
    straight, again = steps(tmp_path / "straight"), steps(tmp_path / "a")
    for step in (3, 4, 5, 6):
        assert abs(again[step]["loss"] - straight[step]["loss"]) <= 1e-6, step


def test_a_second_run_saving_to_the_same_location_is_refused_before_it_writes(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    run = f"s{tmp_path.name}"
    where = ("--ckpt_dir", f"gridfs:{run}", "--save_interval", "2")
    train(corpus, tmp_path / "a", "--train_iters", "2", *where)
    # While this run trains on from step 2, another one saves there (its latest moves on).
    script = tmp_path / "other.py"
    script.write_text(
        "import pathlib\n"
        "from dsgpt2.db.blobs import BlobStore\n"
        "from dsgpt2.db.client import Connection\n"
        "from dsgpt2.db.config import load_config\n"
        f"store = BlobStore(Connection(load_config({str(corpus['config'])!r})), {BUCKET!r})\n"
        f"store.put_text({run + '/latest'!r}, 'global_step8', pathlib.Path({str(tmp_path / 'scratch')!r}))\n"
    )
    other = ("--after", f"3={sys.executable} {script}")
    clash = train(corpus, tmp_path / "a", "--train_iters", "6", *where, faults=other, check=False)
    last = clash.stderr.strip().splitlines()[-1]
    assert clash.returncode == 2 and "Traceback" not in clash.stderr, clash.stderr[-3000:]
    assert f"another run saved gridfs:{run}/global_step8 since this one started" in last
    store = BlobStore(Connection(load_config(corpus["config"])), BUCKET)
    assert not any("global_step4" in n for n in store.names(f"{run}/"))
