"""Validation during training: this rank's held-out batches, read once, and their mean token loss
under no_grad, summed over every rank: the measure ``dsgpt2 evaluate`` takes
(:func:`~dsgpt2.model.batch_nll`)."""

from __future__ import annotations

from typing import Any

import torch

from dsgpt2.data.loader import eval_batches
from dsgpt2.model import batch_nll
from dsgpt2.train.config import TrainConfig


class Validator:
    """Asks at each step whether to validate, and validates.

    Args:
        cfg: the run's configuration (``--eval_interval``, ``--eval_iters``, ``--eval_batch_size``).
        val_data: the validation split's chunks (the documents known at the run's start).
        rank, world: this rank among the run's ranks.
        micro_batch: the training micro-batch, the default evaluation batch.
        doc_mask_eot: the end-of-text id when the run attends within documents (--doc_mask).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        val_data: Any,
        rank: int,
        world: int,
        micro_batch: int,
        doc_mask_eot: int | None,
    ) -> None:
        self.run = cfg.run
        self.doc_mask_eot = doc_mask_eot
        self.val_data = val_data
        self.rank = rank
        self.world = world
        self.batch = cfg.run.eval_batch_size or micro_batch
        self._batches: list[Any] | None = None

    def should_validate(self, step: int) -> bool:
        return step % self.run.eval_interval == 0 or step == self.run.train_iters

    def validate(self, engine: Any) -> float | None:
        """Mean token loss over the validation batches, on every rank, under no_grad. None when the
        batches hold no token to predict."""
        import torch.distributed as dist

        if self._batches is None:
            self._batches = eval_batches(
                self.val_data, self.rank, self.world, self.batch, self.run.eval_iters
            )
        engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=engine.device)
        with torch.no_grad():
            # Every rank runs every forward, even of a batch with no token to predict: under ZeRO-3
            # each forward gathers the weights from all ranks.
            for batch in self._batches:
                nll, n = batch_nll(engine, batch, engine.device, self.doc_mask_eot)
                total[0] += nll
                total[1] += n
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(total)
        total = total.cpu()
        engine.train()
        return float(total[0] / total[1]) if total[1] > 0 else None
