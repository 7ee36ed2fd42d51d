"""Validation during training: this rank's held-out batches, read once, and their mean token loss
under no_grad, summed over every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsgpt2.data.loader import eval_batches
from dsgpt2.data.packing import IGNORE
from dsgpt2.train.config import TrainConfig


class Validator:
    """Asks at each step whether to validate, and validates.

    Args:
        cfg: the run's configuration (``--eval_interval``, ``--eval_iters``, ``--eval_batch_size``).
        val_data: the validation split's chunks (the documents known at the run's start).
        rank, world: this rank among the run's ranks.
        micro_batch: the training micro-batch, the default evaluation batch.
    """

    def __init__(self, cfg: TrainConfig, val_data: Any, rank: int, world: int, micro_batch: int) -> None:
        self.run = cfg.run
        self.val_data = val_data
        self.rank = rank
        self.world = world
        self.batch = cfg.run.eval_batch_size or micro_batch
        self._batches: list[Any] | None = None

    def should_validate(self, step: int) -> bool:
        return step % self.run.eval_interval == 0 or step == self.run.train_iters

    def validate(self, engine: Any, loss_of: Callable[[Any], torch.Tensor]) -> float | None:
        """Mean token loss over the validation batches, on every rank, under no_grad; ``loss_of``: the
        mean loss of one batch as training computes it. None when the batches hold no token to predict."""
        import torch.distributed as dist

        if self._batches is None:
            self._batches = eval_batches(
                self.val_data, self.rank, self.world, self.batch, self.run.eval_iters
            )
        engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=engine.device)
        with torch.no_grad():
            for batch in self._batches:
                # The loss is a mean over the predicted tokens; weigh batches by their count.
                n = int((batch.labels[:, 1:] != IGNORE).sum())
                if n == 0:
                    continue
                total[0] += loss_of(batch).double() * n
                total[1] += n
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(total)
        total = total.cpu()
        engine.train()
        return float(total[0] / total[1]) if total[1] > 0 else None
