"""ds_trainer.py with faults injected through the trainer's hooks (the test suite's, not a user's).

    python tests/inject.py [--nonfinite_at N ...] [--nonfinite_rank R] [--no_gradient | --detached_loss]
        [--exit_after STEP]
        [--after STEP=COMMAND ...] [--kill_group_after STEP]
        [--die_uploading N [--die_rank R] [--kill_server PID]] -- DS_TRAINER_FLAGS...

--nonfinite_at: the loss of these micro-batches becomes NaN (--nonfinite_rank: on that rank only, else
on every rank); --no_gradient: every loss keeps its value and its graph but passes no gradient back (what
a compiled graph that lost its backward does); --detached_loss: every loss is cut off from the model;
--exit_after: die like a killed job
right after that step (no cleanup, no final checkpoint), exit code 17; --after: run the shell
COMMAND (another process: an ingest, say) when that step ends, on rank 0, and wait for it;
--kill_group_after: SIGKILL this process's whole process group after that step (a node lost at once:
its launcher, its ranks, their workers, when the node's launch was its own group); --die_uploading N:
rank --die_rank (default 0) dies, exit code 17, as it starts its Nth upload of a checkpoint file to the
database; with --kill_server, it SIGKILLs the database server of that PID instead, and goes on.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys

import torch

from dsgpt2.train import trainer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nonfinite_at", type=int, nargs="*", default=[])
    p.add_argument("--nonfinite_rank", type=int)
    p.add_argument("--no_gradient", action="store_true")
    p.add_argument("--detached_loss", action="store_true")
    p.add_argument("--exit_after", type=int)
    p.add_argument("--after", action="append", default=[])
    p.add_argument("--kill_group_after", type=int)
    p.add_argument("--die_uploading", type=int)
    p.add_argument("--die_rank", type=int, default=0)
    p.add_argument("--kill_server", type=int)
    argv = sys.argv[1:]
    cut = argv.index("--")
    # The deepspeed launcher puts --local_rank=N first: it is the trainer's.
    faults, launcher_args = p.parse_known_args(argv[:cut])

    here = faults.nonfinite_rank is None or faults.nonfinite_rank == int(os.environ.get("RANK", "0"))

    def on_loss(micro: int, loss: torch.Tensor) -> torch.Tensor:
        if faults.no_gradient:
            return loss.detach() + loss * 0.0
        if faults.detached_loss:
            return loss.detach()
        return loss * float("nan") if here and micro in faults.nonfinite_at else loss

    if faults.die_uploading and faults.die_rank == int(os.environ.get("RANK", "0")):
        from dsgpt2.db import blobs

        put, calls = blobs.BlobStore.put, [0]

        def dying_put(self: blobs.BlobStore, name: str, path: object) -> dict:
            calls[0] += 1
            if calls[0] == faults.die_uploading and faults.kill_server:
                os.kill(faults.kill_server, signal.SIGKILL)  # the database lost in the middle of a save
            elif calls[0] == faults.die_uploading:
                os._exit(17)  # killed in the middle of a save's upload
            return put(self, name, path)

        blobs.BlobStore.put = dying_put

    commands = {int(k): v for k, v in (a.split("=", 1) for a in faults.after)}

    def after_step(step: int) -> None:
        if step in commands and os.environ.get("RANK", "0") == "0":
            subprocess.run(commands[step], shell=True, check=True)
        if step == faults.exit_after:
            for child in multiprocessing.active_children():
                child.kill()
            os._exit(17)
        if step == faults.kill_group_after:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    return trainer.main([*launcher_args, *argv[cut + 1 :]], on_loss=on_loss, after_step=after_step)


if __name__ == "__main__":
    raise SystemExit(main())
