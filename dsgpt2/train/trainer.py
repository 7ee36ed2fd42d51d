"""The training run: parse → build (data, model, engine) → resume → loop → save.

Used by ``ds_trainer.py`` under the ``deepspeed`` launcher or as a plain process, and by the demo
with a :class:`~dsgpt2.train.config.TrainConfig` made in code. The loop is :meth:`Trainer.train`:
``train_step``, ``log_step``, ``maybe_evaluate``, ``maybe_save`` until the last step or a stop signal.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from dsgpt2.accelerator import announce_cpu_op_build, prepare_deepspeed_environment, quiet_cached_op_load
from dsgpt2.checkpoints.checkpointer import (
    Checkpointer,
    CheckpointSettings,
    TrainState,
    resumed_options,
)
from dsgpt2.checkpoints.copies import last_whole_in
from dsgpt2.checkpoints.format import CHECKPOINTS, UNIVERSAL, tag_for
from dsgpt2.checkpoints.publisher import stage
from dsgpt2.collective import (
    all_sum,
    free_port,
    gather,
    leave_process_group,
    on_rank0,
    peer_lost,
    release_shared_buffer,
    same_on_every_rank,
)
from dsgpt2.data.dealing import ReadState
from dsgpt2.data.loader import BlockStream
from dsgpt2.data.packing import IGNORE
from dsgpt2.data.ramp import BatchRamp, check_ramp
from dsgpt2.data.sources import fingerprint
from dsgpt2.db.config import MongoConfig, load_config
from dsgpt2.errors import ConfigError, DsGpt2Error, MongoUnavailableError, TrainingAborted
from dsgpt2.exits import run_command
from dsgpt2.heap import start_up
from dsgpt2.log import setup_logging
from dsgpt2.model.gpt2 import batch_inputs, perplexity, to_device
from dsgpt2.model.hellaswag import accuracies
from dsgpt2.optim.ds_config import build_ds_config, check_attention, read_ds_config, zero_stage
from dsgpt2.optim.optimizers import DEFAULT, OPTIMIZERS, check_optimizer
from dsgpt2.stores.base import open_store
from dsgpt2.tokenizer.bpe import load_tokenizer, tokenizer_digest
from dsgpt2.tokenizer.stored import fetch_tokenizer, stored_tokenizer
from dsgpt2.train.average import TailAverage, check_average
from dsgpt2.train.config import TrainConfig, parse
from dsgpt2.train.engine import (
    Engine,
    EngineSettings,
    announce_compiles,
    build_engine,
    compiles,
    init_context,
    init_weights,
    model_config_for,
    run_context,
    start_process_group,
)
from dsgpt2.train.feed import Feed, FeedSettings, corpus_marks
from dsgpt2.train.fits import check_fits, placement
from dsgpt2.train.learning import check_learns, grad_norm, no_gradient
from dsgpt2.train.microloop import MicroLoop
from dsgpt2.train.runlog import RunLog, summary_lines
from dsgpt2.train.signals import StopRequest
from dsgpt2.train.validator import Validator

log = logging.getLogger("dsgpt2.train.trainer")


def ensure_distributed_env() -> bool:
    """Set what ``torch.distributed`` needs for a single process started without a launcher; whether
    this process chose its MASTER_PORT (another may take it before the group listens: chosen again)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        return False
    os.environ["MASTER_PORT"] = str(free_port())
    return True


def _param_checksum(engine: Any) -> float:
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in engine.module.parameters()))


StepHook = Callable[[int], None]
LossHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Hooks:
    """Callbacks for experiments and fault injection; None in normal runs.

    on_loss: called with (micro-batch number, loss) before the backward pass; returns the loss to use.
    after_step: called with the step number after each optimizer step.
    """

    on_loss: LossHook | None = None
    after_step: StepHook | None = None


