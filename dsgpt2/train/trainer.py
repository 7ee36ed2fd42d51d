"""The training run: parse → build (data, model, engine) → resume → loop → save.

Used by ``ds_trainer.py`` under the ``deepspeed`` launcher or as a plain
process. Only this module and :mod:`dsgpt2.train.checkpoint` touch DeepSpeed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsgpt2.corpus.config import ENV_URI, load_config, scrub
from dsgpt2.data.cache import CachedChunks, prepare_cache
from dsgpt2.data.dealing import Position, redeal
from dsgpt2.data.loader import BlockStream, eval_batches
from dsgpt2.data.sources import SPLITS, StreamingChunks, fingerprint, load_tokenizer, make_spec
from dsgpt2.errors import ConfigError, DsGpt2Error, MongoUnavailableError
from dsgpt2.log import setup_logging
from dsgpt2.model import PRESETS, build_model, count_parameters, gpt2_config, param_groups
from dsgpt2.train import checkpoint
from dsgpt2.train.args import parse
from dsgpt2.train.ds_config import load_ds_config, optimizer_weight_decay, zero_stage
from dsgpt2.train.metrics import MetricsLog, plot_losses

log = logging.getLogger("dsgpt2.train.trainer")


def run_context(args: Any) -> int:
    """Tokens per block: --context_length, else the model config's n_positions, else the preset's."""
    if args.context_length:
        return args.context_length
    if args.model_config is not None:
        import json

        return int(json.loads(Path(args.model_config).read_text()).get("n_positions", 1024))
    return PRESETS[args.model_select].context


def _init_context(args: Any, config: Any) -> int:
    context = args.context_length or config.n_positions
    if context > config.n_positions:
        raise ConfigError(
            f"--context_length {context} is longer than the {config.n_positions} positions of "
            f"--init_from {args.init_from}; use at most {config.n_positions}"
        )
    return int(context)


class TrainingAborted(DsGpt2Error):
    """Training stopped on purpose: non-finite losses in a row, or a lost database."""

    exit_code = 3


def ensure_distributed_env() -> None:
    """Set what ``torch.distributed`` needs for a single process started without a launcher."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    micro: int = 0  # micro-batches drawn, skipped ones included
    nonfinite: int = 0


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _param_checksum(engine: Any) -> float:
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in engine.module.parameters()))


