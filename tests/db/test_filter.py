"""A FILTER in the connection config: the documents it leaves out are skipped inside their chunks and
counted as `filtered` by training's and validation's readers, vocabulary download, evaluate and
info; the documents it keeps stay in their split; the filter is part of the data fingerprint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import db_for, make_config, run_cli, seed, tiny_export, write_config
from corpora import KEEP, left_out, mark, texts
from dsgpt2.data.sources import StreamingChunks, fingerprint, make_spec
from dsgpt2.data.split import split_mask
from dsgpt2.db.client import Connection
from dsgpt2.db.config import config_from_dict
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.errors import BadDocumentError, ConfigError


def test_filter_is_a_checked_query_kept_in_order() -> None:
    cfg = make_config(["a"], FILTER={"b": 1, "a": {"$exists": False}})
    assert cfg.filter == '{"b":1,"a":{"$exists":false}}'  # key order kept: subdocument equality needs it
    assert cfg.filter_query == {"b": 1, "a": {"$exists": False}}
    assert cfg.to_dict()["FILTER"] == cfg.filter_query
    local = cfg.to_dict() | {"MONGO_CONNECTION_STRING": "local://runs/db"}
    assert config_from_dict(local).filter == cfg.filter
    assert make_config(["a"]).filter_query is None and make_config(["a"], FILTER={}).filter == ""
    for bad, says in [
        ({"$where": "this.a > 1"}, "JavaScript"),
        ({"$or": [{"a": 1}, {"$where": "1"}]}, "JavaScript"),
        ([1], "must be dict"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            make_config(["a"], FILTER=bad)


def test_the_reader_skips_and_counts_what_filter_leaves_out() -> None:
    cfg = make_config(["a"], FILTER=KEEP)
    conn = Connection(cfg)
    seed(conn, "a", texts(30))
    conn.db["a"].delete_one({"idx": 20})  # a real gap: still `missing`
    mark(conn, "a", 30)
    wrapper = MongoWrapper(cfg)
    got = [d.index for d in wrapper.get_range(0, 30)]
    assert got == [i for i in range(30) if not left_out(i) and i != 20]
    assert dict(wrapper.skipped) == {"filtered": sum(map(left_out, range(30))), "missing": 1}
    wrapper = MongoWrapper(cfg)
    assert [d.index for d in wrapper.get_many([1, 2, 3, 4, 5, 6])] == [2, 4, 6]
    assert wrapper[8] is not None and wrapper[9] is None and wrapper.skipped["filtered"] == 4
    strict = MongoWrapper(make_config(["a"], FILTER=KEEP, STRICT=True))
    assert len(strict.get_range(0, 12)) == sum(not left_out(i) for i in range(12))  # filtered: not bad
    with pytest.raises(BadDocumentError, match="missing"):
        strict.get_range(18, 22)


def test_training_chunks_hold_the_kept_documents_each_in_its_split(tmp_path: Path) -> None:
    n = 120
    tiny_export(tmp_path / "model", texts(n))
    tok = tmp_path / "model" / "tok"
    plain = make_config(["a"])
    conn = Connection(plain)
    seed(conn, "a", texts(n))
    mark(conn, "a", n)
    filtered = make_config(["a"], FILTER=KEEP)
    spec = make_spec(tmp_path / "model" / "tok", context=32, chunk_docs=25, tr_ratio=0.7, seed=3)
    seen: dict[str, set[int]] = {}
    skipped = 0
    for split in ("train", "val"):
        source = StreamingChunks(filtered, [n], tmp_path / "model" / "tok", spec, split)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tmp_path / "model" / "tok"))
        found: set[int] = set()
        for c in range(len(source)):
            chunk = source[c]
            skipped += chunk.skipped.get("filtered", 0)
            ids = chunk.blocks.reshape(-1).tolist()
            found |= {
                int(m) for m in re.findall(r"document (\d+) ", tok.decode(ids, skip_special_tokens=True))
            }
        seen[split] = found
    train = split_mask(np.arange(n), 0.7, 3, "a")
    assert seen["train"] == {i for i in range(n) if train[i] and not left_out(i)}
    assert seen["val"] == {i for i in range(n) if not train[i] and not left_out(i)}
    assert skipped >= sum(map(left_out, range(n)))
    fp = fingerprint(filtered, tmp_path / "model" / "tok", spec)
    assert fp["filter"] == filtered.filter and "filter" not in fingerprint(
        plain, tmp_path / "model" / "tok", spec
    )


def test_info_download_and_evaluate_honour_the_filter(tmp_path: Path) -> None:
    n = 60
    store = tmp_path / "db.mongo"
    cfg = write_config(tmp_path / "c.json", **db_for(store),
                       COLLECTIONS=["a"], FILTER=KEEP)  # fmt: skip
    conn = Connection(make_config(["a"], **db_for(store)))
    seed(conn, "a", texts(n))
    mark(conn, "a", n)
    kept = [i for i in range(n) if not left_out(i)]
    info = run_cli("info", "--config", str(cfg))
    assert info.returncode == 0, info.stderr
    assert f"FILTER keeps {len(kept)}" in info.stdout and "FILTER {" in info.stdout
    assert f"  a: {n} documents (idx 0-{n - 1}), 100.0% of the documents; text cleaner unknown" in info.stdout
    down = run_cli("vocab", "download", "--config", str(cfg), "--out", str(tmp_path / "shards"),
                   "--workers", "1", "--no_progress")  # fmt: skip
    assert down.returncode == 0, down.stderr
    lines = [
        json.loads(x)
        for f in sorted((tmp_path / "shards").glob("shard-*.jsonl"))
        for x in f.read_text().splitlines()
    ]
    assert sorted(d["idx"] for d in lines) == kept
    export = tiny_export(tmp_path / "model", texts(n))
    report = tmp_path / "eval.json"
    done = run_cli("evaluate", "--model", str(export), "--config", str(cfg), "--split", "all",
                   "--context_length", "32", "--num_workers", "0", "--report", str(report), "--no_record",
                   "--no_progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"documents not read: {n - len(kept)} left out by the config's FILTER" in done.stdout
    result = json.loads(report.read_text())
    assert result["metrics"]["documents"] == len(kept)
    assert result["metrics"]["skipped"] == {"filtered": n - len(kept)}
    assert result["filter"] == KEEP and result["data_fingerprint"]["filter"]


def test_a_filter_that_keeps_nothing_is_refused_and_a_field_no_document_has_is_named(tmp_path: Path) -> None:
    """``"passes.gopher": "true"`` (a string, not true) keeps nothing: every command that reads says so
    in one line; ``dup_off`` (for dup_of) keeps everything, with a warning naming the field."""
    store = tmp_path / "db.mongo"
    conn = Connection(make_config(["a"], **db_for(store)))
    seed(conn, "a", texts(40))
    conn.db["a"].update_many({}, {"$set": {"passes": {"gopher": True}}})
    none = write_config(tmp_path / "none.json", **db_for(store), COLLECTIONS=["a"],
                        FILTER={"passes.gopher": "true"})  # fmt: skip
    for args in (["info"], ["vocab", "download", "--out", str(tmp_path / "shards"), "--no_progress"]):
        done = run_cli(*args, "--config", str(none))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert 'FILTER {"passes.gopher":"true"} keeps 0 of the 40 documents of a' in line
    assert not list((tmp_path / "shards").glob("shard-*"))
    typo = write_config(tmp_path / "typo.json", **db_for(store), COLLECTIONS=["a"],
                        FILTER={"dup_off": {"$exists": False}})  # fmt: skip
    info = run_cli("info", "--config", str(typo))
    assert info.returncode == 0, info.stderr
    assert "FILTER names 'dup_off', a field none of the first documents has" in info.stderr
    assert "did you mean 'dup_of'?" in info.stderr and "FILTER keeps 40" in info.stdout
    # A field dsgpt2 writes that no document has yet (no duplicates found) is no typo.
    clean = write_config(tmp_path / "clean.json", **db_for(store), COLLECTIONS=["a"],
                         FILTER={"dup_of": {"$exists": False}, "passes.gopher": True})  # fmt: skip
    info = run_cli("info", "--config", str(clean))
    assert info.returncode == 0 and "FILTER names" not in info.stderr, info.stderr


def test_the_fields_a_filter_may_name_are_those_dsgpt2_writes() -> None:
    import dsgpt2.curation  # noqa: F401  the built-in steps, registered
    from dsgpt2.curation.steps import STEPS
    from dsgpt2.db.filters import filter_fields, unknown_fields
    from dsgpt2.documents import INGEST_FIELDS, known_fields, marks

    # Every mark a registered step writes is declared, and every declared mark is some step's.
    written = {f for _, step in STEPS.items() for f in step.marks}
    assert written - set(INGEST_FIELDS) == set(marks())
    assert set(known_fields()) == {*INGEST_FIELDS, *marks()}
    assert unknown_fields({"dup_of": {"$exists": False}, "lang": "en", "filt_text": "x"}, set()) == []
    assert unknown_fields({"dup_off": 1}, set()) == [("dup_off", "dup_of")]
    # A mark is one step's: ingest's fields and another step's marks are refused as its own.
    from dsgpt2.documents import mark

    with pytest.raises(ValueError, match="ingest"):
        mark("idx", "mine")
    with pytest.raises(ValueError, match="dedup"):
        mark("dup_of", "mine")
    assert mark("dup_of", "dedup") == "dup_of"  # the same declaration again is the same mark
    query = {
        "a": 1,
        "$or": [{"b.c": 2}, {"a": 3}],
        "$nor": [{"d": {"$exists": True}}],
        "$expr": {"$eq": [1, 1]},
    }
    assert filter_fields(query) == ["a", "b.c", "d"]


def test_a_query_the_server_refuses_or_a_bad_filter_is_one_line(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path / "c.json", **db_for(tmp_path), COLLECTIONS=["a"], FILTER={"$where": "sleep(1000)"}
    )
    done = run_cli("info", "--config", str(cfg))
    assert done.returncode == 2 and "JavaScript" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_filter_the_server_refuses_stops_every_reading_command_before_any_work(tmp_path: Path) -> None:
    """A typo'd operator: one line naming the key and the operator, exit 2, from every command that
    reads; nothing written (no shard, cache, tokenizer, mark or checkpoint)."""
    from dsgpt2.cli.main import main

    store = db_for(tmp_path)
    good = write_config(tmp_path / "good.json", **store, COLLECTIONS=["a"])
    seed(Connection(config_from_dict(json.loads(good.read_text()))), "a", texts(60))
    bad = str(
        write_config(tmp_path / "c.json", **store, COLLECTIONS=["a"], FILTER={"passes.gopher": {"$tru": 1}})
    )
    model = tiny_export(tmp_path / "m", texts(60))
    commands = [
        ["info", "--config", bad],
        ["validate", "--config", bad],
        ["vocab", "download", "--config", bad, "--out", str(tmp_path / "shards")],
        ["vocab", "train", "--from_mongo", "--config", bad, "--out", str(tmp_path / "tok")],
        ["evaluate", "--model", str(model), "--config", bad, "--no_record"],
        ["tokenize", "--config_train", bad, "--vocab_dir", str(tmp_path / "m" / "tok"),
         "--cache_dir", str(tmp_path / "cache")],
        ["dedup", "--config", bad, "--exact"],
        ["dedup", "--config", bad, "--near"],
        ["curate", "--config", bad],
        ["index", "--config", bad, "--collection", "a"],
    ]  # fmt: skip
    for argv in commands:
        done = run_cli(*argv)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (argv, done.stderr[-2000:])
        assert "'passes.gopher'" in lines[0] and "$tru" in lines[0] and "FILTER" in lines[0], lines
    assert not any((tmp_path / d).exists() for d in ("shards", "tok", "cache"))
    doc = Connection(config_from_dict(json.loads(good.read_text()))).db["a"].find_one({"idx": 0})
    assert not {"text_hash", "dup_of", "signals", "passes", "minhash"} & set(doc)
    # Training: refused before the model is built (no engine, no checkpoint), on the trainer's path.
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
                              "params": {"lr": 1e-3, "torch_adam": True}}}))  # fmt: skip
    done = run_cli("train", "--deepspeed_config", str(ds), "--config_train", bad, "--vocab_dir",
                   str(tmp_path / "m" / "tok"), "--model_select", "tiny", "--context_length", "32",
                   "--train_iters", "2", "--wandb", "off", "--ckpt_dir", str(tmp_path / "ckpt"),
                   "--workspace", str(tmp_path / "ws"))  # fmt: skip
    assert done.returncode == 2 and "'passes.gopher'" in done.stderr and "$tru" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "ws" / "metrics.jsonl").exists()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    assert main(["info", "--config", str(good)]) == 0
