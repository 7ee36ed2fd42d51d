from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, make_config, write_config
from dsgpt2.db.config import MongoConfig, config_from_dict, load_config, redact_uri, scrub, uri_hosts
from dsgpt2.errors import ConfigError

BASE = {"MONGO_CONNECTION_STRING": "mongodb://h:27017", "MONGO_CONNECTION_DB": "corpus", "COLLECTIONS": ["a"]}


def test_original_keys_load(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path / "c.json", **BASE, TEXT_FIELD="body"), env={})
    assert cfg.uri == "mongodb://h:27017"
    assert cfg.db == "corpus"
    assert cfg.collections == ("a",)
    assert cfg.text_field == "body"
    assert cfg.meta_collection == "meta_info"


def test_environment_overrides_connection_string(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.json", **BASE)
    cfg = load_config(path, env={"MONGO_CONNECTION_STRING": "mongodb://u:pw@other:1"})
    assert cfg.uri == "mongodb://u:pw@other:1"
    # The file may then leave the connection string out entirely.
    data = {k: v for k, v in BASE.items() if k != "MONGO_CONNECTION_STRING"}
    assert config_from_dict(data, env={"MONGO_CONNECTION_STRING": "local://runs/db"}).is_local
    with pytest.raises(ConfigError, match="MONGO_CONNECTION_STRING"):
        config_from_dict(data, env={})


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "COLLECTION": ["x"]}, env={})
    assert "COLLECTION" in str(err.value)
    assert "MONGO_CONNECTION_DB" in str(err.value) and "COLLECTIONS" in str(err.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"COLLECTIONS": []}, "at least one"),
        ({"COLLECTIONS": "a"}, "COLLECTIONS must be list"),
        ({"COLLECTIONS": ["a", "a"]}, "twice"),
        ({"COLLECTIONS": ["a", 3]}, "not a collection name: it must be a non-empty string"),
        ({"COLLECTIONS": ["bad$name"]}, "COLLECTIONS holds 'bad\\$name', not a collection name"),
        ({"COLLECTIONS": ["system.users"]}, "MongoDB's own"),
        ({"COLLECTIONS": ["x" * 201]}, "longer than 200 bytes"),
        # JSON's Infinity and NaN, which Python's reader takes.
        ({"COLLECTIONS": [{"name": "a", "weight": float("inf")}]}, r"weights \[inf\]: inf is not a finite"),
        ({"COLLECTIONS": [{"name": "a", "weight": float("nan")}]}, r"weights \[nan\]: nan is not a finite"),
        ({"MONGO_CONNECTION_DB": ""}, "database name"),
        ({"MONGO_CONNECTION_DB": "my db"}, "may not contain ' '"),
        ({"MONGO_CONNECTION_DB": "a.b"}, "may not contain '.'"),
        ({"MONGO_CONNECTION_STRING": "http://x"}, "must start with"),
        ({"RETRIES": -1}, "RETRIES"),
        ({"RETRIES": True}, "RETRIES must be int"),
        ({"SERVER_SELECTION_TIMEOUT_MS": 0}, "positive"),
        ({"META_COLLECTION": "a"}, "META_COLLECTION"),
        ({"READ_PREFERENCE": "secondaryish"}, "READ_PREFERENCE 'secondaryish' is not a read preference"),
        ({"READ_PREFERENCE_TAGS": [{"dc": 1}]}, "READ_PREFERENCE_TAGS must be a list of objects of strings"),
        ({"READ_PREFERENCE_TAGS": [{"dc": "east"}]}, "do not apply to READ_PREFERENCE primary"),
    ],
)
def test_invalid_values_name_the_key(change: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        config_from_dict({**BASE, **change}, env={})


def test_missing_required_key() -> None:
    with pytest.raises(ConfigError, match="missing required key COLLECTIONS"):
        config_from_dict({k: v for k, v in BASE.items() if k != "COLLECTIONS"}, env={})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"MONGO_CONNECTION_DB": "x",\n  "COLLECTIONS": [}')
    with pytest.raises(ConfigError, match=r"not valid JSON.*line 2"):
        load_config(bad)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train_iters: 30\n")
    with pytest.raises(
        ConfigError, match=r"recipe.yaml looks like an experiment file: give that to `dsgpt2 tr"
    ):
        load_config(recipe)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(arr)


@pytest.mark.parametrize(
    ("uri", "redacted"),
    [
        ("mongodb://user:s3cret@h:27017/db", "mongodb://user:***@h:27017/db"),
        ("mongodb+srv://user:p%40ss@cluster.example/db", "mongodb+srv://user:***@cluster.example/db"),
        ("mongodb://user@h/db", "mongodb://user@h/db"),
        ("mongodb://h/?authSource=a&password=zz&x=1", "mongodb://h/?authSource=a&password=***&x=1"),
        ("local://runs/db", "local://runs/db"),
        ("alice:s3cret@h/db", "alice:***@h/db"),  # the scheme left out
        ("local:///srv/a@b", "local:///srv/a@b"),
        (
            "mongodb://u@h/?authMechanism=MONGODB-AWS&authMechanismProperties=AWS_SESSION_TOKEN:tok9&w=1",
            "mongodb://u@h/?authMechanism=MONGODB-AWS&authMechanismProperties=***&w=1",
        ),
    ],
)
def test_redact_uri(uri: str, redacted: str) -> None:
    assert redact_uri(uri) == redacted


def test_password_never_in_repr_dict_or_scrubbed_text() -> None:
    cfg = config_from_dict({**BASE, "MONGO_CONNECTION_STRING": "mongodb://u:p%40ssw0rd@h:1/"}, env={})
    for text in (repr(cfg), str(cfg), json.dumps(cfg.to_dict()), cfg.display_uri):
        assert "ssw0rd" not in text
    assert cfg.to_dict()["MONGO_CONNECTION_STRING"] == "mongodb://u:***@h:1/"
    # Both the encoded and the decoded password are scrubbed from arbitrary text.
    assert scrub("auth p%40ssw0rd / p@ssw0rd failed", cfg.uri) == "auth *** / *** failed"
    assert cfg.hosts == "h:1"


def test_uri_hosts() -> None:
    assert uri_hosts("mongodb://u:p@h1:1,h2:2/db?x=1") == "h1:1,h2:2"
    assert uri_hosts("mongodb://h") == "h"
    assert uri_hosts("local://runs/db") == "local://runs/db"


@pytest.mark.parametrize(
    ("uri", "suggested"),
    [("mongomock://runs/sample.mongo", "local://runs/sample"), ("mongomock://", "local://runs/db"),
     ("postgres://u:pw@h/x", "local://runs/db")],
)  # fmt: skip
def test_a_connection_string_of_another_scheme_says_what_to_write(uri: str, suggested: str) -> None:
    """A config written for the old file store (or any other scheme): one line naming what to write."""
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "MONGO_CONNECTION_STRING": uri}, env={})
    message = str(err.value)
    assert f"write {suggested} for the embedded database" in message and "mongodb://" in message
    assert "\n" not in message and "pw" not in message


