"""How close two computations of one Muon step can be asked to come on this machine.

DeepSpeed runs the Newton–Schulz iteration in the dtype ``ns_compute_dtype`` gives: its Gram form in
fp16 where the accelerator multiplies fp16 matrices (a CPU with AVX512-FP16 or AMX), fp32 on other CPUs;
the standard form in bf16. Two computations of one step that order their sums differently (a batch
against one matrix at a time, a compiled kernel against the eager one, a ZeRO 2 partition against the
whole matrix) agree to fp32's rounding in fp32 and to the half type's in fp16 or bf16, which a Muon
step then carries into the weights and a few steps into the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# A loss after a few Muon steps of the tiny preset computed two ways (ZeRO 2's partitions against the whole
# matrices): fp32 leaves ~1e-6 of it; fp16, measured, 2.4e-5 after six steps.
_LOSSES = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 1e-3}


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


def losses_atol(method: str = "gram") -> float:
    """How far a loss may differ after a few Muon steps computed two ways (the run's own process)."""
    return _LOSSES[ns_dtype(method)]


@contextlib.contextmanager
def ns_in_fp32() -> Iterator[None]:
    """DeepSpeed's iterations in fp32 whatever the machine multiplies in half precision: where a test
    asks two computations for the same numbers rather than numbers as close as the half type allows."""
    from deepspeed.runtime.zero.muon import original_muon

    real = original_muon.ns_compute_dtype
    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    torch._dynamo.reset()  # nothing compiled for the other dtype runs inside
    try:
        yield
    finally:
        original_muon.ns_compute_dtype = real
        torch._dynamo.reset()
