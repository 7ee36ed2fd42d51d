"""The checkpointer alone, with its own settings: which checkpoint a run resumes from, the ones it refuses
(and what it advises), what a save records, and what a restore brings back. A stand-in engine writes
and reads the states file as DeepSpeed does; the corpus is a database of the test's own."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import make_config, seed
from dsgpt2.checkpoints.checkpointer import Checkpointer, CheckpointSettings, TrainState
from dsgpt2.checkpoints.format import CHECKPOINTS, LATEST, complete_tags, read_client_state
from dsgpt2.checkpoints.options import RESOLVED, CheckpointOptions
from dsgpt2.checkpoints.publisher import Publisher
from dsgpt2.corpus.marks import prefix_record, read_marks
from dsgpt2.data.dealing import ReadState
from dsgpt2.data.sources import LAYOUTS
from dsgpt2.data.table import ChunkTable
from dsgpt2.db.client import Connection
from dsgpt2.errors import CheckpointError, TrainingAborted
from dsgpt2.stores.base import DirectoryStore

SEED = 5
FINGERPRINT = {"layout": LAYOUTS["spread"], "tokenizer": "t-one", "context": 32, "chunk_docs": 10}
MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_inner": None, "n_positions": 32, "vocab_size": 300}


class FakeEngine:
    """What the checkpointer asks of a DeepSpeed engine: its module and rate, and the states file of a
    tag written and read back (the module's weights and the client state, as DeepSpeed keeps them)."""

    global_rank = 0
    lr_scheduler = None

    def __init__(self, weight: float = 0.5, lr: float = 1e-3, partitioned: bool = False) -> None:
        self.module = torch.nn.Linear(2, 2)
        with torch.no_grad():
            self.module.weight.fill_(weight)
        self.lr, self.partitioned = lr, partitioned

    def get_lr(self) -> list[float]:
        return [self.lr]

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.module.state_dict(), **client_state}, d / "mp_rank_00_model_states.pt")
        if self.partitioned:
            # A shard as ZeRO 3 writes one (ZeRO 1 and 2 convert: tests/e2e/test_ranks.py).
            torch.save(
                {"optimizer_state_dict": {"zero_stage": 3}}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
            )

    def load_checkpoint(self, load_dir: str, tag: str, **_: Any) -> tuple[str, dict[str, Any]]:
        path = Path(load_dir) / tag / "mp_rank_00_model_states.pt"
        blob = torch.load(path, weights_only=False)
        self.module.load_state_dict(blob.pop("module"))
        return str(path), blob


class FakeConfig:
    def to_dict(self) -> dict[str, Any]:
        return dict(MODEL)


@pytest.fixture
def corpus() -> tuple[Connection, tuple[int, ...]]:
    """40 documents in collection ``a``: the connection and its marks."""
    conn = Connection(make_config(["a"]))
    seed(conn, "a", [f"document number {i}, with a few words" for i in range(40)])
    return conn, read_marks(conn)


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Iterator[Any]:
    """The warnings the checkpointer logs (caught on ``dsgpt2``, which stops propagating once a run
    has set logging up in this process)."""
    logger = logging.getLogger("dsgpt2")
    propagate, level = logger.propagate, logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    logger.propagate = propagate


def settings(tmp_path: Path, train_iters: int = 10, **ckpt: Any) -> CheckpointSettings:
    options = CheckpointOptions(**{"ckpt_dir": tmp_path / "ckpt", **ckpt})
    args = {"train_iters": train_iters, "model_select": "tiny", "ckpt_dir": str(options.ckpt_dir)}
    resolved = f"# The resolved configuration.\ntrain_iters: {train_iters}\n"
    return CheckpointSettings(options, train_iters, tmp_path / "tok", args, resolved)


def checkpointer(
    s: CheckpointSettings,
    corpus: tuple[Connection, tuple[int, ...]],
    fingerprint: dict[str, Any] = FINGERPRINT,
    world: int = 1,
    model: dict[str, Any] | None = MODEL,
) -> Checkpointer:
    conn, marks = corpus
    store = DirectoryStore(s.ckpt.ckpt_dir, CHECKPOINTS)
    publisher = Publisher(store, s.ckpt.keep_last, rank=0, world=1, wait_s=10)
    publisher.fetch(None)
    return Checkpointer(s, conn, fingerprint=fingerprint, world=world, marks=marks, model=model,
                        publisher=publisher)  # fmt: skip


def data_state(corpus: tuple[Connection, tuple[int, ...]], world: int = 1) -> dict[str, Any]:
    """What a feed would keep of the data at the start of a run on ``world`` ranks."""
    conn, marks = corpus
    return {
        "table": ChunkTable.initial(["a"], marks, 10).to_dict(),
        "streams": [[0]],
        "prefix": prefix_record(conn, marks, SEED),
        "growth": [],
        "launches": [],
        "skipped_micro": [],
        "ranks": [ReadState.start(1).to_dict() for _ in range(world)],
    }


