"""The training run: flags, DeepSpeed config, checkpoints, weights, metrics, memory plan.

Only this package imports deepspeed.
"""

import os


def _name_the_accelerator() -> None:
    # DeepSpeed warns on every start where it finds no GPU ("Setting accelerator to CPU..."); where
    # this machine has no GPU driver at all, say so first. Cheap (no torch import: the CLI starts
    # fast); a user's own DS_ACCELERATOR is left alone.
    gpu_nodes = ("/dev/nvidiactl", "/dev/kfd", "/proc/driver/nvidia")
    if "DS_ACCELERATOR" not in os.environ and not any(os.path.exists(p) for p in gpu_nodes):
        os.environ["DS_ACCELERATOR"] = "cpu"


_name_the_accelerator()
