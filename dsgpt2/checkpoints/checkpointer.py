"""The run's checkpoints: which one to resume from, verified against this run's data and ranks
before any model is built; restoring it into the engine; saving (into the run's store:
:mod:`dsgpt2.checkpoints.publisher`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import torch

from dsgpt2.checkpoints import ds_checkpoint, universal
from dsgpt2.checkpoints.copies import resumable_tag
from dsgpt2.checkpoints.format import (
    BEST,
    UNIVERSAL,
    CheckpointError,
    has_checkpoints,
    is_partitioned,
    not_a_run_directory,
    peek_tag,
    pointer_problem,
    read_client_state,
    resolve,
)
from dsgpt2.checkpoints.options import RESOLVED, CheckpointOptions
from dsgpt2.checkpoints.publisher import Publisher
from dsgpt2.data.dealing import Position
from dsgpt2.data.sources import order_of
from dsgpt2.data.table import ChunkTable
from dsgpt2.db.client import Connection
from dsgpt2.errors import TrainingAborted
from dsgpt2.stores.base import Store, where

log = logging.getLogger(__name__)


# The settings that give a GPT-2 its shape, as a user calls them.
MODEL_SHAPE = {"n_layer": "layers", "n_embd": "width", "n_head": "heads", "n_inner": "inner width",
               "n_positions": "context", "vocab_size": "vocabulary size"}  # fmt: skip


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    micro: int = 0  # micro-batches drawn, skipped ones included
    nonfinite: int = 0
    # --early_stopping: the best value of --monitor, its step, evaluations since it without improvement.
    best: float | None = None
    best_step: int = 0
    stale: int = 0
    # --ema_tail: the weights' tail average (dsgpt2.train.average), once it has begun.
    average: dict[str, Any] | None = None


@dataclass(frozen=True)
class CheckpointSettings:
    """What the checkpointer is told of the run: its checkpoint options, and what every checkpoint
    records of the run's configuration."""

    ckpt: CheckpointOptions
    # --train_iters: a resume with another number warns that the learning-rate schedule changed span.
    train_iters: int
    vocab_dir: Path  # the run's tokenizer
    args: dict[str, Any]  # every option by flag name (TrainConfig.to_dict())
    resolved: str  # the resolved configuration, saved beside each checkpoint (config.yaml)
    vocab_stored: str | None = None  # the tokenizer's gridfs:NAME, where vocab_dir is this node's copy
    # The DeepSpeed config's ZeRO stage: a checkpoint saved under another is refused (None: not checked).
    zero_stage: int | None = None


def resumed_options(c: CheckpointOptions, store: Store) -> dict[str, Any] | None:
    """The options the checkpoint this run resumes was trained with (``--flag`` names), read before it is
    verified: :meth:`Checkpointer.find` verifies it, and refuses what cannot be resumed. None: a fresh
    start, or no checkpoint whose options read. ``store``: where ``--ckpt_dir`` is; one with copies is
    read before anything is brought here (the resolved configuration saved beside the checkpoint)."""
    if store.staged:
        if c.no_resume:
            return None
        import yaml

        tag = resumable_tag(store, c.ckpt_id)
        try:
            values = yaml.safe_load((store.read(f"{tag}/{RESOLVED}") if tag else None) or "")
        except yaml.YAMLError:
            return None  # the resume names the problem in one line
        return values if isinstance(values, dict) else None
    load_dir = c.load_dir
    if load_dir is None and has_checkpoints(store.local) and not c.no_resume:
        load_dir = store.local
    tag = None if load_dir is None else peek_tag(load_dir, c.ckpt_id)
    if load_dir is None or tag is None:
        return None
    try:
        return dict(read_client_state(load_dir, tag).get("args") or {})
    except Exception:  # a damaged checkpoint: find() names the problem in one line
        return None


