from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsgpt2 import checkpoint
from dsgpt2.checkpoint import CheckpointError, resolve


class FakeEngine:
    """Writes what DeepSpeed writes for a tag; can die half-way like a killed process."""

    global_rank = 0

    def __init__(self, die: bool = False) -> None:
        self.die = die

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
        assert save_latest is False  # dsgpt2 moves `latest` itself, after the save is complete
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "mp_rank_00_model_states.pt").write_bytes(b"partial" if self.die else b"full")
        if self.die:
            raise KeyboardInterrupt("killed during the save")


def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    checkpoint.save(FakeEngine(), tmp_path, 10, {}, keep_last=3)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(FakeEngine(die=True), tmp_path, 20, {}, keep_last=3)
    assert (tmp_path / "latest").read_text() == "global_step10"
    assert resolve(tmp_path, None) == "global_step10"
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve(tmp_path, "global_step20")


def test_keep_last_prunes_only_older_complete_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        checkpoint.save(FakeEngine(), tmp_path, step, {}, keep_last=2)
    (tmp_path / "global_step9").mkdir()  # an incomplete one is not counted nor removed
    checkpoint.save(FakeEngine(), tmp_path, 5, {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "global_step4",
        "global_step5",
        "global_step9",
    ]
    assert json.loads((tmp_path / "global_step5" / checkpoint.COMPLETE).read_text())["step"] == 5


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no `latest` file"):
        resolve(tmp_path, None)
    (tmp_path / "latest").write_text("\x00\x00garbage")
    with pytest.raises(CheckpointError, match="empty or corrupt"):
        resolve(tmp_path, None)
    (tmp_path / "latest").write_text("global_step7")
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        resolve(tmp_path, None)
    checkpoint.save(FakeEngine(), tmp_path, 7, {}, keep_last=0)
    assert resolve(tmp_path, None) == "global_step7"