def save(ck: Checkpointer, corpus: Any, step: int, engine: FakeEngine | None = None, world: int = 1) -> str:
    state = TrainState(step=step, tokens=64 * step, micro=2 * step)
    tag = ck.save(
        engine or FakeEngine(), state, lambda: data_state(corpus, world), FakeConfig(), make_config()
    )
    ck.settle()  # whole before the test looks
    return tag


def test_a_fresh_directory_starts_afresh_and_the_latest_checkpoint_is_resumed(tmp_path: Path, corpus) -> None:
    ck = checkpointer(settings(tmp_path), corpus)
    assert ck.find() is None
    assert save(ck, corpus, 2) == "global_step2"
    assert save(ck, corpus, 4) == "global_step4"
    found = ck.find()
    assert found is not None
    load_dir, tag, data = found
    assert (load_dir, tag) == (tmp_path / "ckpt", "global_step4")
    assert data == data_state(corpus)
    # --ckpt_id names an older one (and makes --ckpt_dir the directory to load from).
    older = checkpointer(settings(tmp_path, ckpt_id="global_step2"), corpus).find()
    assert older is not None and older[1] == "global_step2"


def test_no_resume_refuses_a_directory_that_holds_checkpoints(tmp_path: Path, corpus) -> None:
    save(checkpointer(settings(tmp_path), corpus), corpus, 2)
    with pytest.raises(CheckpointError, match=r"--no_resume: .* holds checkpoints already; a fresh run"):
        checkpointer(settings(tmp_path, no_resume=True), corpus).find()


def test_a_load_dir_without_checkpoints_is_refused_with_the_trainers_advice(tmp_path: Path, corpus) -> None:
    (tmp_path / "empty").mkdir()
    ck = checkpointer(settings(tmp_path, load_dir=tmp_path / "empty"), corpus)
    with pytest.raises(
        CheckpointError, match=r"no checkpoint to resume from .*pass the directory a run saved"
    ):
        ck.find()


def test_a_checkpoint_of_other_data_is_refused_unless_told_to_ignore_it(
    tmp_path: Path, corpus, warnings
) -> None:
    save(checkpointer(settings(tmp_path), corpus), corpus, 2)
    other = {**FINGERPRINT, "tokenizer": "t-two"}
    with pytest.raises(CheckpointError, match=r"saved for other data \(tokenizer changed\)"):
        checkpointer(settings(tmp_path), corpus, fingerprint=other).find()
    found = checkpointer(settings(tmp_path, ignore_fingerprint=True), corpus, fingerprint=other).find()
    assert found is not None and found[1] == "global_step2"
    assert "resuming although tokenizer changed (--ignore_fingerprint)" in warnings()


def test_a_checkpoint_read_in_another_order_names_the_flag_that_resumes_it(tmp_path: Path, corpus) -> None:
    save(checkpointer(settings(tmp_path), corpus), corpus, 2)
    ranges = {**FINGERPRINT, "layout": LAYOUTS["ranges"]}
    # Never resumed in another order, whatever --ignore_fingerprint says.
    ck = checkpointer(settings(tmp_path, ignore_fingerprint=True), corpus, fingerprint=ranges)
    with pytest.raises(
        CheckpointError, match="reads in the spread order; resume it with --read_order spread"
    ):
        ck.find()


def test_a_checkpoint_of_another_model_is_refused_naming_both_shapes_and_its_flags(
    tmp_path: Path, corpus
) -> None:
    save(checkpointer(settings(tmp_path), corpus), corpus, 2)
    deeper = {**MODEL, "n_layer": 4}
    ck = checkpointer(settings(tmp_path, ignore_fingerprint=True), corpus, model=deeper)
    with pytest.raises(CheckpointError, match=r"another model than this run builds \(layers 2 there, 4 here\)"
                       r": resume it with --model_select tiny"):  # fmt: skip
        ck.find()
    # No model to compare (None): not checked.
    assert checkpointer(settings(tmp_path), corpus, model=None).find() is not None


def test_a_corpus_that_lost_trained_documents_refuses_the_resume(tmp_path: Path, corpus, warnings) -> None:
    save(checkpointer(settings(tmp_path), corpus), corpus, 2)
    conn = corpus[0]
    conn.db["a"].update_one({"idx": 0}, {"$set": {"filt_text": "an edited first document"}})
    with pytest.raises(CheckpointError, match="trained on documents that are no longer there as they were: "
                       "a: documents below idx 40"):  # fmt: skip
        checkpointer(settings(tmp_path), corpus).find()
    assert checkpointer(settings(tmp_path, ignore_fingerprint=True), corpus).find() is not None
    assert any("documents below idx 40" in w and "--ignore_fingerprint" in w for w in warnings())
    shrunk = (conn, (30,))
    with pytest.raises(CheckpointError, match="a holds 30 documents, fewer than the 40 trained on"):
        checkpointer(settings(tmp_path), shrunk).find()