def build(cfg: TrainConfig, mongo: MongoConfig | None = None, hooks: Hooks = Hooks()) -> Trainer:
    """Everything a run needs, in the order it needs it: the files the configuration names, the
    process group, the corpus marks, the data feed, the checkpoint to resume (found before any model
    is built, so that one that cannot be resumed fails in seconds), the engine, and the state
    restored into it.

    Args:
        cfg: the run's configuration (its tokenizer directory filled in where it named none).
        mongo: used instead of reading --config_train (the demo passes its in-process store).
        hooks: see :class:`Hooks`.

    Raises:
        ConfigError: a file the configuration names is missing or malformed, or no connection config.
    """
    from dsgpt2.db.client import Connection

    cfg.check_files()
    ds_file = read_ds_config(cfg.engine.deepspeed_config)
    if mongo is None and cfg.data.config_train is None:
        raise ConfigError("--config_train is required: the MongoDB connection config JSON")
    mongo = mongo or load_config(cfg.data.config_train)
    conn = Connection(mongo)
    # Where the checkpoints are, chosen once from --ckpt_dir's scheme (a stored run's copy: the workspace's).
    store = open_store(cfg.ckpt.ckpt_dir, CHECKPOINTS, conn=conn, copies=cfg.run.workspace)
    saved = resumed_options(cfg.ckpt, store)
    decided = cfg.settle(saved, OPTIMIZERS[DEFAULT].unfit(ds_file), ds_file)
    cfg.freeze()  # resolved: what the run records below is what it uses
    # As given: a checkpoint or tokenizer location in the database is recorded as one, not as a node's copy.
    args, resolved = cfg.to_dict(), cfg.resolved()
    own_port = ensure_distributed_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup_logging(rank=rank)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A tokenizer in the database (gridfs:NAME): the run reads this node's copy, and records the location.
    vocab_stored = str(args["vocab_dir"]) if stored_tokenizer(cfg.data.vocab_dir) else None
    vocab_dir = fetch_tokenizer(str(cfg.data.vocab_dir), conn, cfg.run.workspace)
    vocab_size = load_tokenizer(vocab_dir).get_vocab_size()
    check_attention(cfg.compute.attn_implementation, device)
    check_optimizer(cfg.optim, ds_file)
    ds = build_ds_config(cfg.engine.deepspeed_config, world, cfg.run.train_iters, device,
                         schedule=cfg.schedule, optimizer=cfg.optim.chosen())  # fmt: skip
    check_attention(cfg.compute.attn_implementation, device, ds.config)
    decided += [*ds.notes, *batch_and_average(cfg, ds, world)]
    prepare_deepspeed_environment()

    # First: the barriers and broadcasts below need the process group.
    if rank == 0:
        announce_cpu_op_build()
    quiet_cached_op_load()
    backend = cfg.engine.distributed_backend or ("nccl" if device == "cuda" else "gloo")
    start_process_group(backend, cfg.engine.dist_timeout, own_port)
    release_shared_buffer(device)
    same_on_every_rank(
        cfg.shared(), ds.config, corpus=mongo.corpus_keys(), tokenizer=tokenizer_digest(vocab_dir)
    )
    conn.ping()
    named = cfg.ckpt.ckpt_dir  # the run's checkpoints, as the user named them
    publisher = stage(cfg.ckpt, store, rank=rank, world=world, wait_s=cfg.engine.dist_timeout)
    d = cfg.data
    marks = tuple(on_rank0(lambda: corpus_marks(mongo, conn, d.allow_corpus_problems, d.check_corpus)))
    init = init_weights(cfg.model, vocab_size, vocab_dir)
    context = run_context(cfg.model) if init is None else init_context(cfg.model, init[0])
    spec = cfg.data_spec(context, vocab_dir)
    model_config = model_config_for(cfg.model, vocab_size, spec, init)
    check_fits(model_config, context, placement(ds, device, world, cfg.compute.attn_implementation))
    feed_settings = FeedSettings(
        cfg.data, vocab_dir, cache_dir=cfg.cache_dir, ckpt_dir=named, dist_timeout=cfg.engine.dist_timeout
    )
    feed = Feed(feed_settings, mongo, conn, spec, rank=rank, world=world)
    fp = {**fingerprint(mongo, vocab_dir, spec), "mixture": bool(feed.stages)}
    model = model_config.to_dict()
    ckpt_settings = CheckpointSettings(
        cfg.ckpt, train_iters=cfg.run.train_iters, vocab_dir=vocab_dir, args=args,
        resolved=resolved, vocab_stored=vocab_stored, zero_stage=zero_stage(ds.config),
    )  # fmt: skip
    checkpointer = Checkpointer(ckpt_settings, conn, fingerprint=fp, world=world, marks=marks, model=model,
                                publisher=publisher)  # fmt: skip
    found = on_rank0(checkpointer.find)
    publisher.fetch(found)
    for line in decided:  # once the checkpoint they come from is known good
        log.info("%s", line)
    feed.start(marks, found[2] if found else None)
    engine_settings = EngineSettings(cfg.model, cfg.compute, seed=cfg.data.seed, optim=cfg.optim)
    resumed = ds.resuming(found is not None and found[1].endswith(UNIVERSAL))
    engine = build_engine(engine_settings, resumed, spec, vocab_size, init=init, device=device, world=world)
    state = checkpointer.restore(
        engine.engine, found[:2] if found else None, feed.state.streams[0], ds.schedule
    )
    run_config = {
        "args": args,
        "mongo": mongo.to_dict(),
        "deepspeed": ds.config,
        "fingerprint": fp,
        "model": engine.model_config.to_dict(),
    }
    return Trainer(cfg, mongo, feed=feed, engine=engine, checkpointer=checkpointer, state=state,
                   run_config=run_config, hooks=hooks)  # fmt: skip