class Trainer:
    def __init__(self, args: Any, mongo: Any = None) -> None:
        """``mongo``: a :class:`~dsgpt2.corpus.config.MongoConfig` used instead of --config_train."""
        self.args = args
        self._mongo = mongo
        ensure_distributed_env()
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        setup_logging(rank=self.rank)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.stop_requested = False

    # ------------------------------------------------------------ build

    def build(self) -> None:
        from dsgpt2.corpus.mongo import Connection, MongoWrapper
        from dsgpt2.corpus.validate import require_valid

        args = self.args
        self.mongo = self._mongo or load_config(args.config_train)
        self.vocab_size = load_tokenizer(args.vocab_dir).get_vocab_size()
        self.ds_config = load_ds_config(args.deepspeed_config, self.world, args.train_iters, self.device)
        import deepspeed

        # First: the barriers and broadcasts below need the process group.
        backend = args.distributed_backend or ("nccl" if self.device == "cuda" else "gloo")
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        conn = Connection(self.mongo)
        conn.ping()
        # Rank 0 reads the corpus once and every rank takes its verdict and counts: the
        # full-collection checks are not repeated per rank, and all ranks index the same counts.
        shared: list[Any] = [None, None]
        if self.rank == 0:
            try:
                if not args.allow_corpus_problems:
                    require_valid(conn)
                shared[1] = MongoWrapper(self.mongo, connection=conn).counts
            except DsGpt2Error as exc:
                shared[0] = (type(exc).__name__, str(exc))
        _broadcast(shared)
        _raise_shared(shared[0])
        self.counts = tuple(shared[1])
        init = self._init_weights()
        context = run_context(args) if init is None else _init_context(args, init[0])
        self.spec = make_spec(
            args.vocab_dir, context, args.chunk_docs, args.tr_ratio, args.seed, args.task, args.reply_speakers
        )
        self.fingerprint = fingerprint(self.mongo, self.counts, args.vocab_dir, self.spec)
        # Before any model is built: a checkpoint that cannot be resumed fails in seconds.
        self.resume_from = self._resume_point()
        self.train_data, self.val_data = self._datasets()

        _seed_all(args.seed)
        if init is None:
            self.model_config = gpt2_config(
                args.model_select, self.vocab_size, context, self.spec.eot, self.spec.pad, args.model_config
            )
            model = build_model(self.model_config)
        else:
            from dsgpt2.train.weights import build_with_weights

            self.model_config = init[0]
            model = build_with_weights(init[0], init[1], str(args.init_from))
            log.info("initialised from %s", args.init_from)
        groups = param_groups(model, optimizer_weight_decay(self.ds_config))
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups, config=self.ds_config
        )
        self.micro_batch = self.ds_config["train_micro_batch_size_per_gpu"]
        self.grad_accum = self.ds_config["gradient_accumulation_steps"]
        log.info(
            "model %s: %.1fM parameters, context %d, vocab %d; %d rank(s), micro-batch %d × accumulation %d, "
            "ZeRO stage %d, %s",
            args.init_from or args.model_config or args.model_select,
            count_parameters(model) / 1e6,
            context,
            self.vocab_size,
            self.world,
            self.micro_batch,
            self.grad_accum,
            zero_stage(self.ds_config),
            self.device,
        )

    def _init_weights(self) -> tuple[Any, dict[str, Any]] | None:
        """The config and weights of --init_from, checked against the tokenizer."""
        if self.args.init_from is None:
            return None
        from dsgpt2.train.weights import load_weights

        config, weights, _, _ = load_weights(self.args.init_from)
        if config.vocab_size != self.vocab_size:
            raise ConfigError(
                f"--init_from {self.args.init_from} has a vocabulary of {config.vocab_size} tokens but "
                f"--vocab_dir {self.args.vocab_dir} has {self.vocab_size}; use the tokenizer the model "
                "was trained with (the default when --vocab_dir is left out)"
            )
        return config, weights

    def _datasets(self) -> tuple[Any, Any]:
        args = self.args
        if args.data_mode == "streaming":
            return tuple(
                StreamingChunks(self.mongo, self.counts, args.vocab_dir, self.spec, s) for s in SPLITS
            )
        cache_dir = args.cache_dir or args.workspace / "cache"
        if self.rank == 0:
            _, built = prepare_cache(
                self.mongo, args.vocab_dir, self.spec, cache_dir, workers=args.num_workers
            )
            log.info("token cache %s: %s", cache_dir, "built" if built else "up to date, reused")
        _barrier()
        return CachedChunks(cache_dir, "train"), CachedChunks(cache_dir, "val")

    # ------------------------------------------------------------ resume

    def client_state(self, state: TrainState, position: Position) -> dict[str, Any]:
        return {
            "dsgpt2": {
                "step": state.step,
                "tokens": state.tokens,
                "micro": state.micro,
                "nonfinite": state.nonfinite,
                "position": position.to_dict(),
                "rank_positions": self._gather_positions(position),
                "rng": checkpoint.rng_state(),
                "fingerprint": self.fingerprint,
                "model_config": self.model_config.to_dict(),
                "vocab_dir": str(self.args.vocab_dir.resolve()),
                "args": _safe_args(self.args),
                "mongo": self.mongo.to_dict(),
            }
        }

    def _gather_positions(self, position: Position) -> list[dict[str, int]]:
        import torch.distributed as dist

        if not dist.is_initialized() or self.world == 1:
            return [position.to_dict()]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, position.to_dict())
        return out

    def _resume_point(self) -> tuple[Path, str] | None:
        """The checkpoint to resume from (found and verified on rank 0); None for a fresh start.

        Raises:
            CheckpointError: none where one was asked for, a broken one, one of other data or of
                another number of ranks, or a fresh start that would overwrite checkpoints.
        """
        shared: list[Any] = [None, None]
        if self.rank == 0:
            try:
                shared[1] = self._find_resume_point()
            except DsGpt2Error as exc:
                shared[0] = (type(exc).__name__, str(exc))
        _broadcast(shared)
        _raise_shared(shared[0])
        return shared[1]

    def _find_resume_point(self) -> tuple[Path, str] | None:
        args = self.args
        load_dir: Path | None = args.load_dir
        if load_dir is None and checkpoint.has_checkpoints(args.ckpt_dir):
            if args.no_resume:
                raise checkpoint.CheckpointError(
                    f"--no_resume: {args.ckpt_dir} holds checkpoints already; a fresh run there would "
                    "overwrite them. Choose another --ckpt_dir (or remove them), or drop --no_resume"
                )
            load_dir = args.ckpt_dir
        if load_dir is None:
            return None
        tag = checkpoint.resolve(load_dir, args.ckpt_id)
        saved = checkpoint.read_client_state(load_dir, tag)
        ranks = len(saved.get("rank_positions") or [saved["position"]])
        if ranks != self.world and checkpoint.is_partitioned(load_dir, tag):
            raise checkpoint.CheckpointError(
                f"{load_dir / tag} was saved by {ranks} rank(s) with ZeRO-partitioned optimizer state and "
                f"this run has {self.world}: resume with {ranks} rank(s), or convert it with DeepSpeed's "
                "universal checkpoint tool (python -m deepspeed.checkpoint.ds_to_universal) first"
            )
        if ranks != self.world:
            log.warning(
                "%s was saved by %d rank(s); this run has %d: what the epoch has not read is dealt anew "
                "(the global batch is now %d ranks' worth)", load_dir / tag, ranks, self.world, self.world,
            )  # fmt: skip
        if saved["fingerprint"] != self.fingerprint:
            changed = sorted(
                k for k in self.fingerprint if saved["fingerprint"].get(k) != self.fingerprint[k]
            )
            if not args.ignore_fingerprint:
                raise checkpoint.CheckpointError(
                    f"{load_dir / tag} was saved for other data ({', '.join(changed)} changed); "
                    "resuming would not continue the same run. Start fresh (--no_resume, another "
                    "--ckpt_dir) or pass --ignore_fingerprint to resume anyway"
                )
            log.warning("resuming although %s changed (--ignore_fingerprint)", ", ".join(changed))
        return load_dir, tag

    def resume(self) -> tuple[TrainState, Position]:
        if self.resume_from is None:
            return TrainState(), Position()
        load_dir, tag = self.resume_from
        saved = checkpoint.load(self.engine, load_dir, tag)["dsgpt2"]
        positions = [Position.from_dict(p) for p in saved.get("rank_positions") or [saved["position"]]]
        if len(positions) != self.world:
            positions = redeal(positions, len(self.train_data), self.args.seed, self.world)
        position = positions[self.rank]
        checkpoint.set_rng_state(saved["rng"])
        state = TrainState(saved["step"], saved["tokens"], saved["micro"], saved["nonfinite"])
        log.info(
            "resumed from %s at step %d (epoch %d, chunk %d, block %d)",
            load_dir / tag,
            state.step,
            position.epoch,
            position.chunk,
            position.block,
        )
        return state, position

    # ------------------------------------------------------------ loop

    def train(self) -> dict[str, Any]:
        args = self.args
        state, position = self.resume()
        stream = BlockStream(
            self.train_data, args.seed, self.rank, self.world, self.micro_batch, position, args.num_workers
        )
        metrics = None
        if self.rank == 0:
            metrics = MetricsLog(args.workspace, args.wandb, args.wandb_dir, self._run_config())
        signal.signal(signal.SIGTERM, self._on_sigterm)
        eval_cache: list[Any] | None = None
        started = time.monotonic()
        start_step, start_tokens = state.step, state.tokens
        run_of_bad = 0
        last_val: float | None = None
        bar = _progress(self.rank, args.train_iters, state.step)
        blocks_log = None
        if args.log_block_ids:
            args.workspace.mkdir(parents=True, exist_ok=True)
            blocks_log = open(args.workspace / f"block_ids_rank{self.rank}.jsonl", "a")  # noqa: SIM115
        it = iter(stream)
        # The state and data position after the last whole step: what a checkpoint written
        # when the database goes away mid-accumulation must hold.
        boundary = (replace(state), stream.position)
        try:
            while state.step < args.train_iters and not self.stop_requested:
                self.engine.train()
                losses, ids = [], []
                while len(losses) < self.grad_accum:
                    batch = next(it)
                    state.micro += 1
                    out = self.engine(
                        input_ids=batch.input_ids.to(self.engine.device),
                        attention_mask=batch.attention_mask.to(self.engine.device),
                        labels=batch.labels.to(self.engine.device),
                    )
                    loss = out.loss
                    if not bool((batch.labels[:, 1:] != -100).any()):
                        # Context only (a conversation block without reply tokens): the mean over
                        # no tokens is NaN; a zero loss keeps every rank stepping together.
                        loss = out.logits.sum() * 0.0
                    if state.micro in args.debug_nonfinite_at:
                        loss = loss * float("nan")
                    if not _all_finite(loss):
                        before = _param_checksum(self.engine)
                        state.nonfinite += 1
                        run_of_bad += 1
                        del out, loss  # no backward, no step: the batch leaves the weights as they are
                        if metrics:
                            metrics.write(
                                {
                                    "event": "nonfinite",
                                    "step": state.step,
                                    "micro": state.micro,
                                    "params_before": before,
                                    "params_after": _param_checksum(self.engine),
                                    "nonfinite_total": state.nonfinite,
                                }
                            )
                        log.warning(
                            "non-finite loss at micro-batch %d (step %d): skipped (%d in a row)",
                            state.micro,
                            state.step + 1,
                            run_of_bad,
                        )
                        if run_of_bad >= args.max_nonfinite:
                            raise TrainingAborted(
                                f"{run_of_bad} non-finite losses in a row "
                                f"(--max_nonfinite {args.max_nonfinite}) at step {state.step + 1}; "
                                "lower the learning rate or check the data. "
                                "No checkpoint was written after them"
                            )
                        continue
                    run_of_bad = 0
                    self.engine.backward(loss)
                    self.engine.step()
                    losses.append(float(loss.detach()))
                    state.tokens += batch.tokens * self.world
                    if args.log_block_ids:
                        ids.extend(batch.block_ids)
                state.step += 1
                boundary = (replace(state), stream.position)
                loss_value = sum(losses) / len(losses)
                elapsed = max(time.monotonic() - started, 1e-9)
                tps = (state.tokens - start_tokens) / elapsed
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tps:,.0f}")
                if blocks_log is not None:
                    blocks_log.write(json.dumps({"step": state.step, "block_ids": ids}) + "\n")
                    blocks_log.flush()
                if metrics and (state.step % args.log_interval == 0 or args.log_block_ids or state.step == 1):
                    record = {
                        "event": "train",
                        "step": state.step,
                        "loss": loss_value,
                        "lr": self.engine.get_lr()[0],
                        "tokens": state.tokens,
                        "tokens_per_s": tps,
                    }
                    if args.log_block_ids:
                        record["block_ids"] = ids
                        record["losses"] = losses
                    metrics.write(record)
                if state.step % args.eval_interval == 0 or state.step == args.train_iters:
                    if eval_cache is None:
                        eval_cache = eval_batches(
                            self.val_data,
                            self.rank,
                            self.world,
                            args.eval_batch_size or self.micro_batch,
                            args.eval_iters,
                        )
                    last_val = self.evaluate(eval_cache)
                    if metrics and last_val is not None:
                        metrics.write(
                            {
                                "event": "eval",
                                "step": state.step,
                                "val_loss": last_val,
                                "val_ppl": math.exp(min(last_val, 50)),
                            }
                        )
                if state.step % args.save_interval == 0 and state.step < args.train_iters:
                    self.save(state, stream.position)
                if args.debug_exit_after == state.step:
                    _crash()
        except MongoUnavailableError as exc:
            # Raised in a DataLoader worker, it arrives with the worker's traceback as its text.
            reason = str(exc).strip().splitlines()[-1].removeprefix("dsgpt2.errors.MongoUnavailableError: ")
            saved = ""
            if boundary[0].step > start_step:
                self.save(*boundary)
                saved = f"; a checkpoint at step {boundary[0].step} was saved: re-run to resume"
            raise TrainingAborted(f"{reason}{saved}") from None
        finally:
            if bar is not None:
                bar.close()
            if blocks_log is not None:
                blocks_log.close()
        if state.step > start_step:
            self.save(state, stream.position)
        else:
            # Nothing trained since the start or the resume: the checkpoint there already holds it.
            log.info("nothing trained (step %d of --train_iters %d): no checkpoint written", state.step,
                     args.train_iters)  # fmt: skip
        reason = "SIGTERM" if self.stop_requested else "done"
        summary = {
            "step": state.step,
            "tokens": state.tokens,
            "tokens_per_s": (state.tokens - start_tokens) / max(time.monotonic() - started, 1e-9),
            "val_loss": last_val,
            "val_ppl": math.exp(min(last_val, 50)) if last_val is not None else None,
            "nonfinite": state.nonfinite,
            "skipped_documents": stream.skipped,
            "stopped": reason,
            "checkpoint": str(self.args.ckpt_dir / checkpoint.tag_for(state.step)),
        }
        if metrics:
            metrics.write({"event": "end", **summary})
            metrics.close()
            plot = plot_losses(metrics.path, args.workspace / "loss.png")
            summary["plot"] = str(plot) if plot else None
        return summary

    def evaluate(self, batches: list[Any]) -> float | None:
        """Mean token loss over the validation batches, on every rank, under no_grad."""
        import torch.distributed as dist

        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for batch in batches:
                out = self.engine(
                    input_ids=batch.input_ids.to(self.engine.device),
                    attention_mask=batch.attention_mask.to(self.engine.device),
                    labels=batch.labels.to(self.engine.device),
                )
                # The loss is a mean over the predicted tokens; weigh batches by their count.
                n = int((batch.labels[:, 1:] != -100).sum())
                if n == 0:
                    continue
                total += torch.tensor([float(out.loss) * n, n], dtype=torch.float64)
        if dist.is_initialized() and self.world > 1:
            total = total.to(self.engine.device)
            dist.all_reduce(total)
        self.engine.train()
        return float(total[0] / total[1]) if total[1] > 0 else None

    def save(self, state: TrainState, position: Position) -> None:
        for p in self.engine.module.parameters():
            if not torch.isfinite(p).all():
                raise TrainingAborted("the weights hold non-finite values; refusing to save them")
        tag = checkpoint.save(
            self.engine,
            self.args.ckpt_dir,
            state.step,
            self.client_state(state, position),
            self.args.keep_last,
        )
        log.info("saved checkpoint %s", self.args.ckpt_dir / tag)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM: saving a checkpoint after the current step, then exiting")
        self.stop_requested = True

    def _run_config(self) -> dict[str, Any]:
        return {
            "args": _safe_args(self.args),
            "mongo": self.mongo.to_dict(),
            "deepspeed": self.ds_config,
            "fingerprint": self.fingerprint,
            "model": self.model_config.to_dict(),
        }


