"""The dtype of DeepSpeed's Newton–Schulz iteration in a test's own process.

DeepSpeed runs its Gram iteration in fp16 wherever the accelerator multiplies fp16 matrices (a CPU with
AVX512-FP16 or AMX-FP16) and its standard one in bf16; a Muon run sets fp32 on a CPU
(``dsgpt2.optim.muon_update.install``), but a test that calls DeepSpeed's optimizer or update itself
gets DeepSpeed's choice. Two computations of one step that order their sums differently (a batch
against one matrix at a time, a compiled kernel against the eager one) agree to fp32's rounding only in
fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def ns_dtype(method: str = "gram") -> torch.dtype:
    """The dtype DeepSpeed's iteration of ``method`` runs in here (Polar Express: fp32 on a CPU)."""
    import warnings

    from dsgpt2.accelerator import prepare_deepspeed_environment

    prepare_deepspeed_environment()
    with warnings.catch_warnings():  # DeepSpeed's import warns of torch APIs it calls: not the test's
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    if method == "polar_express":
        return torch.float32
    return ns_compute_dtype(method)


@contextlib.contextmanager
def ns_in_fp32() -> Iterator[None]:
    """DeepSpeed's iterations in fp32 whatever the machine multiplies in half precision: where a test
    asks two computations for the same numbers rather than numbers as close as the half type allows."""
    from deepspeed.runtime.zero.muon import original_muon

    from dsgpt2.optim.muon_update import fp32_iteration

    real = original_muon.ns_compute_dtype
    original_muon.ns_compute_dtype = fp32_iteration
    torch._dynamo.reset()  # nothing compiled for the other dtype runs inside
    try:
        yield
    finally:
        original_muon.ns_compute_dtype = real
        torch._dynamo.reset()
