"""Checkpoints an earlier version wrote stay readable: resumed loss for loss, exported."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pymongo
import pytest

from conftest import ROOT, run_cli, write_config
from dsgpt2.corpus.formats import file_source
from dsgpt2.corpus.ingest import ingest
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.train.metrics import read_metrics
from wire_server import shared_server
from zygote import run_python

BEFORE_STORES = ROOT / "tests" / "fixtures" / "before-stores"


def _corpus_as_then(tmp_path: Path) -> Path:
    """The fixture's corpus, ingested as it was when its checkpoint was written: the database and
    collection its fingerprint records."""
    uri = shared_server()
    with pymongo.MongoClient(uri) as client:
        client.drop_database("dsgpt2_v0")
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING=uri, MONGO_CONNECTION_DB="dsgpt2_v0",
                       COLLECTIONS=["stdlib"])  # fmt: skip
    conn = Connection(load_config(cfg))
    ingest(conn, "stdlib", [file_source(BEFORE_STORES / "corpus.jsonl")])
    conn.close()
    return cfg


@pytest.mark.slow  # a DeepSpeed run
def test_a_checkpoint_written_before_checkpoint_stores_resumes_and_exports(tmp_path: Path) -> None:
    expected = json.loads((BEFORE_STORES / "expected.json").read_text())
    cfg = _corpus_as_then(tmp_path)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(BEFORE_STORES / "ckpt", ckpt)
    flags = ["--deepspeed_config", str(BEFORE_STORES / "ds.json"), "--config_train", str(cfg),
             "--vocab_dir", str(BEFORE_STORES / "tok"), "--model_select", "tiny", "--context_length", "64",
             "--tr_ratio", "0.9", "--chunk_docs", "40", "--num_workers", "0", "--seed", "7", "--wandb", "off",
             "--eval_interval", "1000", "--eval_iters", "2", "--log_interval", "1", "--ckpt_dir", str(ckpt),
             "--workspace", str(tmp_path / "ws"), "--train_iters", "10", "--save_interval", "4",
             "--keep_last", "2"]  # fmt: skip
    result = run_python([str(ROOT / "ds_trainer.py"), *flags], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {ckpt}/global_step{expected['resumed_at']} at step {expected['resumed_at']}" in (
        result.stderr
    )
    losses = {str(r["step"]): r["loss"] for r in read_metrics(tmp_path / "ws" / "metrics.jsonl")
              if r["event"] == "train"}  # fmt: skip
    for step, loss in expected["losses"].items():
        assert losses[step] == pytest.approx(loss, rel=1e-6), (step, losses)
    # An audit of the run: a document the collection does not hold is one line naming its range, not a
    # clean "never trained on".
    audit = (
        "lineage",
        "--ckpt_dir",
        str(ckpt),
        "--config",
        str(cfg),
        "--vocab_dir",
        str(BEFORE_STORES / "tok"),
    )
    typo = run_cli(*audit, "--doc", "stdlib:99999")
    assert typo.returncode == 2 and "Traceback" not in typo.stderr, typo.stderr[-2000:]
    last = typo.stderr.strip().splitlines()[-1]
    assert re.search(r"--doc stdlib:99999: no such document; stdlib holds idx 0 to \d+$", last), last
    assert run_cli(*audit, "--doc", "stdlib:1").returncode == 0
    # The earlier version's checkpoint itself, exported as ever (its tokenizer is no longer where it was
    # trained: given, as the refusal without it says).
    out = tmp_path / "hf"
    exported = run_cli("export", "--ckpt_dir", str(BEFORE_STORES / "ckpt"), "--out", str(out),
                       "--vocab_dir", str(BEFORE_STORES / "tok"))  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    assert "exported" in exported.stdout and (out / "config.json").is_file()