@dataclass(eq=False)
class Checkpointer:
    """Finds, verifies, restores and saves the checkpoints of one run.

    Args:
        settings: the checkpoint options (they decide) and what a checkpoint records of the run.
        conn: the corpus connection (a resumed run's trained prefix is checked against it).
        fingerprint: this run's data fingerprint; a checkpoint of other data is refused.
        world: this run's number of ranks.
        marks: the corpus's high-water marks at the start of this run.
        model: the model config this run builds (``GPT2Config.to_dict()``); a checkpoint of another
            shape is refused. None: not checked.
        publisher: what saves the run's checkpoints into its store (``--ckpt_dir``'s), whose ``local``
            directory DeepSpeed writes and a resume reads.
    """

    settings: CheckpointSettings
    conn: Any
    _: KW_ONLY
    fingerprint: dict[str, Any]
    world: int
    marks: tuple[int, ...]
    model: dict[str, Any] | None = None
    publisher: Publisher | None = None

    @property
    def store(self) -> Store:
        assert self.publisher is not None, "a Checkpointer that saves or resumes has its publisher"
        return self.publisher.store

    def _load_dir(self) -> Path | None:
        """Where the run resumes from: ``--load_dir`` (a directory, or the store itself where it names
        ``--ckpt_dir``'s location), else the store where it holds checkpoints."""
        c = self.settings.ckpt
        if c.load_dir is not None:
            return self.store.local if self.store.staged or c.load_dir == c.ckpt_dir else c.load_dir
        return None

    def find(self) -> tuple[Path, str, dict[str, Any]] | None:
        """The checkpoint to resume from, verified, and its data state; None for a fresh start.

        Raises:
            CheckpointError: none where one was asked for, a broken one, one of other data or of
                another number of ranks, or a fresh start that would overwrite checkpoints.
        """
        c = self.settings.ckpt
        # Refused before a step is trained: the run could not mark its best checkpoint over it.
        odd = None if self.store.staged else pointer_problem(self.store.local, BEST)
        if odd is not None:
            raise CheckpointError(odd)
        load_dir = self._load_dir()
        if load_dir is None and has_checkpoints(self.store.local):
            if c.no_resume:
                raise CheckpointError(
                    f"--no_resume: {self.store.location} holds checkpoints already; a fresh run there would "
                    "overwrite them. Choose another --ckpt_dir (or remove them), or leave out --no_resume"
                )
            load_dir = self.store.local
        if load_dir is None:
            foreign = None if self.store.staged else not_a_run_directory(self.store.local)
            if foreign is not None:
                raise CheckpointError(foreign)
            return None
        # Where nothing usable is there, only the trainer can start afresh instead: its advice.
        fresh = "start fresh with another --ckpt_dir"
        if c.load_dir is not None:
            fresh = (
                "pass the directory a run saved to with --load_dir, name one with --ckpt_id, or start "
                "fresh without --load_dir"
            )
        tag = resolve(load_dir, c.ckpt_id, f"; {fresh}")
        saved = read_client_state(load_dir, tag)
        # A stored checkpoint is named by its location, not by this node's copy of it.
        named = Path(self.where(tag)) if load_dir == self.store.local else load_dir / tag
        # First, and whatever --ignore_fingerprint says: weights of another shape cannot be loaded.
        self._check_model(saved, named)
        self._check_optimizer(saved, named)
        _check_init(saved.get("args") or {}, self.settings.args, named)
        self._check_fingerprint(saved["fingerprint"], named)
        self._check_data(saved, named)
        self._check_zero_stage(load_dir, tag, named)
        ranks = len(saved["data"]["ranks"])
        if ranks == self.world:
            return load_dir, tag, saved["data"]
        log.warning(
            "%s was saved by %d rank(s); this run has %d: what the epoch has not read is dealt anew "
            "(the global batch is now %d ranks' worth)", named, ranks, self.world, self.world,
        )  # fmt: skip
        if is_partitioned(load_dir, tag):
            stage = universal.saved_zero_stage(load_dir, tag)
            if stage not in (1, 2):
                raise CheckpointError(
                    f"{named} was saved by {ranks} rank(s) under ZeRO stage {stage}, whose "
                    f"partitioned state this version carries to another number of ranks only from ZeRO 1 "
                    f"or 2: resume it with {ranks} rank(s)"
                )
            # The optimizer state is cut per rank: loaded from its universal form, made once.
            tag = universal.ensure_universal(load_dir, tag)
        return load_dir, tag, saved["data"]

    def _check_zero_stage(self, load_dir: Path, tag: str, where: Path) -> None:
        """Refuse a checkpoint saved under another ZeRO stage: its optimizer state is laid out for that one
        (ZeRO 0 in the model's file, 1 and 2 in per-rank shards of flat groups, 3 partitioned further)."""
        ours = self.settings.zero_stage
        if ours is None or tag.endswith(UNIVERSAL):  # a universal form: DeepSpeed's loader judges it
            return
        theirs = universal.saved_zero_stage(load_dir, tag) if is_partitioned(load_dir, tag) else 0
        # Shards that do not say their stage (DeepSpeed's bf16 optimizer writes none): not judged here.
        if theirs == ours or (theirs == 0 and is_partitioned(load_dir, tag)):
            return
        ds = self.settings.args.get("deepspeed_config")
        raise CheckpointError(
            f"{where} was saved under ZeRO stage {theirs}, and this run's DeepSpeed config ({ds}) has stage "
            f"{ours}: its optimizer state is laid out for stage {theirs}; resume it with a config of stage "
            f"{theirs}, or start this one in another --ckpt_dir (--init_from {where} takes its weights)"
        )

    def _check_model(self, saved: dict[str, Any], where: Path) -> None:
        """Refuse a checkpoint of another model shape: each setting that differs with both values, and
        the flags the checkpoint was trained with."""
        theirs = saved.get("model_config")
        if self.model is None or not theirs:
            return
        differ = {
            k: (theirs.get(k), self.model.get(k)) for k in MODEL_SHAPE if theirs.get(k) != self.model.get(k)
        }
        if not differ:
            return
        values = "; ".join(f"{MODEL_SHAPE[k]} {a} there, {b} here" for k, (a, b) in differ.items())
        flags = _model_flags(saved.get("args") or {}, differ) or "the model it was trained with"
        raise CheckpointError(
            f"{where} holds another model than this run builds ({values}): resume it with {flags}, "
            "or train this model in another --ckpt_dir"
        )

    def _check_optimizer(self, saved: dict[str, Any], where: Path) -> None:
        """Refuse a checkpoint of another optimizer: its state (AdamW's moments, Muon's momentum) is not
        this run's optimizer's."""
        args = saved.get("args") or {}
        theirs = args.get("optimizer") or "adamw"  # saved before Muon: AdamW
        ours = self.settings.args.get("optimizer") or "adamw"
        if theirs != ours:
            raise CheckpointError(
                f"{where} was trained with --optimizer {theirs} and this run asks for --optimizer {ours}: "
                f"resume it with --optimizer {theirs} (or without --optimizer), or train with {ours} in "
                f"another --ckpt_dir (--init_from the exported model starts {ours} from its weights)"
            )
        from dsgpt2.optim.optimizers import OPTIMIZERS

        refusal = OPTIMIZERS[ours].resume_refusal(args, self.settings.args) if ours in OPTIMIZERS else None
        if refusal:
            raise CheckpointError(f"{where} {refusal}")

    def _check_data(self, saved: dict[str, Any], where: Path) -> None:
        problems = check_saved_data(self.conn, saved, self.marks, where)
        if not problems:
            return
        if not self.settings.ckpt.ignore_fingerprint:
            raise CheckpointError(
                f"{where} trained on documents that are no longer there as they were: {'; '.join(problems)}. "
                "Restore them, start fresh (--no_resume, another --ckpt_dir) or pass --ignore_fingerprint"
            )
        log.warning("resuming although %s (--ignore_fingerprint)", "; ".join(problems))

    def _check_fingerprint(self, saved: dict[str, Any], where: Path) -> None:
        if saved == self.fingerprint:
            return
        changed = sorted(k for k in {*self.fingerprint, *saved} if saved.get(k) != self.fingerprint.get(k))
        if changed == ["layout"]:
            # Only the reading order differs: the run goes on in its own order, never another one.
            theirs = order_of(saved)
            raise CheckpointError(
                f"{where} was saved by a run that reads "
                + (f"in the {theirs} order; resume it with --read_order {theirs}" if theirs else
                   f"its chunks under layout {saved.get('layout')}, which this version does not read")
                + " (or start fresh: --no_resume, another --ckpt_dir)"
            )  # fmt: skip
        if not self.settings.ckpt.ignore_fingerprint:
            raise CheckpointError(
                f"{where} was saved for other data ({', '.join(changed)} changed); "
                "resuming would not continue the same run. Start fresh (--no_resume, another "
                "--ckpt_dir) or pass --ignore_fingerprint to resume anyway"
            )
        log.warning("resuming although %s changed (--ignore_fingerprint)", ", ".join(changed))

    def restore(
        self, engine: Any, where: tuple[Path, str] | None, position: Position, lr_schedule: Any
    ) -> TrainState:
        """Load ``where`` (what :meth:`find` chose) into ``engine`` and the RNGs; the state to go on
        from (a fresh one without a checkpoint). ``position``: where the data resumes, for the log."""
        if where is None:
            return TrainState()
        load_dir, tag = where
        saved = ds_checkpoint.load(engine, load_dir, tag)["dsgpt2"]
        ds_checkpoint.set_rng_state(saved["rng"])
        early = saved.get("early") or {}
        state = TrainState(saved["step"], saved["tokens"], saved["micro"], saved["nonfinite"],
                           early.get("best"), early.get("best_step", 0), early.get("stale", 0),
                           saved.get("average"))  # fmt: skip
        named = (
            self.where(tag) if self.publisher is not None and load_dir == self.store.local else load_dir / tag
        )
        log.info("resumed from %s at step %d (%s)", named, state.step, position.describe())
        self._warn_schedule_change(engine, lr_schedule, saved, state.step)
        return state

    def _warn_schedule_change(self, engine: Any, lr_schedule: Any, saved: dict[str, Any], step: int) -> None:
        """Another --train_iters than the checkpoint's stretches or shrinks the learning-rate decay."""
        then = getattr(engine.lr_scheduler, "resumed_from", None)
        if then and lr_schedule is not None and then.get("kind") != lr_schedule.kind:
            log.warning("the checkpoint's run followed a %s schedule; this one follows %s from step %d",
                        then.get("kind"), lr_schedule.kind, step)  # fmt: skip
        train_iters = self.settings.train_iters
        before = int(saved.get("args", {}).get("train_iters") or train_iters)
        if before == train_iters or step >= train_iters:
            return
        lr_now = engine.get_lr()[0]
        lr_then = saved.get("lr")
        was = f"{lr_then:.3g}" if isinstance(lr_then, float) else "unknown"
        log.warning(
            "--train_iters %d where the checkpoint's run had %d: the learning-rate schedule now spans "
            "%d steps, so the learning rate at step %d is %.3g (it was %s)",
            train_iters, before, train_iters, step, lr_now, was,
        )  # fmt: skip

    def save(
        self,
        engine: Any,
        state: TrainState,
        data: Callable[[], dict[str, Any]],
        model_config: Any,
        mongo: Any,
    ) -> str:
        """Save ``engine`` at ``state.step`` with everything a resume needs (``data()``: the feed's
        position, a collective taken once the weights are known to be finite); refused for
        non-finite weights."""
        for p in engine.module.parameters():
            if not torch.isfinite(p).all():
                raise TrainingAborted("the weights hold non-finite values; refusing to save them")
        s = self.settings
        client_state = {
            "dsgpt2": {
                "step": state.step,
                "tokens": state.tokens,
                "micro": state.micro,
                "nonfinite": state.nonfinite,
                "early": {"best": state.best, "best_step": state.best_step, "stale": state.stale},
                "lr": engine.get_lr()[0],
                "data": data(),
                "rng": ds_checkpoint.rng_state(),
                "fingerprint": self.fingerprint,
                "model_config": model_config.to_dict(),
                "vocab_dir": s.vocab_stored or str(s.vocab_dir.resolve()),
                **({"vocab_copy": str(s.vocab_dir.resolve())} if s.vocab_stored else {}),
                "args": dict(s.args),
                "mongo": mongo.to_dict(),
                **({"average": state.average} if state.average is not None else {}),
            }
        }
        assert self.publisher is not None
        return self.publisher.save(engine, state.step, client_state, {RESOLVED: s.resolved})

    def settle(self) -> None:
        """Wait until the last save is whole where the checkpoints go (every rank)."""
        if self.publisher is not None:
            self.publisher.settle()

    def where(self, tag: str) -> str:
        """Where checkpoint ``tag`` is, as a user names it."""
        return where(self.store, tag)

    def last_whole(self) -> str | None:
        """The run's last whole checkpoint, as a user names it; None before the first."""
        from dsgpt2.checkpoints.format import by_saving

        tags = by_saving(self.store.local)
        return self.where(tags[-1]) if tags else None

    def mark_best(self, tag: str) -> None:
        """Name ``tag`` (saved) the run's best checkpoint."""
        assert self.publisher is not None
        self.publisher.mark_best(tag)


