"""Decontamination against evaluation sets: planted overlaps found under other case and punctuation,
hard negatives (12 shared words, the same words reordered) left alone, each layout of evaluation file
read, a pass killed (an exception mid-way, SIGKILL of the command) ending as a straight one and one
going on through transient server errors, a run after an ingest reading only the new documents,
FILTER leaving the marked documents out, `curate report` counting them per set, `evaluate --hellaswag`
saying whether the run trained on them, and bad input refused in one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from bson import ObjectId

from conftest import db_for, make_config, run_cli, store_config, tiny_export
from dsgpt2.curation import passes
from dsgpt2.curation.decontaminate import (
    CONTAMINATED,
    Decontamination,
    find,
    load_sets,
    ngrams,
    read_texts,
    words,
)
from dsgpt2.curation.passes import run_pass
from dsgpt2.db.client import Connection

VOCAB = [f"w{i}" for i in range(400)]


def sentence(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(VOCAB) for _ in range(n)]


def eval_items(seed: int, n: int) -> list[dict]:
    """HellaSwag examples of random words: a 20-word context, four 8-word endings."""
    rng = random.Random(seed)
    return [{"ctx": " ".join(sentence(rng, 20)), "endings": [" ".join(sentence(rng, 8)) for _ in range(4)],
             "label": i % 4} for i in range(n)]  # fmt: skip


def gold_words(item: dict) -> list[str]:
    return f"{item['ctx']} {item['endings'][item['label']]}".split()


def planted(items: list[dict], seed: int) -> tuple[list[str], dict[int, str]]:
    """Documents: clean ones, 13 words of an item's context and gold ending (across the boundary) in
    other case and punctuation, and hard negatives: 12 shared words, the 13 words reordered, 13 words of
    a wrong ending's run. Returns the texts and the n-gram each contaminated one must be marked with."""
    rng = random.Random(seed)
    texts, expected = [], {}
    for k, item in enumerate(items):
        gold = gold_words(item)
        at = 8 + k % 8  # every window crosses from the context into the ending
        shared = gold[at : at + 13]
        upper = [w.upper() if j % 2 else w + "," for j, w in enumerate(shared)]
        expected[len(texts)] = " ".join(shared)
        texts.append(" ".join([*sentence(rng, 30), *upper, *sentence(rng, 30)]) + ".")
        texts.append(" ".join([*sentence(rng, 30), *gold[at : at + 12], *sentence(rng, 30)]))
        texts.append(" ".join([*sentence(rng, 30), *reversed(shared), *sentence(rng, 30)]))
        wrong = item["ctx"].split()[-5:] + item["endings"][(item["label"] + 1) % 4].split()
        texts.append(" ".join([*sentence(rng, 30), *wrong, *sentence(rng, 30)]))
        texts.append(" ".join(sentence(rng, 60)))
    return texts, expected


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_words_ngrams_and_find() -> None:
    assert words("The Cat's hat, (it) SAT!\n\t on_it") == ["the", "cat", "s", "hat", "it", "sat", "on", "it"]
    assert list(ngrams(["a", "b", "c"], 2)) == [("a", "b"), ("b", "c")] and list(ngrams(["a"], 2)) == []
    table = {("b", "c"): ("s1", "s2"), ("c", "d"): ("s1",)}
    assert find(["a", "b", "c", "d"], 2, table) == {"s1": "b c", "s2": "b c"}


def test_every_layout_is_read(tmp_path: Path) -> None:
    item = eval_items(0, 1)[0]
    hs = write_jsonl(tmp_path / "hs.jsonl", [item])
    doc = {"query": "what is it", "choices": ["a b", "c d"], "gold": 1}
    lm = write_jsonl(tmp_path / "lm.jsonl", [{"doc_id": 0, "doc": doc, "target": "so it is"}])
    lm_hs = write_jsonl(tmp_path / "lm_hs.jsonl", [{"doc": item, "target": 0}])
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "one two"}, {"text": "three", "id": 4}])
    gold = f"{item['ctx']} {item['endings'][item['label']]}"
    assert read_texts(hs) == ("hellaswag", [gold])
    assert read_texts(lm) == ("lm-eval", ["what is it c d so it is"])
    assert read_texts(lm_hs) == ("lm-eval", [gold])
    assert read_texts(text) == ("text", ["one two", "three"])
    (s,) = load_sets([hs, text], ["both", "both"], 13)
    assert (s.name, s.items, len(s.grams), s.short) == ("both", 3, len(gold.split()) - 12, 2)
    from dsgpt2.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--against .*: a directory, not a file; give the evaluation"):
        read_texts(tmp_path)