def _safe_args(args: Any) -> dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        out[k] = str(v) if isinstance(v, Path) else v
    return out


def _all_finite(loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every rank (so that all ranks skip together)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if torch.isfinite(loss).all() else 0.0], device=loss.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def _crash() -> None:
    """Die like a killed job: no cleanup, no final checkpoint (workers go down with us)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    os._exit(17)


def _broadcast(values: list[Any]) -> None:
    """Give every rank rank 0's ``values`` (in place); nothing to do in a single process."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(values, src=0)


def _raise_shared(error: tuple[str, str] | None) -> None:
    """Raise on every rank the user error rank 0 met (same class where it is one of ours)."""
    if error is None:
        return
    import dsgpt2.errors as errors

    kind = getattr(errors, error[0], None) or getattr(checkpoint, error[0], None) or DsGpt2Error
    raise kind(error[1])


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _progress(rank: int, total: int, initial: int) -> Any:
    if rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", desc="train", disable=None)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = [
        f"stopped: {summary['stopped']} at step {summary['step']}, {summary['tokens']:,} tokens "
        f"({summary['tokens_per_s']:,.0f} tokens/s)",
    ]
    if summary.get("val_loss") is not None:
        lines.append(f"validation: loss {summary['val_loss']:.4f}, perplexity {summary['val_ppl']:.2f}")
    lines.append(f"checkpoint: {summary['checkpoint']}")
    if summary.get("plot"):
        lines.append(f"loss plot: {summary['plot']}")
    if summary.get("nonfinite"):
        lines.append(f"non-finite losses skipped: {summary['nonfinite']}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``ds_trainer.py``: user errors end with one line and their exit code."""
    try:
        args = parse(argv)
        trainer = Trainer(args)
        trainer.build()
        summary = trainer.train()
    except DsGpt2Error as exc:
        print(f"ds_trainer.py: error: {scrub(str(exc), os.environ.get(ENV_URI, ''))}", file=sys.stderr)
        return exc.exit_code
    if trainer.rank == 0:
        print("\n".join(summary_lines(summary)))
    return 0