def check_saved_data(
    conn: Connection, saved: dict[str, Any], marks: tuple[int, ...], where: Path
) -> list[str]:
    """Why the corpus no longer continues the checkpoint's run: its format, a shrunken or edited
    trained prefix. Empty: it does (rank 0; reads a few documents).

    Raises:
        CheckpointError: a checkpoint without a data state (an older layout).
    """
    from dsgpt2.corpus.marks import prefix_problems

    data = saved.get("data")
    if not isinstance(data, dict) or "table" not in data:
        raise CheckpointError(
            f"{where} holds no data state this version reads (an older layout); start fresh with another "
            "--ckpt_dir, or --no_resume"
        )
    problems = prefix_problems(conn, data.get("prefix") or {}, marks)
    table_marks = ChunkTable.from_dict(data["table"]).marks
    for name, mark, now in zip(conn.config.collections, table_marks, marks, strict=True):
        if now < mark and not any(p.startswith(name) for p in problems):
            problems.append(f"{name} holds {now} documents, fewer than the {mark} trained on")
    return problems


def _check_init(theirs: dict[str, Any], ours: dict[str, Any], where: Path) -> None:
    """A resume continues the checkpoint's weights: an --init_from other than the one the run
    started from would be ignored, and is refused (the same one, the command typed again, is not)."""
    asked, started = ours.get("init_from"), theirs.get("init_from")
    if not asked or (started and os.path.realpath(str(asked)) == os.path.realpath(str(started))):
        return
    if started and not os.path.isabs(str(started)):
        # Recorded as typed, relative to where the run started, which may not be here: said, not refused.
        log.warning(
            "--init_from %s: %s started from --init_from %s (from the directory it ran in); the resume "
            "continues its weights and reads no --init_from", asked, where, started,
        )  # fmt: skip
        return
    origin = f"--init_from {started}" if started else "its own initialisation"
    raise CheckpointError(
        f"--init_from {asked}: this run resumes {where}, which started from {origin}, and continues its "
        f"weights; leave --init_from out to resume it, or give another --ckpt_dir (and no --load_dir) to "
        f"start a new run from {asked}"
    )


def _model_flags(args: dict[str, Any], differ: dict[str, tuple[Any, Any]]) -> str:
    """The flags (from a checkpoint's ``args``) that build its model again, for the settings that differ."""
    flags = []
    if differ.keys() & {"n_layer", "n_embd", "n_head", "n_inner"}:
        for flag in ("init_from", "model_config", "model_select"):
            if args.get(flag):
                flags.append(f"--{flag} {args[flag]}")
                break
    if "n_positions" in differ and not args.get("init_from"):
        context = args.get("context_length") or differ["n_positions"][0]
        flags.append(f"--context_length {context}")
    if "vocab_size" in differ and args.get("vocab_dir"):
        flags.append(f"--vocab_dir {args['vocab_dir']}")
    return " ".join(flags)
