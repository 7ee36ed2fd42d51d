"""The training run: flags, DeepSpeed config, checkpoints, weights, metrics, memory plan.

Only this package imports deepspeed.
"""

import os
import re


def _name_the_accelerator() -> None:
    # DeepSpeed warns on every start where it finds no GPU ("Setting accelerator to CPU..."); where
    # this machine has no GPU driver at all, say so first. Cheap (no torch import: the CLI starts
    # fast); a user's own DS_ACCELERATOR is left alone.
    gpu_nodes = ("/dev/nvidiactl", "/dev/kfd", "/proc/driver/nvidia")
    if "DS_ACCELERATOR" not in os.environ and not any(os.path.exists(p) for p in gpu_nodes):
        os.environ["DS_ACCELERATOR"] = "cpu"


def _plain_arch_list() -> None:
    # DeepSpeed's op builder reads TORCH_CUDA_ARCH_LIST as plain "M.N" numbers: an arch-specific
    # entry such as "9.0a" (set by CUDA images for Hopper) fails its JIT build of FusedAdam with
    # "invalid literal for int() with base 10: '0a'". The plain arch builds the same ops.
    value = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    plain = re.sub(r"(\d+\.\d+)[a-z]\b", r"\1", value)
    if plain != value:
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain


_name_the_accelerator()
_plain_arch_list()
