"""What DeepSpeed reads from the environment when it is imported, set right before it is.

Called by each place that imports DeepSpeed, never at import of a dsgpt2 module: `dsgpt2 generate`
or `serve` leave the environment as they found it.
"""

from __future__ import annotations

import os
import re

_GPU_NODES = ("/dev/nvidiactl", "/dev/kfd", "/proc/driver/nvidia")


def prepare_deepspeed_environment() -> None:
    """Name the CPU accelerator where this machine has no GPU driver, and make the CUDA arch list
    one DeepSpeed's op builder can read. Idempotent; a user's own settings are kept."""
    # DeepSpeed warns on every start where it finds no GPU ("Setting accelerator to CPU..."); where
    # this machine has no GPU driver at all, say so first. Cheap: no torch import.
    if "DS_ACCELERATOR" not in os.environ and not any(os.path.exists(p) for p in _GPU_NODES):
        os.environ["DS_ACCELERATOR"] = "cpu"
    # DeepSpeed's op builder reads TORCH_CUDA_ARCH_LIST as plain "M.N" numbers: an arch-specific
    # entry such as "9.0a" (set by CUDA images for Hopper) fails its JIT build of FusedAdam with
    # "invalid literal for int() with base 10: '0a'". The plain arch builds the same ops.
    value = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    plain = re.sub(r"(\d+\.\d+)[a-z]\b", r"\1", value)
    if plain != value:
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain
