"""The checkpoint format on disk, read without DeepSpeed's engine: tags, the complete marker and its
checksums, ``latest``, the states file that holds dsgpt2's training state.

``ckpt_dir/TAG/`` holds DeepSpeed's files plus ``dsgpt2_complete.json``, written only after every rank
has finished saving, with the size and SHA-256 of every file; ``ckpt_dir/latest`` is then replaced
atomically (see :mod:`dsgpt2.checkpoints.publisher`). A file damaged since it was saved is found here
before anything loads it. Training, export and every inference command read checkpoints through this
module.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from dsgpt2.errors import CheckpointError, first_line
from dsgpt2.files import file_digests as digests
from dsgpt2.files import not_a_file, read_regular
from dsgpt2.stores.base import Artifact

log = logging.getLogger(__name__)

LATEST = "latest"
BEST = "best"  # names the best checkpoint of an --early_stopping run; `--ckpt_id best` reads it
COMPLETE = "dsgpt2_complete.json"
# What a store keeps of a run (dsgpt2.stores): its tags whole once this marker, with their step, is there.
CHECKPOINTS = Artifact("checkpoints", COMPLETE, "step", "gridfs:gpt2-small/run1")
_TAG = re.compile(r"^[A-Za-z0-9_.\-]+$")
UNIVERSAL = ".universal"  # suffix of a checkpoint's universal form, beside it (dsgpt2.checkpoints.universal)


def tag_for(step: int) -> str:
    return f"global_step{step}"


def read_marker(ckpt_dir: Path, tag: str) -> dict[str, Any] | None:
    """The complete marker of ``tag``, or None when it is absent or unreadable (not complete)."""
    try:
        marker = json.loads(read_regular(ckpt_dir / tag / COMPLETE))  # a named pipe is not waited on
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
        return None
    files = marker.get("files")
    if files is not None and not _listing(files):
        return None  # a marker edited or damaged by hand: its checkpoint cannot be checked
    return marker


def _listing(files: Any) -> bool:
    """A marker's ``files``: {relative path: {"size": int, "sha256": str}}."""
    return isinstance(files, dict) and all(
        isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("sha256"), str)
        for f in files.values()
    )


def is_complete(ckpt_dir: Path, tag: str) -> bool:
    return read_marker(ckpt_dir, tag) is not None


def complete_tags(ckpt_dir: Path) -> list[str]:
    """The complete checkpoints in ``ckpt_dir``, oldest step first."""
    if not ckpt_dir.is_dir():
        return []
    steps = {}
    for p in ckpt_dir.iterdir():
        # A checkpoint's universal form is derived from it, not a checkpoint of the run's own.
        ours = p.is_dir() and _TAG.match(p.name) and not p.name.endswith(UNIVERSAL)
        marker = read_marker(ckpt_dir, p.name) if ours else None
        if marker is not None:
            steps[p.name] = marker["step"]
    return sorted(steps, key=lambda t: steps[t])


_SEAL = "marker_sha256"  # a marker's digest of the rest of itself: a damaged marker is told from its files


def sealed(marker: dict[str, Any]) -> dict[str, Any]:
    """``marker`` with the SHA-256 of the rest of it, which :func:`damage` checks before its listing."""
    return {**{k: v for k, v in marker.items() if k != _SEAL}, _SEAL: _seal_of(marker)}


def _seal_of(marker: dict[str, Any]) -> str:
    import hashlib

    rest = {k: v for k, v in marker.items() if k != _SEAL}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def file_digests(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file of a checkpoint directory (the marker excepted), by relative path."""
    return digests(directory, skip=COMPLETE)


def damage(ckpt_dir: Path, tag: str) -> str | None:
    """What is wrong with the files of a complete checkpoint (checked against its marker), or None."""
    marker = read_marker(ckpt_dir, tag)
    if marker is None:
        return f"{ckpt_dir / tag} is missing or incomplete"
    if _SEAL in marker and marker[_SEAL] != _seal_of(marker):  # markers written before the seal have none
        return (
            f"{ckpt_dir / tag / COMPLETE} is damaged (its SHA-256 differs from the one saved in it), so the "
            "checkpoint's files cannot be checked against it"
        )
    for name, want in (marker.get("files") or {}).items():
        path = ckpt_dir / tag / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["size"]:
            return f"{path} is truncated or grown ({path.stat().st_size} bytes, {want['size']} when saved)"
    digests = file_digests(ckpt_dir / tag)
    for name, want in (marker.get("files") or {}).items():
        if digests[name]["sha256"] != want["sha256"]:
            return f"{ckpt_dir / tag / name} is damaged (its SHA-256 differs from the one saved)"
    return None


def saved_at(marker: dict[str, Any]) -> tuple[float, int]:
    """A checkpoint's place in the order it was saved in, from its marker: the step only orders what a
    run saved in one line; past a rewind (a resume from an earlier checkpoint) a later step may be older."""
    when = marker.get("time")
    step = marker.get("step")
    return (float(when) if isinstance(when, (int, float)) else 0.0, step if isinstance(step, int) else -1)


def by_saving(ckpt_dir: Path) -> list[str]:
    """The complete checkpoints in ``ckpt_dir`` in the order they were saved, the newest last."""
    markers = {tag: read_marker(ckpt_dir, tag) or {} for tag in complete_tags(ckpt_dir)}
    return sorted(markers, key=lambda t: saved_at(markers[t]))


def newest_intact(ckpt_dir: Path, exclude: str | None = None) -> str | None:
    """The newest complete checkpoint (the last saved) whose files match their marker."""
    for tag in reversed(by_saving(ckpt_dir)):
        if tag != exclude and damage(ckpt_dir, tag) is None:
            return tag
    return None


def _broken(problem: str, ckpt_dir: Path, bad: str | None = None, fresh: str = "") -> CheckpointError:
    """The error for a checkpoint that cannot be used, naming the newest intact one instead (every
    reader has --ckpt_id); ``fresh``: how to start afresh where none is left (only the trainer can)."""
    tag = newest_intact(ckpt_dir, exclude=bad)
    if tag is None:
        return CheckpointError(f"{problem}; no intact checkpoint is left there{fresh}")
    return CheckpointError(f"{problem}; the newest intact checkpoint is {tag}: use it with --ckpt_id {tag}")


def has_checkpoints(ckpt_dir: Path) -> bool:
    """Whether ``ckpt_dir`` holds a ``latest`` file or any complete checkpoint."""
    return (ckpt_dir / LATEST).exists() or bool(complete_tags(ckpt_dir))


def not_a_run_directory(ckpt_dir: Path) -> str | None:
    """Why a new run may not save its checkpoints into ``ckpt_dir`` (one that holds no checkpoint): it is
    one checkpoint (a tag's directory), or it holds files no run wrote (a folder of the user's); None when
    it is absent, empty or holds only what a run writes (tags, pointers, DeepSpeed's zero_to_fp32.py)."""
    if not ckpt_dir.is_dir():
        return None
    names = os.listdir(ckpt_dir)
    if COMPLETE in names or any(n.endswith("_model_states.pt") for n in names):
        return (
            f"--ckpt_dir {ckpt_dir} is one checkpoint (a tag of {ckpt_dir.parent}), not a run's directory of "
            f"them: give {ckpt_dir.parent} to resume that run, or a new directory for a new one"
        )
    ours = (LATEST, BEST, "zero_to_fp32.py")
    theirs = sorted(n for n in names if n not in ours and not n.startswith(("global_step", ".")))
    if theirs:
        shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
        return (
            f"--ckpt_dir {ckpt_dir} holds files that are not checkpoints ({shown}): a run would save among "
            "them; give an empty or new directory"
        )
    return None


def peek_tag(load_dir: Path, ckpt_id: str | None) -> str | None:
    """The tag :func:`resolve` picks where the checkpoints are sound, found without reading checksums or
    warning: for reading a checkpoint's options before it is verified. None: no complete checkpoint."""
    if ckpt_id == BEST:
        return best_tag(load_dir)
    if ckpt_id:
        return ckpt_id
    try:
        tag = read_regular(load_dir / LATEST).decode().strip()
    except (OSError, UnicodeDecodeError):
        tag = ""
    if _TAG.match(tag) and is_complete(load_dir, tag):
        return tag
    tags = by_saving(load_dir)
    return tags[-1] if tags else None


def resolve(load_dir: Path, ckpt_id: str | None, fresh: str = "") -> str:
    """The tag to resume from: ``ckpt_id``, or the one ``latest`` names; checked against its marker.

    Without a ``latest`` file, the newest intact checkpoint is taken (with a warning). ``fresh``: the
    trainer's advice where no usable checkpoint is there (``; start fresh with ...``); the other
    readers (export, evaluate, ...) cannot start afresh, and their flags differ, so the message then
    names only the problem and ``--ckpt_id``.

    Raises:
        CheckpointError: no checkpoint there; ``latest`` unreadable or naming a missing, incomplete
            or damaged checkpoint (the message names the newest intact one).
    """
    if ckpt_id == BEST:
        odd = pointer_problem(load_dir, BEST)
        if odd is not None:
            raise CheckpointError(f"--ckpt_id best: {odd}")
        ckpt_id = best_tag(load_dir)
        if ckpt_id is None:
            present = complete_tags(load_dir) or "none"
            raise CheckpointError(
                f"--ckpt_id best: {load_dir} has no readable `best` file (a run of `dsgpt2 train "
                f"--early_stopping` writes one); complete checkpoints there: {present}"
            )
    if ckpt_id:
        if not is_complete(load_dir, ckpt_id):
            present = complete_tags(load_dir)
            raise CheckpointError(
                f"--ckpt_id {ckpt_id!r}: no complete checkpoint {load_dir / ckpt_id}; "
                f"complete checkpoints there: {present or 'none'}"
            )
        _check_intact(load_dir, ckpt_id, fresh)
        return ckpt_id
    latest = load_dir / LATEST
    odd = pointer_problem(load_dir, LATEST)
    if odd is not None:
        raise _broken(odd, load_dir, fresh=fresh)
    if not latest.is_file():
        tag = newest_intact(load_dir)
        if tag is None:
            what = "no checkpoint to resume from" if fresh else "no checkpoint"
            raise CheckpointError(f"{what} in {load_dir} (no `latest` file, no intact checkpoint){fresh}")
        # Read for a resume, an export or a model alike: "reading", not "resuming".
        log.warning("%s has no `latest` file; reading its newest intact checkpoint, %s", load_dir, tag)
        return tag
    tag = read_regular(latest).decode("utf-8", "replace").strip()
    if not tag or not _TAG.match(tag):
        raise _broken(f"{latest} is empty or corrupt ({tag[:40]!r})", load_dir, fresh=fresh)
    if not is_complete(load_dir, tag):
        raise _broken(
            f"{latest} names {tag!r}, which is missing or incomplete in {load_dir}", load_dir, tag, fresh
        )
    _check_intact(load_dir, tag, fresh)
    return tag


def pointer_problem(ckpt_dir: Path, name: str) -> str | None:
    """Why the pointer ``name`` (``latest``, ``best``) of ``ckpt_dir`` cannot be read or replaced: something
    other than a file is there (a directory, a named pipe); None where it is a file or absent."""
    path = ckpt_dir / name
    if not path.exists():
        return None
    why = not_a_file(path)
    if why is None:
        return None
    return f"{path}: {why}; a run keeps `{name}` there as a file naming a checkpoint: move it away"


def best_tag(ckpt_dir: Path) -> str | None:
    """The tag the ``best`` file names, or None when there is none (or it is garbled)."""
    try:
        tag = read_regular(ckpt_dir / BEST).decode("utf-8", "replace").strip()
    except OSError:
        return None
    return tag if _TAG.match(tag) else None


def _check_intact(ckpt_dir: Path, tag: str, fresh: str = "") -> None:
    problem = damage(ckpt_dir, tag)
    if problem is not None:
        raise _broken(problem, ckpt_dir, tag, fresh)


def is_partitioned(ckpt_dir: Path, tag: str) -> bool:
    """ZeRO 1-3 keep the fp32 master weights and optimizer state in per-rank shards."""
    return any((ckpt_dir / tag).glob("*zero_pp_rank_*optim_states.pt"))


def model_states_file(ckpt_dir: Path, tag: str) -> Path:
    """The file holding rank 0's module and client state (ZeRO-3 names it after the partition)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (ckpt_dir / tag / name).is_file():
            return ckpt_dir / tag / name
    raise _broken(f"{ckpt_dir / tag} holds no model states file", ckpt_dir, tag)


def load_states(ckpt_dir: Path, tag: str, mmap: bool = False) -> dict[str, Any]:
    """Rank 0's states file of a checkpoint (module weights unless partitioned, and dsgpt2's state).

    Raises:
        CheckpointError: unreadable, or not written by dsgpt2.
    """
    path = model_states_file(ckpt_dir, tag)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as exc:  # a damaged file fails in torch's zip reader or in unpickling
        raise _broken(f"{path} cannot be read ({first_line(exc)})", ckpt_dir, tag) from None
    if not isinstance(blob, dict) or "dsgpt2" not in blob:
        raise CheckpointError(f"{ckpt_dir / tag} was not written by dsgpt2 (no training state in it)")
    return blob


def read_client_state(load_dir: Path, tag: str) -> dict[str, Any]:
    """dsgpt2's training state in a checkpoint, read without building an engine.

    Lets a run check the checkpoint's fingerprint before loading weights that may not fit.
    """
    return load_states(load_dir, tag, mmap=True)["dsgpt2"]
