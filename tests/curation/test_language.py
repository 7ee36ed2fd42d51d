"""Language identification in place: `dsgpt2 langid` labelling a planted multilingual corpus, a killed
pass ending as a straight one, documents ingested later labelled by the next run, FILTER by language
(a code the model never emits refused, exit 2), and the counts in `info` and `curate report`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bson import ObjectId

from conftest import db_for, make_config, run_cli, store_config, write_config
from corpora import PROSE
from dsgpt2.curation import passes
from dsgpt2.curation.language import Labelling, identify, model_codes, run_key, top_languages
from dsgpt2.curation.passes import run_pass
from dsgpt2.db.client import Connection
from dsgpt2.db.filters import LANGUAGE_CODES, check_filter_languages
from dsgpt2.errors import ConfigError

# Texts a reader knows the language of, a few sentences each.
PLANTED = {
    "en": PROSE,
    "de": "Die Stadtverwaltung hat am Dienstag beschlossen, die alte Brücke über den Fluss zu erneuern. "
    "Die Arbeiten sollen im Frühjahr beginnen und etwa zwei Jahre dauern, sagte der Bürgermeister.",
    "fr": "Le conseil municipal a décidé mardi de rénover le vieux pont sur la rivière. Les travaux "
    "devraient commencer au printemps et durer environ deux ans, a déclaré le maire de la ville.",
    "es": "El ayuntamiento decidió el martes renovar el viejo puente sobre el río. Las obras deberían "
    "comenzar en primavera y durar unos dos años, según explicó el alcalde de la ciudad.",
    "ru": "Городской совет во вторник решил отремонтировать старый мост через реку. Работы должны "
    "начаться весной и продлиться около двух лет, сообщил мэр города.",
    "ja": "市議会は火曜日、川に架かる古い橋を改修することを決めた。"
    "工事は春に始まり、約二年かかる見込みだと市長は述べた。",
}


def test_the_model_labels_planted_texts_and_its_codes_are_the_filters() -> None:
    for code, text in PLANTED.items():
        got, score = identify(text)
        assert got == code and 0.5 < score <= 1.0, (code, got, score)
    assert identify(None) == (None, 0.0) and identify("  \n") == (None, 0.0)
    # The FILTER check knows the codes without loading the model: the two lists must stay one.
    assert model_codes() == LANGUAGE_CODES
    assert run_key().startswith("py3langid-")
    assert top_languages({"en": 3, "de": 1}) == "en 3 (75.0%), de 1 (25.0%)"


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ({"lang": "xx"}, "'xx'"),
        ({"lang": {"$in": ["en", "zz"]}}, "'zz'"),
        ({"$or": [{"lang": "en"}, {"lang": {"$ne": "english"}}]}, "'english'"),
        ({"$and": [{"lang": {"$not": {"$eq": "EN"}}}]}, "'EN'"),
    ],
)
def test_a_filter_on_a_code_the_model_never_emits_is_refused(query: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=f"'lang' {named} is not a language code"):
        check_filter_languages(query, json.dumps(query))


def test_a_filter_on_known_codes_passes() -> None:
    for query in ({"lang": "en"}, {"lang": {"$in": ["en", "de"]}, "lang_score": {"$gte": 0.9}},
                  {"lang": {"$exists": True}}, {"other": "xx"}, {"lang": None}):  # fmt: skip
        check_filter_languages(query, json.dumps(query))


def _ingest(cfg: Path, tmp_path: Path, name: str, texts: list[str]) -> None:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    done = run_cli("ingest", "--config", str(cfg), str(path), "--no_progress")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_langid_labels_counts_filters_and_labels_later_documents(tmp_path: Path) -> None:
    cfg, store = store_config(tmp_path, ["docs"])
    codes = ["en", "de", "fr", "en", "es", "ru", "ja", "en"]
    _ingest(cfg, tmp_path, "first", [PLANTED[c] for c in codes])
    done = run_cli("langid", "--config", str(cfg), "--no_progress")
    assert done.returncode == 0, done.stderr
    assert "docs: 8 documents, 8 labelled by this run" in done.stdout and "en 3 (37.5%)" in done.stdout
    conn = Connection(make_config(["docs"], **db_for(store)))
    docs = {d["idx"]: d for d in conn.db["docs"].find()}
    assert [docs[i]["lang"] for i in range(8)] == codes
    assert all(d["lang_key"] == run_key() and 0.5 < d["lang_score"] <= 1 for d in docs.values())

    again = run_cli("langid", "--config", str(cfg), "--no_progress")
    assert "0 labelled by this run" in again.stdout
    _ingest(cfg, tmp_path, "later", [PLANTED["de"], PLANTED["fr"]])
    later = run_cli("langid", "--config", str(cfg), "--no_progress", "--workers", "2")
    assert later.returncode == 0 and "docs: 10 documents, 2 labelled by this run" in later.stdout, (
        later.stderr
    )
    assert [d["lang"] for d in conn.db["docs"].find({"idx": {"$gte": 8}}).sort("idx", 1)] == ["de", "fr"]
    expected = {"de": 2, "en": 3, "es": 1, "fr": 2, "ja": 1, "ru": 1}

    info = run_cli("info", "--config", str(cfg), "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["collections"][0]["languages"] == expected
    shown = run_cli("info", "--config", str(cfg))
    assert "languages (at the last langid): en 3 (30.0%), de 2 (20.0%), fr 2 (20.0%)" in shown.stdout
    report = run_cli("curate", "report", "--config", str(cfg), "--plot", str(tmp_path / "p.png"), "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["collections"][0]["languages"] == expected

    # FILTER by language: accepted and applied; a code the model never emits is one line, exit 2.
    raw = json.loads(cfg.read_text())
    german = write_config(tmp_path / "de.json", **raw, FILTER={"lang": "de"})
    kept = run_cli("info", "--config", str(german), "--json")
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout)["collections"][0]["passing_filter"] == 2
    for bad, named in (({"lang": "xx"}, "'xx'"), ({"lang": {"$in": ["en", "zz"]}}, "'zz'")):
        path = write_config(tmp_path / "bad.json", **raw, FILTER=bad)
        for command in ("info", "langid"):
            refused = run_cli(command, "--config", str(path))
            lines = refused.stderr.strip().splitlines()
            assert refused.returncode == 2 and len(lines) == 1, (command, refused.stderr)
            assert f"'lang' {named} is not a language code" in lines[0]


class Crash(Exception):
    pass


def test_a_killed_pass_ends_as_a_straight_one(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = [list(PLANTED.values())[i % len(PLANTED)] for i in range(60)] + [""]

    def fresh(db: str) -> Connection:
        conn = Connection(make_config(["docs"], MONGO_CONNECTION_DB=db))
        # Another pass's test in this process may have used the same name: start from nothing.
        conn.db.client.drop_database(db)
        conn.db["docs"].insert_many(
            [{"_id": ObjectId(), "idx": i, "filt_text": t} for i, t in enumerate(texts)]
        )
        return conn

    def labels(conn: Connection) -> dict[int, tuple]:
        return {d["idx"]: (d["lang"], d["lang_score"], d["lang_key"]) for d in conn.db["docs"].find()}

    straight = fresh("lang_straight")
    run_pass(straight, ["docs"], Labelling(), batch_size=10)
    expected = labels(straight)
    assert expected[60] == (None, 0.0, run_key())

    killed = fresh("lang_killed")
    calls = {"n": 0}
    original = passes.write_ops

    def crash(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash
        return original(*args, **kwargs)

    monkeypatch.setattr(passes, "write_ops", crash)
    with pytest.raises(Crash):
        run_pass(killed, ["docs"], Labelling(), batch_size=10)
    monkeypatch.undo()
    report = run_pass(killed, ["docs"], Labelling(), batch_size=10)
    assert report.collections[0].labelled == 61 - 20
    assert labels(killed) == expected
    assert report.collections[0].counts == {"none": 1, **{c: 10 for c in PLANTED}}
    meta = killed.db[killed.config.meta_collection].find_one({"collection": "docs"})
    assert meta["langid"]["counts"] == report.collections[0].counts and meta["langid"]["key"] == run_key()
