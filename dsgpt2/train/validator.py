"""Validation during training: this rank's held-out batches, read once, and their mean token loss
and bits per byte under no_grad, summed over every rank: the measure ``dsgpt2 evaluate`` takes
(:func:`~dsgpt2.model.gpt2.batch_nll`). With ``--hellaswag``, HellaSwag's accuracies as ``dsgpt2
evaluate --hellaswag`` takes them, each rank scoring an equal share of the examples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dsgpt2.data.loader import eval_batches
from dsgpt2.errors import ConfigError
from dsgpt2.model.gpt2 import batch_nll, bits_per_byte
from dsgpt2.tokenizer.bpe import load_tokenizer
from dsgpt2.tokenizer.token_bytes import token_bytes
from dsgpt2.train.config import RunOptions


class Validator:
    """Asks at each step whether to validate, and validates.

    Args:
        run: the run options (``--eval_interval``, ``--eval_iters``, ``--eval_batch_size``,
            ``--train_iters``, ``--hellaswag``, ``--hellaswag_limit``).
        val_data: the validation split's chunks (the documents known at the run's start).
        vocab_dir: the run's tokenizer (HellaSwag's texts are encoded with it; the bytes of its tokens
            give bits per byte, none without it or for a tokenizer not byte-level).
        rank, world: this rank among the run's ranks.
        micro_batch: the training micro-batch, the default evaluation batch.
        doc_mask_eot: the end-of-text id when the run attends within documents (--doc_mask).
        context: the model's context (HellaSwag's rows are cut to it).
    """

    def __init__(
        self,
        run: RunOptions,
        val_data: Any,
        *,
        vocab_dir: Path | None,
        rank: int,
        world: int,
        micro_batch: int,
        doc_mask_eot: int | None,
        context: int = 1024,
    ) -> None:
        self.run = run
        self.vocab_dir, self.context = vocab_dir, context
        self.doc_mask_eot = doc_mask_eot
        self.val_data = val_data
        self.rank = rank
        self.world = world
        self.batch = run.eval_batch_size or micro_batch
        self._batches: list[Any] | None = None
        self._hellaswag: list[Any] = self._hellaswag_share() if run.hellaswag else []
        self._encode: Any = None
        self._token_bytes: torch.Tensor | None = None

    def should_validate(self, step: int) -> bool:
        return step % self.run.eval_interval == 0 or step == self.run.train_iters

    def validate(self, engine: Any) -> tuple[float, float | None, int] | None:
        """Mean token loss, bits per byte and tokens predicted over the validation batches (the first
        ``--eval_iters`` of each rank: a sample of the split, the same each time), on every rank, under
        no_grad (bits per byte None without a byte-level tokenizer). None when the batches hold no
        token to predict."""
        import torch.distributed as dist

        if self._batches is None:
            self._batches = eval_batches(
                self.val_data, self.rank, self.world, self.batch, self.run.eval_iters
            )
            ids = token_bytes(load_tokenizer(self.vocab_dir)) if self.vocab_dir is not None else None
            if ids is not None:
                self._token_bytes = torch.tensor(ids, dtype=torch.int64, device=engine.device)
        engine.eval()
        total = torch.zeros(3, dtype=torch.float64, device=engine.device)  # nats, tokens, bytes
        with torch.no_grad():
            # Every rank runs every forward, even of a batch with no token to predict: under ZeRO-3
            # each forward gathers the weights from all ranks.
            for batch in self._batches:
                nll, n, n_bytes = batch_nll(engine, batch, engine.device, self.doc_mask_eot,
                                            token_bytes=self._token_bytes)  # fmt: skip
                total[0] += nll
                total[1] += n
                if n_bytes is not None:
                    total[2] += n_bytes
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(total)
        nats, tokens, n_bytes = total.cpu().tolist()
        engine.train()
        if tokens == 0:
            return None
        return nats / tokens, bits_per_byte(nats, n_bytes), int(tokens)

    def hellaswag(self, engine: Any) -> dict[str, float | int] | None:
        """HellaSwag's accuracies, every rank's share scored and the counts summed (None without
        ``--hellaswag``)."""
        import torch.distributed as dist

        from dsgpt2.model.hellaswag import ENDINGS, encoder, result, score

        if not self._hellaswag:
            return None
        if self._encode is None:
            self._encode = encoder(self.vocab_dir)
        engine.eval()
        with torch.no_grad():
            total = score(engine, self._encode, self._hellaswag, engine.device, self.context,
                          batch_examples=max(1, self.batch // ENDINGS))  # fmt: skip
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(total)
        engine.train()
        return result(total)

    def _hellaswag_share(self) -> list[Any]:
        """This rank's contiguous share of the examples: the same number on every rank, the few left
        over (fewer than the ranks) left out, so that every rank runs the same forwards (under ZeRO-3
        each gathers from all ranks). Read before the first step: a file too small stops the run then."""
        from dsgpt2.model.hellaswag import read_examples

        examples = read_examples(self.run.hellaswag, self.run.hellaswag_limit)
        share = len(examples) // self.world
        if share == 0:
            raise ConfigError(
                f"--hellaswag {self.run.hellaswag}: {len(examples)} example(s) for {self.world} ranks; "
                "each rank needs at least one"
            )
        return examples[self.rank * share : (self.rank + 1) * share]