class Trainer:
    """One training run, its parts built (:func:`build`): :meth:`train` runs it to its end.

    Args:
        cfg: the run's configuration.
        mongo: the corpus's connection config.
        feed: the data feed, started at the resumed position.
        engine: the model under DeepSpeed, its state restored.
        checkpointer: finds, writes and verifies the run's checkpoints.
        state: the step, tokens and counters the run resumes from.
        run_config: what the run records of itself (metrics, wandb, the checkpoint).
        hooks: see :class:`Hooks`.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        mongo: MongoConfig,
        *,
        feed: Feed,
        engine: Engine,
        checkpointer: Checkpointer,
        state: TrainState,
        run_config: dict[str, Any],
        hooks: Hooks = Hooks(),
    ) -> None:
        self.cfg, self.mongo, self.feed, self.checkpointer = cfg, mongo, feed, checkpointer
        self.state, self.hooks = state, hooks
        self.engine, self.model_config = engine.engine, engine.model_config
        self.micro_batch, self.grad_accum = engine.micro_batch, engine.grad_accum
        self.micro_loop = MicroLoop(self.engine, self.grad_accum)
        self.rank, self.world = feed.rank, feed.world
        self.ramp = BatchRamp(self.grad_accum, cfg.engine.batch_ramp).at(state.step, state.micro)
        self.average = TailAverage(self.engine.module, cfg.run.ema_tail, cfg.run.train_iters)
        feed.note_launch(state.step, state.micro, self.micro_batch, self.ramp)
        self.stream = BlockStream(
            feed.train_data, feed.schedule, self.rank, self.world, self.micro_batch, state=feed.state,
            workers=cfg.data.num_workers, stages=feed.stages, ramp=self.ramp,
        )  # fmt: skip
        eot = feed.spec.eot if cfg.compute.doc_mask else None
        self.validator = Validator(
            cfg.run, feed.val_data, vocab_dir=feed.settings.vocab_dir, rank=self.rank, world=self.world,
            micro_batch=self.micro_batch, doc_mask_eot=eot, context=feed.spec.context,
        )  # fmt: skip
        self.runlog = RunLog(
            cfg.run, run_config, resolved=cfg.resolved(), rank=self.rank, world=self.world,
            flops_per_token=engine.flops_per_token, peak_flops=engine.peak_flops,
            start=(state.step, state.tokens),
        )  # fmt: skip
        self.stop = StopRequest()
        self.started = state.step
        # ZeRO 1-3 report the gradient norm; without ZeRO the engine computes none to report.
        self._norm_by_hand = zero_stage(run_config["deepspeed"]) == 0
        self._hand_norm: torch.Tensor | float | None = None
        self._clip = engine.clip
        self._trained = [p for p in self.engine.module.parameters() if p.requires_grad]
        self.compiled = compiles(cfg.compute.compile, self.engine.device.type)
        self.last_val: float | None = None
        self.last_bpb: float | None = None
        self.last_val_tokens = 0  # the tokens the last validation predicted, every rank's
        self.last_hellaswag: dict[str, Any] = {}
        self.run_of_bad = 0
        self._step_lr = 0.0  # the rate the current step trains at
        self.batches: Iterator[Any] = iter(())  # the stream's batches, from train() on

    def train(self) -> dict[str, Any]:
        """Train until --train_iters, a stop signal or a lost database; return the summary. SIGTERM and
        SIGINT are the run's (:class:`StopRequest`) until it returns."""
        self.stop.install()
        try:
            return self._train()
        finally:
            self.stop.restore()

    def _train(self) -> dict[str, Any]:
        r, state = self.cfg.run, self.state
        self.batches = iter(self.stream)
        # The state and data position after the last whole step: what a checkpoint written when the
        # database goes away mid-accumulation must hold.
        boundary = (replace(state), self.stream.state.copy())
        with self.runlog.open():
            if self.feed.resume_growth is not None:
                # Taken in before the first step: as much the run's record as growth followed mid-run.
                record = self.feed.record_growth(state.step, *self.feed.resume_growth, "resume")
                self.runlog.write({"event": "growth", **record})
            announce_compiles(self.cfg, self.engine.device.type, state.step)
            try:
                while (
                    state.step < r.train_iters
                    and not self.stopped_early
                    and not self.stop.agreed(self.engine.device)
                ):
                    if state.step + 1 >= r.train_iters:
                        self.stop.last_step()
                    losses, ids = self.train_step(state, self.batches)
                    self.average.after_step(state)
                    boundary = (replace(state), self.stream.state.copy())
                    self.log_step(state, losses, ids)
                    self.maybe_evaluate(state)
                    if self.maybe_follow(state):
                        boundary = (replace(state), self.stream.state.copy())
                    self.maybe_save(state)
                    if self.hooks.after_step is not None:
                        self.hooks.after_step(state.step)
                self.stop.over()
            except MongoUnavailableError as exc:
                abort_on_lost_database(self, exc, *boundary)
            finally:
                self.stream.close()
        return self.finish(state)

    def train_step(self, state: TrainState, batches: Any) -> tuple[list[torch.Tensor], list[Any]]:
        """One optimizer step over its micro-batches (``grad_accum``, fewer on a ramp); non-finite ones
        skipped, with one wait on the device per step (:mod:`dsgpt2.train.microloop`).

        Returns the micro-batches' losses, still on the device (reading them waits for it:
        :meth:`log_step` does at log intervals only), and their block ids with --log_block_ids.
        """
        self.engine.train()
        self._step_lr = self.engine.get_lr()[0]
        # The norm is read at log intervals, and at a launch's first step for the check that it learns.
        norm_due = self._norm_by_hand and (
            self.runlog.should_log(state.step + 1) or state.step == self.started
        )

        def draw() -> tuple[int, Any, torch.Tensor]:
            batch = next(batches)
            state.micro += 1
            loss = self._forward(batch)
            if self.hooks.on_loss is not None:
                loss = self.hooks.on_loss(state.micro, loss)
            if not loss.requires_grad:
                raise no_gradient(state.step + 1, "its loss does not depend on the weights", self.compiled)
            return state.micro, batch, loss

        def kept() -> None:
            self.run_of_bad = 0

        def before_update() -> None:
            if self._clip:
                # One multi-tensor pass: the clip, and the norm left on the device until a log reads it.
                self._hand_norm = torch.nn.utils.clip_grad_norm_(self._trained, self._clip, foreach=True)
            elif norm_due:
                # fp16 autocast's gradients are still scaled here: its scaler unscales them in the step.
                scaler = getattr(self.engine, "torch_autocast_z0_gradscaler", None)
                scale = scaler.get_scale() if scaler is not None else 1.0
                self._hand_norm = grad_norm(self.engine.module) / scale

        micros = self.micro_loop.step(
            draw, lambda micro: self._skip_nonfinite(state, micro), kept, before_update=before_update,
            forward=self._forward, accum=self.ramp.accum(state.step),
        )  # fmt: skip
        ids: list[Any] = []
        for m in micros:
            state.tokens += m.batch.tokens * self.world
            if self.cfg.run.log_block_ids:
                ids.extend(m.batch.block_ids)
        state.step += 1
        return [m.loss for m in micros], ids

    def _forward(self, batch: Any) -> torch.Tensor:
        device = self.engine.device
        eot = self.feed.spec.eot if self.cfg.compute.doc_mask else None
        out = self.engine(**batch_inputs(batch, device, eot), labels=to_device(batch.labels, device))
        if not bool((batch.labels[:, 1:] != IGNORE).any()):
            # Context only (a conversation block without reply tokens): the mean over no tokens is
            # NaN; a zero loss keeps every rank stepping together. (The chunked loss is 0 there.)
            return out.loss * 0.0 if out.logits is None else out.logits.sum() * 0.0
        return out.loss

    def _skip_nonfinite(self, state: TrainState, micro: int) -> None:
        """Record micro-batch ``micro`` as skipped (its loss was non-finite; nothing of it was applied)."""
        state.nonfinite += 1
        self.feed.skipped_micro.append(micro)
        self.run_of_bad += 1
        checksum = _param_checksum(self.engine)
        self.runlog.write({"event": "nonfinite", "step": state.step, "micro": micro,
                     "params_before": checksum, "params_after": _param_checksum(self.engine),
                     "nonfinite_total": state.nonfinite})  # fmt: skip
        log.warning(
            "non-finite loss at micro-batch %d (step %d): skipped (%d in a row)",
            micro, state.step + 1, self.run_of_bad,
        )  # fmt: skip
        if self.run_of_bad >= self.cfg.run.max_nonfinite:
            raise TrainingAborted(
                f"{self.run_of_bad} non-finite losses in a row (--max_nonfinite "
                f"{self.cfg.run.max_nonfinite}) at step {state.step + 1}; lower the learning rate or "
                "check the data. No checkpoint was written after them"
            )

    def log_step(self, state: TrainState, device_losses: list[torch.Tensor], ids: list[Any]) -> None:
        """The progress bar, and at log intervals a ``train`` record: the only reads of the losses."""
        self.runlog.stepped(state.step, ids)
        if not self.runlog.should_log(state.step):
            if state.step == self.started + 1:
                check_learns(state.step, device_losses, self._read_grad_norm(), self.compiled)
            return
        grad_norm = self._read_grad_norm()
        check_learns(state.step, device_losses, grad_norm, self.compiled)
        # A collective: every rank takes part.
        names, device = self.mongo.collections, self.engine.device
        by_collection = collection_tokens(self.stream.state, names, device) if len(names) > 1 else None
        self.runlog.log_train(
            state.step, state.tokens, device_losses, ids, self._step_lr,
            grad_norm=grad_norm, collection_tokens=by_collection,
        )  # fmt: skip

    def _read_grad_norm(self) -> float | None:
        """The gradient norm of the step just taken: DeepSpeed's, or the one taken by hand (ZeRO 0)."""
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm, self._hand_norm = self._hand_norm, None
        return None if norm is None else float(norm)

    def maybe_evaluate(self, state: TrainState) -> None:
        if not self.validator.should_validate(state.step):
            return
        # The run's last validation measures the model it ends on: the weights' tail average, if any.
        with self.average.applied(state, state.step == self.cfg.run.train_iters) as averaged:
            measured = self.validator.validate(self.engine)
            hellaswag = self.validator.hellaswag(self.engine)
        self.last_val, self.last_bpb, self.last_val_tokens = measured or (None, None, 0)
        record: dict[str, Any] = {"event": "eval", "step": state.step}
        if self.last_val is not None:
            record.update(val_loss=self.last_val, val_ppl=perplexity(self.last_val), val_bpb=self.last_bpb,
                          val_tokens=self.last_val_tokens, eval_iters=self.cfg.run.eval_iters,
                          **({"averaged": True} if averaged else {}))  # fmt: skip
        if hellaswag is not None:
            self.last_hellaswag = hellaswag
            record.update(hellaswag)
            log.info("step %d: HellaSwag %s", state.step, accuracies(hellaswag))
        if len(record) > 2:
            self.runlog.log_eval(record)
        if self.last_val is not None and self.cfg.run.early_stopping:
            self._watch(state, self.last_val)

    def _watch(self, state: TrainState, val_loss: float) -> None:
        """--early_stopping: an improvement is saved at once and tagged best; --patience
        evaluations without one end the run."""
        r = self.cfg.run
        value = val_loss if r.monitor == "val_loss" else perplexity(val_loss)
        if state.best is None or value < state.best - r.min_delta:
            state.best, state.best_step, state.stale = value, state.step, 0
            tag = self.save(state, self.stream.state)
            if self.rank == 0:
                self.checkpointer.mark_best(tag)
            log.info("best %s so far: %.4f at step %d (checkpoint %s, tagged best)", r.monitor, value,
                     state.step, tag)  # fmt: skip
            return
        state.stale += 1
        if self.stopped_early:
            log.info(
                "early stop: %s has not improved by more than %g for %d evaluations (best %.4f at step %d)",
                r.monitor, r.min_delta, state.stale, state.best, state.best_step,
            )  # fmt: skip

    @property
    def stopped_early(self) -> bool:
        return self.cfg.run.early_stopping and self.state.stale >= self.cfg.run.patience

    def maybe_follow(self, state: TrainState) -> bool:
        """With --follow: take in the documents ingested since the last look, dealt at once.
        Returns whether any were."""
        marks = self.feed.poll(state.step)
        if marks is None or marks == self.feed.schedule.table.marks:
            return False
        states = [ReadState.from_dict(d) for d in gather(self.stream.state.to_dict())]
        before = self.feed.schedule.table.marks
        dealt = self.feed.follow(marks, states)
        if dealt is None:
            return False
        self.stream.regrow(self.feed.train_data, self.feed.schedule, dealt)
        self.batches = iter(self.stream)
        after = self.feed.schedule.table.marks
        self.runlog.write({"event": "growth", **self.feed.record_growth(state.step, before, after, "follow")})
        return True

    def maybe_save(self, state: TrainState) -> None:
        if state.step % self.cfg.ckpt.save_interval == 0 and state.step < self.cfg.run.train_iters:
            self.save(state, self.stream.state)
            self.feed.note_trained(state.step)

    def finish(self, state: TrainState) -> dict[str, Any]:
        """The final checkpoint, the end record and plot; the summary."""
        if state.step > self.started:
            self.save(state, self.stream.state)
            self.checkpointer.settle()
            self.feed.note_trained(state.step)
        else:
            # Nothing trained since the start or the resume: the checkpoint there already holds it.
            log.info("nothing trained (step %d of --train_iters %d): no checkpoint written", state.step,
                     self.cfg.run.train_iters)  # fmt: skip
        summary = _summary_of(self, state)
        if self.runlog.metrics:
            summary["plot"] = self.runlog.close(summary)
        return summary

    def save(self, state: TrainState, position: ReadState) -> str:
        data = lambda: self.feed.state_dict(position)  # noqa: E731
        return self.checkpointer.save(self.engine, state, data, self.model_config, self.mongo)


