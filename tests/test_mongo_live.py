"""The data layer against a real MongoDB server: what mongomock cannot show.

Runs when DSGPT2_TEST_MONGO_URI names a server, for example the compose stack:
    DSGPT2_TEST_MONGO_URI=mongodb://user:pass@127.0.0.1:27017/?authSource=admin make test
Each test works in a database of its own and drops it afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import make_config
from dsgpt2.config import MongoConfig, redact_uri
from dsgpt2.errors import MongoUnavailableError
from dsgpt2.ingest import file_source, ingest
from dsgpt2.mongo import Connection, MongoWrapper, connect
from dsgpt2.validate import validate_collection

URI = os.environ.get("DSGPT2_TEST_MONGO_URI", "")
pytestmark = [
    pytest.mark.mongo_live,
    pytest.mark.skipif(not URI, reason="needs a MongoDB server: set DSGPT2_TEST_MONGO_URI"),
]


@pytest.fixture
def live() -> Iterator[Connection]:
    cfg = make_config(
        ["a", "b"], MONGO_CONNECTION_STRING=URI, MONGO_CONNECTION_DB=f"dsgpt2_test_{uuid.uuid4().hex[:8]}"
    )
    conn = connect(cfg)
    yield conn
    conn.client.drop_database(cfg.db)
    conn.close()


def test_ingest_validate_and_read_back(live: Connection, tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("".join(f"line {i}\n" for i in range(2500)))
    ingest(live, "a", [file_source(f)], batch_size=700)
    ingest(live, "b", [file_source(f)], batch_size=700)
    for name in ("a", "b"):
        assert validate_collection(live, name).problems == []
    wrapper = MongoWrapper(live.config, connection=live)
    assert len(wrapper) == 5000
    docs = [d for chunk in wrapper.iter_range(2000, 3000, chunk=1000) for d in chunk]
    assert [d.text for d in docs[:2]] == ["line 2000", "line 2001"]
    assert [d.text for d in docs[-2:]] == ["line 498", "line 499"]


def test_round_trips_per_1000_documents(live: Connection, tmp_path: Path) -> None:
    from pymongo import monitoring

    class Count(monitoring.CommandListener):
        def __init__(self) -> None:
            self.commands: list[str] = []

        def started(self, event: monitoring.CommandStartedEvent) -> None:
            target = event.command.get("find") or event.command.get("collection")
            if event.command_name in ("find", "getMore") and target == "a":
                self.commands.append(event.command_name)

        def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
            pass

        def failed(self, event: monitoring.CommandFailedEvent) -> None:
            pass

    f = tmp_path / "t.txt"
    f.write_text("".join(f"a fairly ordinary sentence number {i}\n" for i in range(3000)))
    ingest(live, "a", [file_source(f)])
    listener = Count()
    monitoring.register(listener)  # applies to clients made from now on
    conn = Connection(live.config.with_collections(["a"]))
    wrapper = MongoWrapper(conn.config, connection=conn)
    for _ in wrapper.iter_range(0, 3000, chunk=1000):
        pass
    assert len(listener.commands) <= 2 * 3, listener.commands
    conn.close()


def test_undecodable_text_is_one_skipped_document(live: Connection) -> None:
    import bson
    from bson.raw_bson import RawBSONDocument

    coll = live.db["a"]
    coll.create_index("idx", unique=True)
    coll.insert_one({"idx": 0, "filt_text": "good"})
    raw = bson.encode({"idx": 1, "filt_text": "bad XX"}).replace(b"bad XX", b"bad \xff\xfe")
    coll.insert_one(RawBSONDocument(raw))
    coll.insert_one({"idx": 2, "filt_text": "good too"})
    live.db["meta_info"].insert_one({"collection": "a", "count": 3})
    wrapper = MongoWrapper(live.config.with_collections(["a"]), connection=live)
    assert [d.text for d in wrapper.get_range(0, 3)] == ["good", "good too"]
    assert dict(wrapper.skipped) == {"invalid_unicode": 1}


def test_wrong_password_is_refused_clearly() -> None:
    if "@" not in URI.split("://", 1)[1].split("/", 1)[0]:
        pytest.skip("the server URI carries no credentials")
    scheme, rest = URI.split("://", 1)
    user = rest.split("@", 1)[0].split(":", 1)[0]
    wrong = f"{scheme}://{user}:definitely-wrong@{rest.split('@', 1)[1]}"
    cfg = make_config(["a"], MONGO_CONNECTION_STRING=wrong)
    assert isinstance(cfg, MongoConfig)
    with pytest.raises(MongoUnavailableError) as err:
        connect(cfg)
    assert "definitely-wrong" not in str(err.value)
    assert "refused the login" in str(err.value)
    assert redact_uri(wrong) == wrong.replace("definitely-wrong", "***")