@pytest.mark.slow
def test_planted_overlaps_are_marked_and_hard_negatives_are_not(tmp_path: Path) -> None:
    """Through the command: marks, FILTER, a second set, a run after an ingest, `curate report`."""
    items = eval_items(1, 8)
    texts, expected = planted(items, 2)
    cfg, store = store_config(tmp_path, ["web"])
    corpus = write_jsonl(tmp_path / "web.jsonl", [{"text": t} for t in texts])
    assert run_cli("ingest", "--config", str(cfg), str(corpus), "--no_progress").returncode == 0
    hs = write_jsonl(tmp_path / "hellaswag_val.jsonl", items)
    done = run_cli("decontaminate", "--config", str(cfg), "--against", str(hs), "--no_progress")
    assert done.returncode == 0, done.stderr
    assert (
        f"web: {len(texts)} documents, {len(texts)} checked by this run; contaminated: hellaswag_val 8"
        in done.stdout
    )
    conn = Connection(make_config(["web"], **db_for(store)))
    docs = conn.db["web"]
    marked = {d["idx"]: d[CONTAMINATED] for d in docs.find({CONTAMINATED: {"$exists": True}})}
    assert marked == {i: {"hellaswag_val": g} for i, g in expected.items()}
    assert docs.count_documents({"decont.hellaswag_val": {"$exists": True}}) == len(texts)

    again = run_cli("decontaminate", "--config", str(cfg), "--against", str(hs), "--no_progress")
    assert "0 checked by this run; contaminated: hellaswag_val 8" in again.stdout, again.stderr

    # A second set, from plain text, under a name of its own; the first set's marks stay.
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": texts[4]}])  # a clean document, verbatim
    done = run_cli("decontaminate", "--config", str(cfg), "--against", str(other), "--name", "copy",
                   "--no_progress", "--workers", "2")  # fmt: skip
    assert done.returncode == 0 and "contaminated: copy 1" in done.stdout, done.stderr
    assert docs.find_one({"idx": 4})[CONTAMINATED] == {"copy": " ".join(words(texts[4])[:13])}
    assert docs.find_one({"idx": 0})[CONTAMINATED] == {"hellaswag_val": expected[0]}

    # Documents ingested later: the next run reads only them.
    late = write_jsonl(tmp_path / "late.jsonl", [{"text": texts[0]}, {"text": texts[1]}])
    assert run_cli("ingest", "--config", str(cfg), str(late), "--no_progress").returncode == 0
    done = run_cli("decontaminate", "--config", str(cfg), "--against", str(hs), "--no_progress")
    assert "2 checked by this run; contaminated: hellaswag_val 9" in done.stdout, done.stderr
    n = len(texts) + 2
    assert docs.find_one({"idx": n - 2})[CONTAMINATED] == {"hellaswag_val": expected[0]}
    assert CONTAMINATED not in docs.find_one({"idx": n - 1})

    # FILTER leaves them out of what training reads.
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "FILTER": {CONTAMINATED: {"$exists": False}}}))
    info = run_cli("info", "--config", str(cfg), "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["collections"][0]["passing_filter"] == n - 10
    cfg.write_text(json.dumps(data))

    plot = tmp_path / "curation.png"
    report = run_cli("curate", "report", "--config", str(cfg), "--plot", str(plot), "--json")
    assert report.returncode == 0, report.stderr
    (part,) = json.loads(report.stdout)["collections"]
    assert part["removed"]["contaminated"] == 10
    assert part["contaminated_by"] == {"copy": 1, "hellaswag_val": 9}
    lines = run_cli("curate", "report", "--config", str(cfg), "--plot", str(plot)).stdout
    assert "      by hellaswag_val: 9" in lines
    conn.close()


class Crash(Exception):
    pass


@pytest.mark.parametrize("sets", [1, 2])
def test_a_killed_pass_ends_as_a_straight_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sets: int
) -> None:
    """Against one set, and against two (a document checked against one of them only is checked again)."""
    items = eval_items(3, 6)
    texts, expected = planted(items, 4)
    (hs,) = load_sets([write_jsonl(tmp_path / "hs.jsonl", items)], [None], 13)
    against = [hs, *load_sets([write_jsonl(tmp_path / "other.jsonl", eval_items(9, 4))], [None], 13)][:sets]

    def fresh(db: str) -> Connection:
        conn = Connection(make_config(["docs"], MONGO_CONNECTION_DB=db))
        # Another pass's test in this process may have used the same name: start from nothing.
        conn.db.client.drop_database(db)
        conn.db["docs"].insert_many(
            [{"_id": ObjectId(), "idx": i, "filt_text": t} for i, t in enumerate(texts)]
        )
        return conn

    def state(conn: Connection) -> dict:
        return {d["idx"]: (d.get(CONTAMINATED), d["decont"]) for d in conn.db["docs"].find()}

    straight = fresh(f"decont_straight{sets}")
    run_pass(straight, ["docs"], Decontamination(against), batch_size=4)
    calls = {"n": 0}
    original = passes.write_ops

    def crash(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash
        return original(*args, **kwargs)

    killed = fresh(f"decont_killed{sets}")
    monkeypatch.setattr(passes, "write_ops", crash)
    with pytest.raises(Crash):
        run_pass(killed, ["docs"], Decontamination(against), batch_size=4)
    monkeypatch.undo()
    if sets == 2:  # one set of a document's checks taken off: it alone is checked again
        killed.db["docs"].update_one({"idx": 1}, {"$unset": {"decont.other": ""}})
    report = run_pass(killed, ["docs"], Decontamination(against), batch_size=4)
    assert report.collections[0].checked == len(texts) - 8 + (sets == 2)
    assert state(killed) == state(straight)
    assert {i: m["hs"] for i, (m, _) in state(killed).items() if m} == expected
    if sets == 2:
        return
    # Another n-gram size is another key: every document is checked again, and marks no longer
    # found are taken off (a 12-word overlap is one at 12).
    (hs12,) = load_sets([tmp_path / "hs.jsonl"], [None], 12)
    again = run_pass(killed, ["docs"], Decontamination([hs12], 12), batch_size=50)
    assert again.collections[0].checked == len(texts) and again.collections[0].contaminated["hs"] == 2 * len(
        items
    )
    (back,) = load_sets([tmp_path / "hs.jsonl"], [None], 13)
    run_pass(killed, ["docs"], Decontamination([back]), batch_size=50)
    assert {i: m["hs"] for i, (m, _) in state(killed).items() if m} == expected


def test_evaluate_says_whether_the_run_trained_on_the_set(tmp_path: Path, sample_texts: list[str]) -> None:
    from dsgpt2.checkpoints.weights import RUN_INFO

    model = tiny_export(tmp_path / "export", sample_texts[:200])
    items = eval_items(5, 8)
    texts, expected = planted(items, 6)
    cfg, _ = store_config(tmp_path, ["web"])
    corpus = write_jsonl(tmp_path / "web.jsonl", [{"text": t} for t in texts])
    assert run_cli("ingest", "--config", str(cfg), str(corpus), "--no_progress").returncode == 0
    fp = {"collections": ["web"], "tr_ratio": 0.5, "seed": 7}
    (model / RUN_INFO).write_text(json.dumps({"step": 3, "fingerprint": fp}))
    hs = write_jsonl(tmp_path / "hellaswag_val.jsonl", items)
    args = ["evaluate", "--config", str(cfg), "--model", str(model), "--hellaswag", str(hs), "--no_record",
            "--report", str(tmp_path / "r.json")]  # fmt: skip
    before = run_cli(*args)
    assert before.returncode == 0, before.stderr
    assert "no decontamination against 'hellaswag_val' was run on web" in before.stdout
    assert run_cli("decontaminate", "--config", str(cfg), "--against", str(hs)).returncode == 0
    after = run_cli(*args)
    assert after.returncode == 0, after.stderr
    import numpy as np

    from dsgpt2.data.split import split_mask

    held = int(split_mask(np.array(sorted(expected)), 0.5, 7, "web").sum())
    assert 0 < held < len(expected)  # the seed puts some in each split
    assert (
        f"held {held} documents contaminated by 'hellaswag_val' (of {len(expected)} marked now"
        in after.stdout
    )
    note = json.loads((tmp_path / "r.json").read_text())["contamination"]
    assert (note["documents"], note["marked"], note["checked"]) == (held, len(expected), ["web"])


@pytest.mark.parametrize(
    ("records", "extra", "said"),
    [
        ([{"question": "q", "answer": "a"}], [], "unknown layout (line 1)"),
        ([], [], "the file is empty"),
        (["not json"], [], "line 1 is not JSON"),
        ([{"ctx": "a", "endings": ["b"], "label": 0}, {"text": "x"}], [], "line 2 is not a record"),
        ([{"text": "x"}], ["--ngram", "4"], "--ngram: must be an integer at least 5, got '4'"),
        ([{"text": "x"}], ["--name", "a", "--name", "b"], "--name given 2 times for 1 --against files"),
        ([{"text": "x"}], ["--name", "a.b"], "--name 'a.b': a set's name holds no '.'"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, records: list, extra: list, said: str) -> None:
    cfg, _ = store_config(tmp_path, ["web"])
    path = tmp_path / "eval.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    done = run_cli("decontaminate", "--config", str(cfg), "--against", str(path), *extra)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert said in line and (str(path) in line or extra), line


def _marks(conn: Connection) -> dict:
    return {d["idx"]: (d.get(CONTAMINATED), d.get("decont")) for d in conn.db["web"].find({}, {"_id": 0})}


def _corpus(tmp_path: Path, copies: int) -> tuple[Path, Path, Path, dict[int, str]]:
    """A stored corpus of ``copies`` rounds of planted documents, a straight run's database beside it,
    and the evaluation file."""
    items = eval_items(7, 8)
    texts, expected = planted(items, 8)
    every = texts * copies
    cfg, store = store_config(tmp_path, ["web"])
    corpus = write_jsonl(tmp_path / "web.jsonl", [{"text": t} for t in every])
    assert run_cli("ingest", "--config", str(cfg), str(corpus), "--no_progress").returncode == 0
    hs = write_jsonl(tmp_path / "hellaswag_val.jsonl", items)
    marked = {k * len(texts) + i: g for k in range(copies) for i, g in expected.items()}
    return cfg, store, hs, marked


@pytest.mark.slow
def test_a_pass_killed_with_sigkill_ends_as_a_straight_one(tmp_path: Path) -> None:
    """The command killed without warning once some documents are checked, then run again."""
    import signal
    import subprocess
    import sys

    from conftest import ROOT
    from pace import deadline, wait_for

    cfg, store, hs, marked = _corpus(tmp_path, 30)
    conn = Connection(make_config(["web"], **db_for(store)))
    args = [sys.executable, "-m", "dsgpt2", "decontaminate", "--config", str(cfg), "--against", str(hs),
            "--batch_size", "10", "--no_progress"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checked = {"decont.hellaswag_val": {"$exists": True}}
    wait_for(
        lambda: conn.db["web"].count_documents(checked) >= 100, 120, "100 documents checked", proc, every=0.2
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the pass finished before it could be killed"
    assert conn.db["web"].count_documents(checked) < 30 * 40
    rerun = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=deadline(300))
    assert rerun.returncode == 0, rerun.stderr
    found = {i: m["hellaswag_val"] for i, (m, _) in _marks(conn).items() if m}
    assert found == marked
    assert conn.db["web"].count_documents(checked) == 30 * 40
    conn.close()


@pytest.mark.parametrize("code", [189, 11600])
def test_the_pass_goes_on_through_transient_errors(tmp_path: Path, code: int) -> None:
    from wire_server import fail_point

    cfg, store, hs, marked = _corpus(tmp_path, 2)
    uri = json.loads(cfg.read_text())["MONGO_CONNECTION_STRING"]
    try:
        fail_point(uri, {"skip": 2, "times": 6}, failCommands=["find", "aggregate", "update"], errorCode=code)
        done = run_cli("decontaminate", "--config", str(cfg), "--against", str(hs), "--batch_size", "10",
                       "--no_progress")  # fmt: skip
    finally:
        fail_point(uri, "off")
    assert done.returncode == 0, done.stderr
    assert "transient MongoDB error" in done.stderr
    conn = Connection(make_config(["web"], **db_for(store)))
    assert {i: m["hellaswag_val"] for i, (m, _) in _marks(conn).items() if m} == marked
    conn.close()


def test_the_note_counts_below_the_checkpoints_marks_and_under_its_filter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The run's checkpoint took in the first documents only, under a FILTER: the note counts the
    marked documents of its training split below those marks that the FILTER kept."""
    import numpy as np

    from dsgpt2.checkpoints import format as ckpt_format
    from dsgpt2.data.split import split_mask
    from dsgpt2.data.table import ChunkTable
    from dsgpt2.infer.evaluate import contamination, contamination_lines

    items = eval_items(9, 8)
    texts, expected = planted(items, 10)
    config = make_config(["web"], MONGO_CONNECTION_DB="decont_note")
    conn = Connection(config)
    conn.db["web"].insert_many([{"idx": i, "filt_text": t, "keep": i % 10 != 5} for i, t in enumerate(texts)])
    hs = write_jsonl(tmp_path / "hellaswag_val.jsonl", items)
    mark = 30
    table = ChunkTable.initial(["web"], [mark], 10).to_dict()
    monkeypatch.setattr(ckpt_format, "read_client_state", lambda where, tag: {"data": {"table": table}})
    fp = {"collections": ["web"], "tr_ratio": 0.6, "seed": 3, "filter": '{"keep": true}'}
    run = {"checkpoint": str(tmp_path / "ckpt" / "global_step3"), "fingerprint": fp}
    assert contamination(config, run, hs)["checked"] == []
    run_pass(conn, ["web"], Decontamination(load_sets([hs], [None], 13)))
    note = contamination(config, run, hs)
    kept = np.array([i for i in sorted(expected) if i < mark and i % 10 != 5])
    held = int(split_mask(kept, 0.6, 3, "web").sum())
    assert 0 < held < len(kept) < len([i for i in expected if i < mark])  # each part of the rule counts
    assert (note["marks"], note["marked"], note["documents"]) == ({"web": mark}, len(kept), held)
    assert "below its checkpoint's high-water marks" in contamination_lines(note)[0]
    conn.close()