def test_another_number_of_ranks_resumes_unless_the_optimizer_state_is_zero_3s(
    tmp_path: Path, corpus, warnings
) -> None:
    ck = checkpointer(settings(tmp_path), corpus)
    save(ck, corpus, 2)
    found = checkpointer(settings(tmp_path), corpus, world=2).find()
    assert found is not None and len(found[2]["ranks"]) == 1
    assert any("saved by 1 rank(s); this run has 2" in w for w in warnings())
    save(ck, corpus, 4, FakeEngine(partitioned=True))
    with pytest.raises(CheckpointError, match=r"saved by 1 rank\(s\) under ZeRO stage 3, whose partitioned"):
        checkpointer(settings(tmp_path), corpus, world=2).find()
    assert checkpointer(settings(tmp_path), corpus).find() is not None  # the same ranks resume it


def test_a_save_records_the_run_prunes_old_ones_and_refuses_non_finite_weights(
    tmp_path: Path, corpus
) -> None:
    s = settings(tmp_path, keep_last=2)
    ck = checkpointer(s, corpus)
    for step in (2, 4, 6):
        save(ck, corpus, step, FakeEngine(lr=step * 1e-4))
    ckpt_dir = tmp_path / "ckpt"
    assert complete_tags(ckpt_dir) == ["global_step4", "global_step6"]
    assert (ckpt_dir / LATEST).read_text() == "global_step6"
    saved = read_client_state(ckpt_dir, "global_step6")
    assert (saved["step"], saved["tokens"], saved["micro"]) == (6, 384, 12)
    assert saved["lr"] == pytest.approx(6e-4)
    assert saved["args"] == s.args and saved["fingerprint"] == FINGERPRINT and saved["model_config"] == MODEL
    assert saved["vocab_dir"] == str((tmp_path / "tok").resolve())
    assert (ckpt_dir / "global_step6" / RESOLVED).read_text() == s.resolved
    with pytest.raises(TrainingAborted, match="non-finite values; refusing to save them"):
        save(ck, corpus, 8, FakeEngine(weight=math.nan))
    assert complete_tags(ckpt_dir)[-1] == "global_step6"


def test_a_restore_brings_back_the_state_weights_and_random_streams(tmp_path: Path, corpus, warnings) -> None:
    ck = checkpointer(settings(tmp_path), corpus)
    state = TrainState(step=4, tokens=256, micro=9, nonfinite=1, best=2.5, best_step=4, stale=1)
    ck.save(FakeEngine(weight=0.25), state, lambda: data_state(corpus), FakeConfig(), make_config())
    ck.settle()
    after = torch.rand(3)
    found = ck.find()
    assert found is not None
    position = ReadState.start(1).streams[0]
    assert ck.restore(FakeEngine(), None, position, None) == TrainState()  # a fresh start
    engine = FakeEngine(weight=0.0)
    # A longer --train_iters stretches the schedule: said with the rates before and after.
    longer = checkpointer(settings(tmp_path, train_iters=20), corpus)
    assert longer.restore(engine, found[:2], position, None) == state
    assert torch.equal(engine.module.weight, torch.full((2, 2), 0.25))
    assert torch.equal(torch.rand(3), after)  # the random streams go on as they were at the save
    assert any("--train_iters 20 where the checkpoint's run had 10" in w for w in warnings())


def test_a_fresh_run_refuses_a_directory_that_is_a_checkpoint_or_the_users(tmp_path: Path, corpus) -> None:
    """`--ckpt_dir run/ckpt/global_step5` saved a run inside a finished checkpoint (global_step5/
    global_step5 and a latest beside its files); `--ckpt_dir txt` saved among the user's files."""
    first = checkpointer(settings(tmp_path, train_iters=6), corpus)
    first.find()
    save(first, corpus, 2, FakeEngine(weight=0.5))
    inside = tmp_path / "ckpt" / "global_step2"
    before = sorted(p.name for p in inside.iterdir())
    with pytest.raises(CheckpointError, match=r"global_step2 is one checkpoint \(a tag of .*ckpt\), not a"):
        checkpointer(settings(tmp_path, train_iters=6, ckpt_dir=inside), corpus).find()
    assert sorted(p.name for p in inside.iterdir()) == before
    users = tmp_path / "txt"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds files that are not checkpoints \(notes.txt\)"):
        checkpointer(settings(tmp_path, train_iters=6, ckpt_dir=users), corpus).find()
    # Empty, or a run's own (a crash before its first whole checkpoint): a fresh start, as before.
    (tmp_path / "empty").mkdir()
    assert checkpointer(settings(tmp_path, train_iters=6, ckpt_dir=tmp_path / "empty"), corpus).find() is None


def test_a_folder_where_best_is_kept_is_refused_before_a_step_not_at_the_save(tmp_path: Path, corpus) -> None:
    """The run resumed, trained, then failed with a traceback when it marked its best checkpoint over the
    folder."""
    ck = checkpointer(settings(tmp_path), corpus)
    save(ck, corpus, 2)
    (tmp_path / "ckpt" / "best").mkdir()
    with pytest.raises(CheckpointError, match=r"ckpt/best: a directory, not a file; .*move it away"):
        checkpointer(settings(tmp_path), corpus).find()
    with pytest.raises(CheckpointError, match=r"marking .*global_step2 best failed: .*Is a directory"):
        ck.mark_best("global_step2")