def abort_on_lost_database(t: Trainer, exc: Exception, state: TrainState, position: ReadState) -> None:
    """End the run on a lost database: a checkpoint of the last whole step where it can be stored."""
    # Raised in a DataLoader worker, it arrives with the worker's traceback as its text.
    reason = str(exc).strip().splitlines()[-1].removeprefix("dsgpt2.errors.MongoUnavailableError: ")
    saved = ""
    if state.step > t.started:
        try:
            t.save(state, position)
            t.checkpointer.settle()
            saved = f"; a checkpoint at step {state.step} was saved: re-run to resume"
        except DsGpt2Error as lost:  # checkpoints stored in the database it lost
            saved = f"; no checkpoint could be stored ({lost}): re-run to resume from the last one"
    raise TrainingAborted(f"{reason}{saved}") from None


def _summary_of(t: Trainer, state: TrainState) -> dict[str, Any]:
    """What a finished run reports of itself (printed, and in the end record)."""

    return {
        "step": state.step,
        "tokens": state.tokens,
        "tokens_per_s": t.runlog.tokens_per_s(state.tokens),
        "val_loss": t.last_val,
        "val_ppl": perplexity(t.last_val) if t.last_val is not None else None,
        "val_bpb": t.last_bpb,
        "val_tokens": t.last_val_tokens,
        "eval_iters": t.cfg.run.eval_iters,
        "nonfinite": state.nonfinite,
        "skipped_documents": t.stream.skipped,
        "stopped": t.stop.stopped_by or ("early" if t.stopped_early else "done"),
        "checkpoint": t.checkpointer.where(tag_for(state.step)),
        **t.last_hellaswag,
    }


