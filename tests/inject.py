"""ds_trainer.py with faults injected through the trainer's hooks (the test suite's, not a user's).

    python tests/inject.py [--nonfinite_at N ...] [--exit_after STEP] -- DS_TRAINER_FLAGS...

--nonfinite_at: the loss of these micro-batches becomes NaN; --exit_after: die like a killed job
right after that step (no cleanup, no final checkpoint), exit code 17.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys

import torch

from dsgpt2.train import trainer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nonfinite_at", type=int, nargs="*", default=[])
    p.add_argument("--exit_after", type=int)
    argv = sys.argv[1:]
    cut = argv.index("--")
    faults = p.parse_args(argv[:cut])

    def on_loss(micro: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if micro in faults.nonfinite_at else loss

    def after_step(step: int) -> None:
        if step == faults.exit_after:
            for child in multiprocessing.active_children():
                child.kill()
            os._exit(17)

    return trainer.main(argv[cut + 1 :], on_loss=on_loss, after_step=after_step)


if __name__ == "__main__":
    raise SystemExit(main())
