"""The training run: flags, DeepSpeed config, checkpoints, weights, metrics, memory plan.

Only this package imports deepspeed.
"""

import os


def _name_the_accelerator() -> None:
    # DeepSpeed warns on every start where it finds no GPU ("Setting accelerator to CPU...");
    # where torch sees none, say so first. A user's own DS_ACCELERATOR is left alone.
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


_name_the_accelerator()