def batch_and_average(cfg: TrainConfig, ds: Any, world: int) -> list[str]:
    """The batch ramp and the weights' tail average checked against the DeepSpeed config: the lines that
    say what they do."""
    ramp = check_ramp(cfg.engine.batch_ramp, ds.grad_accum, cfg.engine.deepspeed_config)
    average = check_average(cfg.run.ema_tail, cfg.run.train_iters, zero_stage(ds.config))
    return [ramp.describe(ds.micro_batch, world)] * bool(ramp.ramping) + [average] * bool(average)


def collection_tokens(read: ReadState, names: Sequence[str], device: Any) -> dict[str, int]:
    """Tokens read from each collection so far (``read``: this rank's reading), by all ranks: a collective."""
    counts = all_sum([read.tokens.get(c, 0) for c in range(len(names))], device)
    return dict(zip(names, counts, strict=True))


def main(
    argv: Sequence[str] | None = None,
    on_loss: LossHook | None = None,
    after_step: StepHook | None = None,
    prog: str = "ds_trainer.py",
    sections: Collection[str] | None = None,
) -> int:
    """``ds_trainer.py`` and ``dsgpt2 train``: parse, build, train. User errors end with one line and
    their exit code.

    ``on_loss``/``after_step``: see :class:`Hooks` (the test suite injects faults through them);
    ``sections``: the names of the commands whose tables an experiment file may hold.
    """

    def run() -> int:
        cfg = parse(argv, prog, sections)
        trainer = None
        try:
            with start_up():  # imports and building without the collector's full passes
                trainer = build(cfg, hooks=Hooks(on_loss, after_step))
            summary = trainer.train()
            leave_process_group()
        except RuntimeError as exc:
            where = "start-up" if trainer is None else f"step {trainer.state.step + 1}"
            last = trainer.checkpointer.last_whole() if trainer else last_whole_in(cfg.ckpt.ckpt_dir)
            lost = peer_lost(exc, cfg.engine.dist_timeout, where, last)
            if lost is None:
                raise
            raise lost from None
        if trainer.rank == 0:
            print("\n".join(summary_lines(summary)))
        return 0

    return run_command(prog, run)
