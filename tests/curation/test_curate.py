"""Quality signals and verdicts in place: the measures on texts with known answers, `dsgpt2 curate`
judging planted good and bad documents, a killed pass ending as a straight one, other thresholds
judging every document again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bson import ObjectId

from conftest import db_for, make_config, run_cli, store_config
from corpora import BAD, PROSE
from dsgpt2.curation import passes
from dsgpt2.curation.curate import Curation
from dsgpt2.curation.passes import run_pass
from dsgpt2.curation.quality import RULES, THRESHOLDS, failed, resolve_thresholds, signals, verdicts
from dsgpt2.db.client import Connection
from dsgpt2.errors import ConfigError


def test_signals_on_texts_with_known_answers() -> None:
    s = signals("a b\na b\nc d e\n\nx #")
    assert s["words"] == 8  # of nine tokens, '#' is symbols only
    assert s["dup_lines"] == round(1 / 4, 4)  # lines: 'a b', 'a b', 'c d e', 'x #'
    assert s["dup_line_chars"] == round(3 / 18, 4)
    assert s["symbol_ratio"] == round(1 / 9, 4)
    bullets = signals("- one\n- two\n• three\nfour")
    assert bullets["bullet_lines"] == 0.75
    grams = signals("the cat sat the cat sat the cat sat")  # 9 words
    assert grams["top_2gram"] == round(len("the cat") * 3 / 35, 4)
    # 5-grams left to right: 'the cat sat the cat' ... the first repeat starts at word 3
    # ('the cat sat the cat' again), covering 19 characters, then the scan is past the end.
    assert grams["dup_5gram"] == round(19 / 35, 4)
    c4 = signals("Lorem ipsum dolor sit amet.\nvar x = {a: 1};")
    assert c4["lorem_ipsum"] == 1 and c4["curly_brackets"] == 1
    good = signals(PROSE)
    assert good["c4_sentences"] == 6 and good["stop_words"] >= 2
    defaults = resolve_thresholds({})
    assert verdicts(good, RULES, defaults) == {"gopher": True, "repetition": True, "c4": True}
    assert failed(c4, "c4", defaults)[:1] == ["min_c4_sentences (1 < 5)"]
    assert set(defaults) == set(THRESHOLDS)
    with pytest.raises(ConfigError, match="unknown threshold 'min_wrds'"):
        resolve_thresholds({"min_wrds": 3})


def _store(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    texts = [PROSE, *BAD.values(), PROSE.replace("Tuesday", "Monday")]
    cfg, store = store_config(tmp_path, ["docs"])
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert run_cli("ingest", "--config", str(cfg), str(path), "--no_progress").returncode == 0
    return cfg, store, texts


def test_curate_judges_planted_documents_and_rejudges_under_other_thresholds(tmp_path: Path) -> None:
    cfg, store, _ = _store(tmp_path)
    result = run_cli("curate", "--config", str(cfg), "--rules", "gopher,repetition,c4", "--no_progress")
    assert result.returncode == 0, result.stderr
    assert "docs: 6 documents, 6 judged by this run" in result.stdout
    conn = Connection(make_config(["docs"], **db_for(store)))
    passes = {d["idx"]: {k: v for k, v in d["passes"].items() if k != "key"} for d in conn.db["docs"].find()}
    assert passes[0] == passes[5] == {"gopher": True, "repetition": True, "c4": True}
    assert passes[1]["gopher"] is False  # bullets
    assert passes[2]["repetition"] is False  # the same line twenty times
    assert passes[3]["c4"] is False and passes[3]["gopher"] is True  # lorem ipsum
    assert passes[4]["gopher"] is False  # too few words
    assert conn.db["docs"].find_one({"idx": 0})["quality"]["words"] == len(PROSE.split())
    conn.close()

    again = run_cli("curate", "--config", str(cfg), "--no_progress")
    assert "0 judged by this run" in again.stdout
    looser = run_cli("curate", "--config", str(cfg), "--threshold", "min_words=3", "--no_progress")
    assert looser.returncode == 0 and "6 judged by this run" in looser.stdout, looser.stderr
    bad = run_cli("curate", "--config", str(cfg), "--threshold", "min_words")
    assert bad.returncode == 2 and "give NAME=NUMBER" in bad.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("value", ["nan", "-5", "-inf"])
def test_a_threshold_that_is_no_bound_is_refused(value: str) -> None:
    """NaN compares false, so min_words=nan passed every document while the run said gopher was judged."""
    from dsgpt2.curation.curate import CurateSettings, Curation
    from dsgpt2.errors import ConfigError

    with pytest.raises(
        ConfigError, match=rf"--threshold 'min_words={value}': give a number at least 0 \(inf: no bound\)"
    ):
        Curation.build({CurateSettings: CurateSettings(threshold=(f"min_words={value}",))})
    # inf is no bound (max_words=inf turns that one bound off), and 0 a bound.
    built = Curation.build({CurateSettings: CurateSettings(threshold=("min_words=0", "max_words=inf"))})
    assert (built.thresholds["min_words"], built.thresholds["max_words"]) == (0, float("inf"))


@pytest.mark.parametrize("rules", ["", ",", " , "])
def test_rules_that_name_no_rule_set_are_refused_in_one_line(tmp_path: Path, rules: str) -> None:
    """`--rules ''` judged nothing while the run said it curated."""
    result = run_cli("curate", "--config", str(store_config(tmp_path)[0]), "--rules", rules)
    assert result.returncode == 2, result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert "--rules names no rule set; give one or more of gopher, repetition, c4" in line, line


class Crash(Exception):
    pass


def test_a_killed_pass_ends_as_a_straight_one(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = [PROSE if i % 3 else BAD["repeated"] for i in range(90)]
    thresholds = resolve_thresholds({})

    def fresh(db: str) -> Connection:
        conn = Connection(make_config(["docs"], MONGO_CONNECTION_DB=db))
        # Another pass's test in this process may have used the same name: start from nothing.
        conn.db.client.drop_database(db)
        conn.db["docs"].insert_many(
            [{"_id": ObjectId(), "idx": i, "filt_text": t} for i, t in enumerate(texts)]
        )
        return conn

    straight = fresh("straight")
    run_pass(straight, ["docs"], Curation(list(RULES), thresholds), batch_size=20)
    expected = {d["idx"]: (d["quality"], d["passes"]) for d in straight.db["docs"].find()}

    killed = fresh("killed")
    calls = {"n": 0}
    original = passes.write_ops

    def crash(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash
        return original(*args, **kwargs)

    monkeypatch.setattr(passes, "write_ops", crash)
    with pytest.raises(Crash):
        run_pass(killed, ["docs"], Curation(list(RULES), thresholds), batch_size=20)
    monkeypatch.undo()
    report = run_pass(killed, ["docs"], Curation(list(RULES), thresholds), batch_size=20)
    assert report.collections[0].judged == 90 - 40
    assert {d["idx"]: (d["quality"], d["passes"]) for d in killed.db["docs"].find()} == expected
    assert report.collections[0].failing["repetition"] == 30
    # The summary: every count equals a direct count of the marks, and each rule's first failure.
    part, docs = report.collections[0], killed.db["docs"]
    assert part.documents == 90
    assert part.passing_all == docs.count_documents({f"passes.{rule}": True for rule in RULES})
    for rule in RULES:
        assert part.failing[rule] == docs.count_documents({f"passes.{rule}": False})
    assert [e.split(" fails ")[0] for e in part.examples if " fails repetition" in e] == ["docs:0"]


def test_curate_report_prints_and_plots_what_every_pass_marked(tmp_path: Path) -> None:
    """Two collections through dedup --exact --near and curate, then `curate report`: each reason's
    count equals a direct count of its mark, with examples, and a PNG."""
    from dsgpt2.curation.steps import reasons

    cfg, store = store_config(tmp_path, ["news", "web"])
    texts = {
        "news": [PROSE, PROSE, *BAD.values(), PROSE + " And one more line."],
        "web": [PROSE, *BAD.values()],
    }
    for name, batch in texts.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in batch))
        assert run_cli("ingest", "--config", str(cfg), "--collection", name, str(path)).returncode == 0
    for args in (["dedup", "--exact", "--near"], ["curate"]):
        done = run_cli(*args, "--config", str(cfg), "--no_progress")
        assert done.returncode == 0, done.stderr
    plot = tmp_path / "out" / "curation.png"
    done = run_cli("curate", "report", "--config", str(cfg), "--plot", str(plot), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["plot"] == str(plot)
    conn = Connection(make_config(["news", "web"], **db_for(store)))  # fmt: skip
    for part in report["collections"]:
        coll = conn.db[part["name"]]
        assert part["documents"] == len(texts[part["name"]])
        for r in reasons():
            assert part["removed"][r.label] == coll.count_documents(dict(r.query)), (part["name"], r.label)
        assert part["kept"] == coll.count_documents({"$nor": [dict(r.query) for r in reasons()]})
    web = report["collections"][1]
    assert web["removed"]["exact duplicate"] == 1 + len(BAD) and web["kept"] == 0  # all of web is in news
    assert web["examples"]["exact duplicate"][0].startswith("web:0 (of news:0): ")
    lines = run_cli("curate", "report", "--config", str(cfg), "--plot", str(plot))
    assert (
        lines.returncode == 0
        and "  exact duplicate" in lines.stdout
        and "e.g. web:0 (of news:0)" in lines.stdout
    )
    # A pass that never ran is said so, not counted as clean; the ones that ran are not.
    assert report["collections"][0]["unchecked"] == ["contaminated"]
    assert (
        "  contaminated             —  not checked (run dsgpt2 decontaminate --against FILE)" in lines.stdout
    )
    assert lines.stdout.count("not checked") == 2  # contaminated, in each collection


def test_curate_report_before_any_pass_says_no_check_ran(tmp_path: Path) -> None:
    """A corpus never curated: every reason "not checked", nothing read as "checked, and clean"."""
    from dsgpt2.curation.steps import reasons

    cfg, _ = store_config(tmp_path, ["news"])
    path = tmp_path / "news.jsonl"
    path.write_text(json.dumps({"text": PROSE}) + "\n")
    assert run_cli("ingest", "--config", str(cfg), "--collection", "news", str(path)).returncode == 0
    lines = run_cli("curate", "report", "--config", str(cfg), "--plot", str(tmp_path / "p.png"))
    assert lines.returncode == 0, lines.stderr
    unchecked = [line for line in lines.stdout.splitlines() if "not checked (run dsgpt2 " in line]
    assert len(unchecked) == len(reasons()) and "0.0%" not in lines.stdout.split("kept by all")[0]
