"""Shared fixtures: a database of its own per test on the test process's SecantusDB server, and corpus
helpers."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

from dsgpt2.db.client import Connection
from dsgpt2.db.config import MongoConfig, config_from_dict
from pace import LAUNCH_ENV, measure_launch
from wire_server import WireServer, shared_server, shared_started, unavailable_reason
from zygote import run_python

ROOT = Path(__file__).resolve().parents[1]

# tests/ holds the shared helpers (this file, zygote, forks, wire_server, inject, pace, and corpora, training,
# serving, delivery for what tests of several files share); the tests live in one folder per room of the
# package, plus e2e/ and project/. pytest puts this file's folder on sys.path, so every test module
# imports the helpers by name.

# Under pytest-xdist the workers already fill the cores: a DeepSpeed rank, a DataLoader worker or an
# in-process model computing on two threads each would only contend (about a sixth of the suite's time).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


BUILD_OPS = """
from dsgpt2.accelerator import prepare_deepspeed_environment
prepare_deepspeed_environment()
from deepspeed.accelerator import get_accelerator
if get_accelerator().device_name() == "cpu":
    get_accelerator().create_op_builder("ShareMemCommBuilder").load()
"""


def pytest_sessionstart(session: pytest.Session) -> None:
    """Before any test runs, in a process of its own (the controller's, under xdist): the reference
    launch that paces the deadlines (tests/pace.py), timed once for every test process; and DeepSpeed's
    CPU communication op, built once, so that the first DeepSpeed runs of a fresh clone never race each
    other, or a forked command, for its build, and no test's deadline pays for it (the quick lane runs
    none)."""
    import subprocess

    config = session.config
    if hasattr(config, "workerinput"):
        return
    quick = "not slow" in (config.option.markexpr or "")
    workers = int(getattr(config.option, "numprocesses", None) or 1)
    # A failed launch or build is not the suite's verdict: each test process then times its own launch,
    # and the first test to need the op builds it, as before.
    with contextlib.suppress(subprocess.SubprocessError, OSError, RuntimeError):
        os.environ[LAUNCH_ENV] = str(measure_launch(workers, then="" if quick else BUILD_OPS))


_SESSION_START = time.time()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the shared-memory allreduce buffers this session's DeepSpeed runs left in /dev/shm (66 MB
    each; the tests that kill ranks leave theirs by design): left there, they hold RAM until reboot, and a
    few hundred of them push a machine into swap."""
    if hasattr(session.config, "workerinput"):
        return
    for path in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*_127.0.0.1_*"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= _SESSION_START:
                path.unlink()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After each test's teardown, its garbage collected and what outlives it frozen: a worker holds
    torch, DeepSpeed and transformers (millions of objects), and each of the cyclic collector's full
    passes walked them all again (a third of a worker's CPU time)."""
    yield
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests skip, saying why, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


_NAMES = itertools.count()
# The database make_config() names by default: one per test (and one per module, for module fixtures).
_DEFAULT_DB: list[str] = [""]


def _fresh_db(prefix: str) -> Iterator[None]:
    name = f"{prefix}{os.getpid()}_{next(_NAMES)}"
    _DEFAULT_DB[0], before = name, _DEFAULT_DB[0]
    yield
    _DEFAULT_DB[0] = before
    if shared_started():
        _dropper().drop_database(name)


_DROPPER: dict[int, pymongo.MongoClient] = {}


def _dropper() -> pymongo.MongoClient:
    """This process's client for dropping the tests' databases: one for all of them (a client made
    and closed for each drop cost the worker and the server 8 ms of CPU apiece, against 1)."""
    if os.getpid() not in _DROPPER:
        _DROPPER[os.getpid()] = pymongo.MongoClient(shared_server(), serverSelectionTimeoutMS=10000)
    return _DROPPER[os.getpid()]


@pytest.fixture(autouse=True, scope="module")
def _module_db() -> Iterator[None]:
    yield from _fresh_db("m")


@pytest.fixture(autouse=True)
def _test_db(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("MONGO_CONNECTION_STRING", raising=False)
    yield from _fresh_db("t")


def db_for(path: Path) -> dict[str, str]:
    """Config keys naming a database of its own for ``path`` (what a file-backed store was): the same
    path, the same database, from any test, fixture or process."""
    digest = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:20]
    return {"MONGO_CONNECTION_STRING": shared_server(), "MONGO_CONNECTION_DB": f"s{digest}"}


def pyproject() -> dict[str, Any]:
    """pyproject.toml, parsed."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - pytest brings tomli where tomllib is missing
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def clone_db(source: Path, target: Path) -> dict[str, str]:
    """Copy the database of ``source`` (:func:`db_for`) with its indexes into that of ``target``, as one
    copied a store's file; returns the config keys of the copy."""
    import pymongo

    src, dst = db_for(source), db_for(target)
    with pymongo.MongoClient(src["MONGO_CONNECTION_STRING"]) as client:
        client.drop_database(dst["MONGO_CONNECTION_DB"])
        old, new = client[src["MONGO_CONNECTION_DB"]], client[dst["MONGO_CONNECTION_DB"]]
        for name in old.list_collection_names():
            docs = list(old[name].find())
            new.create_collection(name)
            for index in old[name].list_indexes():
                if index["name"] != "_id_":
                    options = {k: v for k, v in index.items() if k not in ("key", "v", "ns")}
                    new[name].create_index(list(index["key"].items()), **options)
            for start in range(0, len(docs), 5000):
                new[name].insert_many(docs[start : start + 5000])
    return dst


def make_config(collections: list[str] | tuple[str, ...] = ("a",), **overrides: Any) -> MongoConfig:
    data: dict[str, Any] = {
        "MONGO_CONNECTION_STRING": shared_server(),
        "MONGO_CONNECTION_DB": _DEFAULT_DB[0],
        "COLLECTIONS": list(collections),
        "RETRY_BACKOFF_S": 0.001,
    }
    data.update(overrides)
    return config_from_dict(data, env={})


def write_config(path: Path, **data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def store_config(tmp_path: Path, collections: list[str] | None = None) -> tuple[Path, Path]:
    """A config file in ``tmp_path`` naming a database of its own (:func:`db_for`): (config path, the
    path the database is named for)."""
    store = tmp_path / "db.mongo"
    cfg = write_config(tmp_path / "c.json", **db_for(store), COLLECTIONS=collections or ["a"])
    return cfg, store


def sample_corpus(base: Path, documents: int = 2000, vocab_size: int = 512) -> dict[str, Path]:
    """The first ``documents`` sample documents in a file-backed store in ``base``, and a
    ``vocab_size``-token vocabulary trained on them: {"config", "tok"}."""
    from dsgpt2.corpus.ingest import ingest
    from dsgpt2.corpus.readers import builtin_source
    from dsgpt2.db.config import load_config
    from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
    from dsgpt2.tokenizer.texts import mongo_texts

    cfg, _ = store_config(base, ["stdlib"])
    conn = Connection(load_config(cfg))
    ingest(conn, "stdlib", [builtin_source("stdlib", documents)])
    texts, _ = mongo_texts(conn.config)
    train_vocab(texts, base / "tok", VocabSettings(vocab_size=vocab_size), "test", progress=False)
    return {"config": cfg, "tok": base / "tok"}


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> tuple[Path, bool]:
    """``build(directory)`` once per test run, for what several test processes need and none changes (a
    module fixture rebuilt by every pytest-xdist worker that runs one of the module's tests): the first
    process to ask builds it, holding a lock; the others wait for it and share the directory. The
    directory, and whether this process built it (a database it filled is its own server's)."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the run's directory, above each worker's own
    where = root / f"once-{name}"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (where / ".built").is_file():
            return where, False
        shutil.rmtree(where, ignore_errors=True)  # a build that failed half-way
        where.mkdir()
        build(where)
        (where / ".built").touch()
        return where, True


@pytest.fixture
def local_db(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A config naming ``local://`` on a directory of ``tmp_path``, and that directory; every server on it
    stopped afterwards, a stray that no server.json names included."""
    from dsgpt2.db import embedded, procfs

    directory = tmp_path / "db"
    cfg = write_config(
        tmp_path / "c.json", MONGO_CONNECTION_STRING=f"local://{directory}", MONGO_CONNECTION_DB="corpus",
        COLLECTIONS=["stdlib"],
    )  # fmt: skip
    yield cfg, directory
    embedded.stop(directory)
    for pid in embedded.strays(directory):
        procfs.terminate(pid, 10)


def seed(conn: Connection, name: str, texts: list[Any], meta: bool = True, index: bool = True) -> None:
    """Put ``texts`` into collection ``name`` as idx 0..n-1, with meta count and unique index."""
    coll = conn.db[name]
    if index:
        coll.create_index("idx", unique=True)
    if texts:
        coll.insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
    if meta:
        conn.db[conn.config.meta_collection].update_one(
            {"collection": name}, {"$set": {"count": len(texts)}}, upsert=True
        )


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    """Run the dsgpt2 command in a process of its own, as a user would (``python -m dsgpt2``, forked
    from tests/zygote.py's pre-imported interpreter)."""
    full_env = {k: v for k, v in os.environ.items() if k != "MONGO_CONNECTION_STRING"}
    full_env.update(env or {})
    return run_python(["-m", "dsgpt2", *args], cwd=cwd or ROOT, env=full_env)


@pytest.fixture(scope="session")
def sample_texts() -> list[str]:
    from dsgpt2.corpus.builtin import stdlib_documents

    return list(stdlib_documents())


def tiny_export(
    out: Path, texts: list[str], context: int = 64, speakers: tuple[str, ...] = ("user", "bot")
) -> Path:
    """An untrained one-layer GPT-2 with a small tokenizer trained on ``texts`` (with the ``speakers``'
    tokens), saved as an export."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab

    settings = VocabSettings(vocab_size=300, speakers=speakers)
    train_vocab(iter(texts), out / "tok", settings, "test", progress=False)
    tok = AutoTokenizer.from_pretrained(str(out / "tok"))
    config = GPT2Config(
        vocab_size=len(tok), n_positions=context, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(str(out / "model"))
    tok.save_pretrained(str(out / "model"))
    return out / "model"


ENV_SERVER = "DSGPT2_TEST_MONGO_URI"


def run_wire_server(factory: pytest.TempPathFactory, name: str) -> Iterator[WireServer]:
    """A wire-protocol test server (tests/wire_server.py) for a fixture, or a skip that says why not."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = WireServer(factory.mktemp(name) / "db.sqlite").start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def wire_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WireServer]:
    """The wire-protocol test server shared by the session."""
    yield from run_wire_server(tmp_path_factory, "wire")


@pytest.fixture(scope="module", params=["wire", "env"])
def server_uri(request: pytest.FixtureRequest) -> str:
    """Each real server there is: the wire test server, and the one $DSGPT2_TEST_MONGO_URI names."""
    if request.param == "env":
        uri = os.environ.get(ENV_SERVER, "")
        if not uri:
            pytest.skip(f"no MongoDB server named by {ENV_SERVER} (e.g. the compose stack)")
        return uri
    return str(request.getfixturevalue("wire_server").uri())


def logged_blocks(workspace: Path, ranks: int, upto: int) -> dict[tuple[int, int, int], set[tuple[int, int]]]:
    """(epoch, chunk, block) → the (step, rank) that trained on it, from --log_block_ids files (the
    last record of each step: a resumed run logs the steps after its checkpoint again)."""
    from dsgpt2.train.metrics import read_metrics

    out: dict[tuple[int, int, int], set[tuple[int, int]]] = {}
    for rank in range(ranks):
        last = {r["step"]: r["block_ids"] for r in read_metrics(workspace / f"block_ids_rank{rank}.jsonl")}
        for step, ids in last.items():
            for e, c, b in ids if step <= upto else ():
                out.setdefault((e, c, b), set()).add((step, rank))
    return out


def trained_on(
    ckpt_dir: Path, tag: str, config: Any, logged: dict
) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """(collection, idx) → the (step, rank) whose logged blocks hold its tokens, found forward: each
    logged (epoch, chunk) read and packed as the run's checkpoint says, its documents' spans cut into
    blocks (lineage answers the other way, from a document to its chunk)."""
    from dsgpt2.checkpoints.format import read_client_state
    from dsgpt2.data.sources import StreamingChunks, spec_of
    from dsgpt2.data.table import ChunkTable

    saved = read_client_state(ckpt_dir, tag)
    spec, data = spec_of(saved["fingerprint"]), saved["data"]
    table = ChunkTable.from_dict(data["table"])
    source = StreamingChunks(config, table, Path(saved["vocab_dir"]), spec, "train", streams=data["streams"])
    out: dict[tuple[int, int], set[tuple[int, int]]] = {}
    try:
        for e, c in {(e, c) for e, c, _ in logged}:
            for doc, (first, end) in source.layout((e, c)).items():
                for b in range(first // spec.context, (end - 1) // spec.context + 1):
                    out.setdefault(doc, set()).update(logged.get((e, c, b), set()))
    finally:
        source.close()
    return out


def check_lineage(ckpt_dir: Path, workspace: Path, config: Path, docs: dict[str, int], ranks: int = 1) -> Any:
    """``dsgpt2 lineage`` for every document of ``docs`` (collection → count): each one's (step,
    rank) pairs are exactly those whose logged block ids hold its blocks."""
    from dsgpt2.checkpoints.lineage import lineage
    from dsgpt2.db.config import load_config

    wanted = [f"{name}:{i}" for name, n in docs.items() for i in range(n)]
    mongo = load_config(config)
    result = lineage(ckpt_dir, wanted, mongo)
    held = trained_on(ckpt_dir, result.tag, mongo, logged_blocks(workspace, ranks, result.step))
    seen = 0
    for d in result.docs:
        name, _, idx = d.doc.rpartition(":")
        want = held.get((list(mongo.collections).index(name), int(idx)), set())
        assert {(s.step, s.rank) for s in d.sightings} == want, d.doc
        assert (d.status == "trained") == bool(want), d.doc
        seen += bool(want)
    assert seen, "no document was trained on: nothing compared"
    return result


def listen(monkeypatch: pytest.MonkeyPatch, listener: pymongo.monitoring.CommandListener) -> None:
    """``listener`` on every client made from now on in this test."""
    original = pymongo.MongoClient.__init__

    def with_listener(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["event_listeners"] = [*kwargs.get("event_listeners", []), listener]
        original(self, *args, **kwargs)

    monkeypatch.setattr(pymongo.MongoClient, "__init__", with_listener)