def test_with_collections_keeps_the_rest() -> None:
    cfg = make_config(["a", "b"], TEXT_FIELD="t")
    sub = cfg.with_collections(["b"])
    assert sub.collections == ("b",) and sub.text_field == "t" and sub.uri == cfg.uri
    assert isinstance(sub, MongoConfig)


CONNECTION_CONFIGS = sorted(
    p for p in (ROOT / "configs").glob("*.json") if not p.name.startswith("ds_config")
)


@pytest.mark.parametrize("path", CONNECTION_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_connection_config_loads(path: Path) -> None:
    cfg = load_config(path, env={})
    assert cfg.collections


@pytest.mark.parametrize("key", ["COLLECTIONS", "MONGO_CONNECTION_DB", "FILTER", "META_COLLECTION"])
def test_text_that_is_not_utf8_in_a_config_is_one_line(key: str) -> None:
    """A JSON ``\\udcff`` escape is a lone surrogate, which no BSON can carry: the driver's traceback
    (UnicodeEncodeError) at the first command, where one line names the key."""
    data: dict = {"MONGO_CONNECTION_STRING": "mongodb://127.0.0.1:1", "MONGO_CONNECTION_DB": "c",
                  "COLLECTIONS": ["a"]}  # fmt: skip
    data[key] = {"FILTER": {"x\udcff": 1}, "COLLECTIONS": ["a\udcffb"]}.get(key, "a\udcffb")
    with pytest.raises(ConfigError, match=f"c.json: {key} holds text that is not UTF-8"):
        config_from_dict(data, env={}, source="c.json")


def test_a_collection_named_by_bytes_the_shell_could_not_decode_is_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from pace import deadline

    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING="mongodb://127.0.0.1:1",
                       MONGO_CONNECTION_DB="c", COLLECTIONS=["a"])  # fmt: skip
    (tmp_path / "f.txt").write_text("hello\n")
    for command in (["ingest", str(tmp_path / "f.txt")], ["validate"], ["dedup", "--exact"]):
        argv = [sys.executable, "-m", "dsgpt2", *command, "--config", str(cfg), "--collection"]
        out = subprocess.run([os.fsencode(a) for a in argv] + [b"x\xff\xfey"], capture_output=True,
                             cwd=ROOT, timeout=deadline(120))  # fmt: skip
        err = out.stderr.decode("utf-8", "replace")
        assert out.returncode == 2 and "Traceback" not in err, err[-2000:]
        assert "is not a collection name: it is not UTF-8 text" in err.strip().splitlines()[-1], err


def test_a_connection_string_without_its_scheme_keeps_its_password_back_and_names_its_source() -> None:
    data = {"MONGO_CONNECTION_STRING": "alice:s3cret@h", "MONGO_CONNECTION_DB": "c", "COLLECTIONS": ["a"]}
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data, env={}, source="c.json")
    assert "s3cret" not in str(caught.value) and "'alice:***@h'" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        config_from_dict({**data, "MONGO_CONNECTION_STRING": "mongodb://h"},
                         env={"MONGO_CONNECTION_STRING": "bob:pw9@h"}, source="c.json")  # fmt: skip
    said = str(caught.value)
    assert "pw9" not in said and said.startswith("c.json, with MONGO_CONNECTION_STRING from the environment:")
