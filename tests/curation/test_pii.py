"""PII redaction: the rules on planted items and their lookalikes (precision and recall), idempotence,
`dsgpt2 redact` in place (the original kept, counts per kind, incremental), a killed pass ending as a
straight one, `ingest --pii` equal to ingest then redact, and the refusal to change a trained prefix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bson import ObjectId

from conftest import db_for, make_config, run_cli, store_config
from dsgpt2.curation import passes
from dsgpt2.curation.passes import run_pass
from dsgpt2.curation.pii import KINDS, PII_VERSION, Redaction, redact, redact_document
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import write_meta
from dsgpt2.errors import CorpusError

# Each a sentence with one item to replace, and its kind.
POSITIVES: list[tuple[str, str]] = [
    ("Write to john.doe@gmail.com for the slides.", "email"),
    ("Questions go to a_b+tag@mail.uni-heidelberg.de.", "email"),
    ("Reach me: JANE@EXAMPLE.CO.UK any time", "email"),
    ("(maria.garcia@empresa.es)", "email"),
    ("contact <support-team@company.io>", "email"),
    ("The server at 93.184.216.34 answered.", "ip"),
    ("Resolver 8.8.8.8, then the next one.", "ip"),
    ("Blocked 185.220.101.4 after the scan", "ip"),
    ("Connect to http://151.101.1.69/index.html now", "ip"),
    ("host 2a00:1450:4001:82a::200e is online", "ip"),
    ("ping 2001:4860:4860::8888 twice", "ip"),
    ("Call (212) 555-1234 before noon.", "phone"),
    ("Call 212-555-1234 today", "phone"),
    ("Phone: 212.555.1234", "phone"),
    ("Dial 1-800-275-2273 toll free", "phone"),
    ("Ring +44 20 7946 0958 please", "phone"),
    ("Tel. +49 30 12345678", "phone"),
    ("Bureau: +33 1 23 45 67 89.", "phone"),
    ("From the UK dial 020 7946 0958 now", "phone"),
    ("Fax 212 555 9876 anytime", "phone"),
]
# Each a sentence whose numbers and at-signs must be left as they are.
NEGATIVES: list[str] = [
    "Upgrade to version 1.2.3.4 first.",
    "Released as v1.2.3.4 last week.",
    "See section 1.2.3.4 of the standard.",
    "Pin it: python==3.11.4.1",
    "An OID such as 1.3.6.1.4.1 names it",
    "The sequence 1.2.3.4.5 continues.",
    "We met on 2024-01-15 at noon.",
    "We met on 15/01/2024 at noon.",
    "It lasted from 1990-1995 in all.",
    "Pi is 3.14159 and e is 2.71828.",
    "Coordinates 48.8566, 2.3522 mark Paris.",
    "It costs $1,234,567.89 in total.",
    "A total of 1234567890 units.",
    "x = a@b  # matrix product",
    "y = A@B.T",
    "y = self.w@self.x.data(0)",
    "@property",
    "ISBN 978-3-16-148410-0 is the book.",
    "ISBN 0-306-40615-2 is older.",
    "Mail user@example.com for the docs.",
    "Clone git@github.com:owner/repo.git first",
    "The router is 192.168.1.1 at home.",
    "Loopback 127.0.0.1 and 10.0.0.1 are local.",
    "Bind to 0.0.0.0 to listen everywhere.",
    "Docs use 192.0.2.1 and 2001:db8::1 as examples.",
    "Use std::vector<int> here.",
    "At 10:30:45 the job ran.",
    "The MAC is 00:1A:2B:3C:4D:5E here.",
    "Link-local fe80::1 stays.",
    "Call 555-0100 in the film.",
    "SSN-like 123-45-6789 is not a phone.",
    "Page 12 of 345, chapter 6.",
]


def test_precision_and_recall_on_planted_items_and_lookalikes() -> None:
    hits = sum(redact(text)[1][kind] for text, kind in POSITIVES)
    wrong_kind = sum(sum(redact(text)[1].values()) - redact(text)[1][kind] for text, kind in POSITIVES)
    false = sum(sum(redact(text)[1].values()) for text in NEGATIVES)
    recall = hits / len(POSITIVES)
    precision = hits / max(hits + wrong_kind + false, 1)
    assert recall >= 0.95 and precision >= 0.95, (precision, recall)
    for text in NEGATIVES:
        assert redact(text) == (text, dict.fromkeys(KINDS, 0)), text


def test_placeholders_are_of_the_kind_and_redacting_twice_changes_nothing() -> None:
    text = "Mail a.b@gmail.com or c@d.org, ring (212) 555-1234, server 93.184.216.34 and 2a00:1450::1."
    once, counts = redact(text)
    assert counts == {"email": 2, "ip": 2, "phone": 1}
    assert "email@example.com" in once and "firstname.lastname@example.org" in once
    assert "192.0.2.1" in once and "2001:db8::1" in once and "555-01" in once
    assert redact(once) == (once, dict.fromkeys(KINDS, 0))
    assert redact(text) == (once, counts)  # deterministic


def test_a_conversation_is_redacted_turn_by_turn() -> None:
    turns = [{"speaker": "user", "text": "my mail is x.y@gmail.com"}, {"speaker": "bot", "text": "noted"}]
    doc = {"form": "{...}", "filt_text": "user: my mail is x.y@gmail.com\nbot: noted", "turns": turns}
    fields = redact_document(doc, "filt_text")
    assert fields is not None
    assert fields["turns"][0]["text"] == "my mail is email@example.com"
    assert fields["filt_text"] == "user: my mail is email@example.com\nbot: noted"
    assert fields["pii"] == {"v": PII_VERSION, "email": 1, "ip": 0, "phone": 0} and "form" not in fields
    # A document with no form (a collection numbered in place) keeps its original in one.
    assert redact_document({"body": "ring 212-555-1234"}, "body")["form"] == "ring 212-555-1234"
    assert redact_document({"other": 1}, "filt_text") is None


def _texts(n: int) -> list[str]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(f"Document {i}: write to user{i}@mail{i}.com or call 212-555-{1000 + i}.")
        elif i % 3 == 1:
            out.append(f"Document {i}: version 1.2.3.{i % 200} ships on 2024-01-{1 + i % 28:02d}.")
        else:
            out.append(f"Document {i}: the host 93.184.{i % 200}.34 went down.")
    return out


def _fresh(db: str, texts: list[str]) -> Connection:
    conn = Connection(make_config(["docs"], MONGO_CONNECTION_DB=db))
    # Another pass's test in this process may have used the same name: start from nothing.
    conn.db.client.drop_database(db)
    conn.db["docs"].insert_many(
        [{"_id": ObjectId(), "idx": i, "form": t, "filt_text": t} for i, t in enumerate(texts)]
    )
    return conn


def _state(conn: Connection) -> dict[int, Any]:
    return {d["idx"]: (d["form"], d["filt_text"], d["pii"], d["text_hash"]) for d in conn.db["docs"].find()}


class Crash(Exception):
    pass


def test_a_killed_pass_ends_as_a_straight_one(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = _texts(90)
    straight = _fresh("straight", texts)
    report = run_pass(straight, ["docs"], Redaction(), batch_size=20)
    expected = _state(straight)
    assert report.collections[0].redacted == 90
    assert report.collections[0].found == {"email": 30, "ip": 30, "phone": 30}
    assert expected[0][1] == "Document 0: write to email@example.com or call +1-202-555-0143."
    assert expected[1][1] == texts[1] and expected[1][2] == {
        "v": PII_VERSION,
        "email": 0,
        "ip": 0,
        "phone": 0,
    }
    assert all(form == text for (form, *_), text in zip(expected.values(), texts, strict=True))

    killed = _fresh("killed", texts)
    calls = {"n": 0}
    original = passes.write_ops

    def crash(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash
        original(*args, **kwargs)

    monkeypatch.setattr(passes, "write_ops", crash)
    with pytest.raises(Crash):
        run_pass(killed, ["docs"], Redaction(), batch_size=20)
    monkeypatch.undo()
    again = run_pass(killed, ["docs"], Redaction(), batch_size=20)
    assert again.collections[0].redacted == 90 - 40
    assert _state(killed) == expected
    assert run_pass(killed, ["docs"], Redaction(), batch_size=20).collections[0].redacted == 0
    assert _state(killed) == expected


def _ingest(cfg: Path, tmp_path: Path, name: str, texts: list[str], *extra: str) -> None:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    done = run_cli("ingest", "--config", str(cfg), str(path), "--no_progress", *extra)
    assert done.returncode == 0, done.stderr


def test_redact_in_place_counts_per_kind_and_takes_in_later_documents(tmp_path: Path) -> None:
    cfg, store = store_config(tmp_path, ["docs"])
    texts = _texts(12)
    _ingest(cfg, tmp_path, "first", texts[:9])
    done = run_cli("redact", "--config", str(cfg), "--no_progress")
    assert done.returncode == 0, done.stderr
    assert "docs: 9 documents, 9 redacted by this run; replaced in all: email 3, ip 3, phone 3" in done.stdout
    assert "0 redacted by this run" in run_cli("redact", "--config", str(cfg), "--no_progress").stdout
    _ingest(cfg, tmp_path, "later", texts[9:])
    later = run_cli("redact", "--config", str(cfg), "--no_progress", "--workers", "2")
    assert (
        "docs: 12 documents, 3 redacted by this run; replaced in all: email 4, ip 4, phone 4" in later.stdout
    )
    conn = Connection(make_config(["docs"], **db_for(store)))
    redacted = {d["idx"]: d for d in conn.db["docs"].find()}
    assert [redacted[i]["form"] for i in range(12)] == texts
    assert [redacted[i]["filt_text"] for i in range(12)] == [redact(t)[0] for t in texts]
    conn.close()
    report = run_cli("curate", "report", "--config", str(cfg), "--plot", str(tmp_path / "p.png"))
    assert report.returncode == 0, report.stderr
    assert (
        "pii redacted             8   66.7%  (of 12 checked; replaced: email 4, ip 4, phone 4)"
        in report.stdout
    )

    # ingest --pii stores what ingest and then redact store.
    (tmp_path / "two").mkdir()
    cfg2, store2 = store_config(tmp_path / "two", ["docs"])
    _ingest(cfg2, tmp_path, "both", texts, "--pii")
    conn2 = Connection(make_config(["docs"], **db_for(store2)))
    at_ingest = {d["idx"]: d for d in conn2.db["docs"].find()}
    fields = ("form", "filt_text", "pii", "text_hash")
    assert [[at_ingest[i][f] for f in fields] for i in range(12)] == [
        [redacted[i][f] for f in fields] for i in range(12)
    ]
    conn2.close()
    assert "0 redacted by this run" in run_cli("redact", "--config", str(cfg2), "--no_progress").stdout


def test_a_trained_prefix_is_redacted_only_with_force() -> None:
    conn = _fresh("trained", _texts(10))
    write_meta(conn, "docs", {"trained": {"mark": 6, "run": "runs/a", "at": 1.0}})
    with pytest.raises(CorpusError, match=r"run 'runs/a' trained on its first 6 documents.*--force"):
        run_pass(conn, ["docs"], Redaction())
    assert conn.db["docs"].count_documents({"pii": {"$exists": True}}) == 0
    assert run_pass(conn, ["docs"], Redaction(force=True)).collections[0].redacted == 10
    # The trained prefix redacted: documents ingested later are redacted without --force.
    conn.db["docs"].insert_one({"idx": 10, "form": "x@gmail.com", "filt_text": "x@gmail.com"})
    assert run_pass(conn, ["docs"], Redaction()).collections[0].redacted == 1


def test_the_refusal_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg, store = store_config(tmp_path, ["docs"])
    _ingest(cfg, tmp_path, "first", _texts(3))
    conn = Connection(make_config(["docs"], **db_for(store)))
    write_meta(conn, "docs", {"trained": {"mark": 3, "run": "runs/a", "at": 1.0}})
    conn.close()
    refused = run_cli("redact", "--config", str(cfg), "--no_progress")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "redact before training, or pass --force" in refused.stderr
    forced = run_cli("redact", "--config", str(cfg), "--no_progress", "--force")
    assert forced.returncode == 0 and "3 redacted by this run" in forced.stdout, forced.stderr


def test_the_bench_cases_score_as_the_bench_reports() -> None:
    from bench.bench_pii import cases, ours, score

    positives, negatives = cases(20)
    precision, recall = score(ours(), [c for kind in positives.values() for c in kind], negatives)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall)


@pytest.mark.parametrize("code", [189, 11600])
def test_redact_goes_on_through_transient_errors(tmp_path: Path, code: int) -> None:
    from wire_server import fail_point

    cfg, store = store_config(tmp_path, ["docs"])
    texts = _texts(60)
    _ingest(cfg, tmp_path, "docs", texts)
    uri = json.loads(cfg.read_text())["MONGO_CONNECTION_STRING"]
    try:
        fail_point(uri, {"skip": 2, "times": 6}, failCommands=["find", "aggregate", "update"], errorCode=code)
        done = run_cli("redact", "--config", str(cfg), "--batch_size", "10", "--no_progress")
    finally:
        fail_point(uri, "off")
    assert done.returncode == 0, done.stderr
    assert "transient MongoDB error" in done.stderr
    conn = Connection(make_config(["docs"], **db_for(store)))
    docs = sorted(conn.db["docs"].find({}, {"idx": 1, "filt_text": 1}), key=lambda d: d["idx"])
    conn.close()
    assert [d["filt_text"] for d in docs] == [redact(t)[0] for t in texts]  # as a run without faults


def test_the_report_counts_the_documents_redaction_changed_among_those_it_checked() -> None:
    from conftest import seed
    from dsgpt2.curation.report import report_lines, summarize

    conn = Connection(make_config(["p"]))
    seed(conn, "p", [f"text {i}" for i in range(10)])
    for i in range(10):
        found = {"email": 1, "ip": 0, "phone": 2} if i in (2, 7) else dict.fromkeys(KINDS, 0)
        conn.db["p"].update_one({"idx": i}, {"$set": {"pii": {"v": PII_VERSION, **found}}})
    lines = report_lines(summarize(conn, ["p"], examples=0))
    assert "  pii redacted             2   20.0%  (of 10 checked; replaced: email 2, ip 0, phone 4)" in lines
