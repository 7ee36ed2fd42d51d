"""Muon's update of one matrix (or a batch of matrices of one shape): Nesterov momentum, then the
orthogonalisation ``--muon_ns`` chooses.

- ``quintic``: DeepSpeed's ``muon_update`` as it is, five Newton–Schulz iterations of the fixed quintic
  (3.4445, −4.7750, 2.0315) of the Muon authors (DeepSpeed's Gram form: in fp16 on a GPU, in fp32 on
  a CPU, where :func:`install` sets it).
- ``polar_express``: the Polar Express iteration (Amsel, Persson, Musco and Gower, 2025), five quintics
  whose coefficients change from step to step, each the optimal one for the interval the singular
  values are in by then: closer to the polar factor in the same five steps. The matrix is divided by
  1.02 times its Frobenius norm first (the coefficients' safety margin), as the modded-nanogpt speedrun
  runs it; in bf16 on an accelerator, fp32 on a CPU.

Both are sized afterwards as DeepSpeed sizes its own (``sqrt(max(1, rows / cols))`` of the stored shape),
so :func:`dsgpt2.optim.muon.scale_factors` holds for either.

The momentum reaches the compiled iteration as a 0-d tensor, not a float: ``torch.compile`` guards on a
float's value, and a momentum warmed up step by step (``--muon_momentum_warmup``) would compile again at
every step. ZeRO 1 and 2 call DeepSpeed's ``muon_update`` from inside their gradient partitioning
(``deepspeed.runtime.zero.muon.original_muon.muon_update``, looked up at each call) with the group's
``ns_method`` and ``momentum``: :func:`install` puts :func:`muon_update` there, which serves DeepSpeed's
own methods through DeepSpeed's function and ``polar_express`` through this module's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

# The Polar Express coefficients for five iterations, as the modded-nanogpt speedrun and nanochat use them.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_SAFETY = 1.02
# The ``ns_method`` of a Muon group that Polar Express orthogonalises (DeepSpeed's: "gram", "standard").
POLAR_METHOD = "polar_express"

_deepspeed_update: Any = None
_betas: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def polar_express(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The Polar Express approximation of the polar factor ``U Vᵀ`` of ``G`` (``U S Vᵀ``), for each
    matrix of a batch: its singular values brought near 1 in ``steps`` iterations (at most five)."""
    if steps > len(POLAR_EXPRESS):
        raise ValueError(f"Polar Express has coefficients for {len(POLAR_EXPRESS)} iterations, not {steps}")
    dtype = torch.float32 if G.device.type == "cpu" else torch.bfloat16
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * POLAR_SAFETY + 1e-6)
    for a, b, c in POLAR_EXPRESS[:steps]:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if tall else X


def deepspeed_scale(rows: int, cols: int) -> float:
    """What DeepSpeed's ``muon_update`` multiplies an orthogonalised update of ``rows`` × ``cols`` (the
    weight's stored shape) by: ``sqrt(max(1, rows / cols))``."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


@functools.cache
def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``torch.compile``, made at its first call rather than at import (compiling imports
    torch._dynamo, which sets an environment variable importing dsgpt2 must leave alone); eager where
    the run does not compile (:func:`dsgpt2.train.engine.compile_stance`)."""
    return torch.compile(fn)


def _polar_update(grad: torch.Tensor, momentum: torch.Tensor, beta: torch.Tensor, ns_steps: int,
                  nesterov: bool) -> torch.Tensor:  # fmt: skip
    """DeepSpeed's ``muon_update`` with the Polar Express iteration: a non-finite gradient leaves the
    momentum as it was and comes back as the update, so that the loss scaler still sees the overflow."""
    dtype = grad.dtype
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    if update.ndim == 4:  # a convolution's filters, as one matrix each
        update = update.view(len(update), -1)
    rows, cols = grad.size(-2), grad.size(-1)
    update = polar_express(update, ns_steps) * deepspeed_scale(rows, cols)
    return torch.where(finite, update.to(dtype), grad.to(dtype))


# NorMuon: the decay of the second moment of each row of an orthogonalised update (nanochat's).
NORMUON_BETA2 = 0.95
NORMUON_KEY = "normuon_second_moment"  # the optimizer state that holds it, per matrix


def normuon_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of NorMuon's second moment of a matrix (or a batch) of ``shape``: one value per row of its
    longer side (the neurons of its wider layer side, whatever the layout of the weight)."""
    rows, cols = shape[-2], shape[-1]
    return (*shape[:-2], rows, 1) if rows >= cols else (*shape[:-2], 1, cols)


def normuon_state(p: torch.Tensor) -> torch.Tensor:
    """NorMuon's second moment of the weight ``p``, before its first step (float32, zeros)."""
    return torch.zeros(normuon_shape(tuple(p.shape)), dtype=torch.float32, device=p.device)


def normuon(update: torch.Tensor, second: torch.Tensor, beta2: float = NORMUON_BETA2) -> torch.Tensor:
    """NorMuon (see :func:`_normuon`), compiled."""
    return compiled(_normuon)(update, second, beta2)


def _normuon(update: torch.Tensor, second: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon (Li et al., 2025): each row of the orthogonalised ``update`` (a row of its longer side)
    divided by the root of its mean square's running average ``second`` (updated in place), then the
    whole rescaled to the Frobenius norm it had: the rows' sizes evened out, the update's size kept."""
    along = -1 if update.size(-2) >= update.size(-1) else -2
    mean_square = update.float().square().mean(dim=along, keepdim=True)
    second.lerp_(mean_square.to(second.dtype), 1 - beta2)
    step = second.float().clamp_min(1e-10).rsqrt()
    count = update.size(along)
    before = (mean_square.sum(dim=(-2, -1), keepdim=True) * count).sqrt()
    after = (mean_square * step.square()).sum(dim=(-2, -1), keepdim=True).mul(count).sqrt()
    return (update.float() * step * (before / after.clamp_min(1e-10))).to(update.dtype)


# SOAP-Muon: Shampoo's two factors of each matrix's gradient, and Adam's second moment in their eigenbasis,
# in front of the orthogonalisation (SOAP's defaults: both averages decay by 0.95, the bases are made
# again every 10 steps).
SOAP_BETA = 0.95
SOAP_EVERY = 10
SOAP_EPS = 1e-8
SOAP_KEYS = ("soap_left", "soap_right", "soap_left_basis", "soap_right_basis", "soap_second")
SOAP_STEP_KEY = "soap_step"  # the steps a matrix has taken under SOAP-Muon (an int)


def soap_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """SOAP-Muon's state of the weight ``p`` (rows × cols), before its first step: the factors
    ``E[G Gᵀ]`` (rows × rows) and ``E[Gᵀ G]`` (cols × cols), their eigenbases, and the second moment of
    the gradient turned into those bases (rows × cols); float32."""
    rows, cols = p.shape[-2], p.shape[-1]
    f32 = {"dtype": torch.float32, "device": p.device}
    return {
        "soap_left": torch.zeros(rows, rows, **f32),
        "soap_right": torch.zeros(cols, cols, **f32),
        "soap_left_basis": torch.eye(rows, **f32),
        "soap_right_basis": torch.eye(cols, **f32),
        "soap_second": torch.zeros(rows, cols, **f32),
    }


def soap_muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: Any, state: dict[str, torch.Tensor],
                     step: int, *, ns_method: str = "gram") -> torch.Tensor:  # fmt: skip
    """SOAP-Muon's update of ``grad`` (a matrix or a batch of one shape): the Nesterov momentum
    (``momentum`` updated in place) preconditioned as SOAP preconditions it — turned into the eigenbases
    of the gradient's two Shampoo factors, divided there by the root of Adam's second moment, turned back
    — then orthogonalised by ``ns_method`` and sized as Muon's. ``state`` (:func:`soap_state`, stacked
    as ``grad`` is) is updated in place; the bases are made again (an eigendecomposition, eager) at
    every ``SOAP_EVERY``-th ``step``, counted from 0. The first step, as SOAP's, only starts the factors and
    their bases (a single gradient turned into them is diagonal, and Adam's division of it a matter of
    rounding): its update is plain Muon's. Adam's bias correction is left out: it scales every entry
    alike, and the orthogonalisation undoes any scale."""
    beta = _beta(beta, momentum)
    update = compiled(_soap_factors)(grad, momentum, beta, state["soap_left"], state["soap_right"])
    if step % SOAP_EVERY == 0:
        for factor, basis in (("soap_left", "soap_left_basis"), ("soap_right", "soap_right_basis")):
            state[basis].copy_(torch.linalg.eigh(state[factor]).eigenvectors)
    if step == 0:  # one gradient in the bases of its own factors is diagonal: nothing for Adam yet
        return orthogonalise(update, ns_method).to(grad.dtype)
    update = compiled(_soap_precondition)(grad, update, state["soap_left_basis"], state["soap_right_basis"],
                                          state["soap_second"])  # fmt: skip
    return orthogonalise(update, ns_method).to(grad.dtype)


def _soap_factors(grad: torch.Tensor, momentum: torch.Tensor, beta: torch.Tensor, left: torch.Tensor,
                  right: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The momentum and the two factors updated with ``grad``; the Nesterov update returned."""
    momentum.lerp_(grad, 1 - beta)
    g = grad.float()
    left.lerp_(g @ g.mT, 1 - SOAP_BETA)
    right.lerp_(g.mT @ g, 1 - SOAP_BETA)
    return grad.lerp(momentum, beta).float()


def _soap_precondition(grad: torch.Tensor, update: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                       second: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``update`` divided by the root of the gradient's second moment in the bases ``left``, ``right``."""
    turned = left.mT @ grad.float() @ right
    second.lerp_(turned.square(), 1 - SOAP_BETA)
    return left @ ((left.mT @ update @ right) / (second.sqrt() + SOAP_EPS)) @ right.mT


def orthogonalise(update: torch.Tensor, ns_method: str) -> torch.Tensor:
    """``update`` (a matrix or a batch of one shape) orthogonalised by ``ns_method`` (Polar Express, or
    DeepSpeed's Newton–Schulz: ``gram`` or ``standard``) and sized as DeepSpeed sizes Muon's."""
    rows, cols = update.size(-2), update.size(-1)
    if ns_method == POLAR_METHOD:
        out = compiled(polar_express)(update)
    else:
        from deepspeed.runtime.zero.muon import original_muon

        fn = (
            original_muon.zeropower_via_gram_newtonschulz
            if ns_method == "gram"
            else (original_muon.zeropower_via_newtonschulz5)
        )
        out = fn(update, steps=5)
    return out * deepspeed_scale(rows, cols)


def _beta(beta: Any, like: torch.Tensor) -> Any:
    """The momentum as a 0-d float32 tensor on ``like``'s device (kept: the warmup's are few). float32
    whatever the momentum buffer's dtype (bf16 or fp16 at ZeRO 1 and 2): 0.95 in bf16 is 0.9492."""
    if isinstance(beta, torch.Tensor):
        return beta
    key = (float(beta), torch.float32, like.device)
    if key not in _betas:
        if len(_betas) > 256:
            _betas.clear()
        _betas[key] = torch.tensor(float(beta), dtype=torch.float32, device=like.device)
    return _betas[key]


def muon_update(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    beta: Any = 0.95,
    *,
    ns_steps: int = 5,
    nesterov: bool = True,
    ns_method: str = "gram",
    is_expert_group: bool = False,
    num_heads: int | None = None,
) -> torch.Tensor:
    """DeepSpeed's ``muon_update`` (its signature), ``ns_method`` ``polar_express`` added: the momentum
    ``momentum`` updated in place with ``grad``, and the orthogonalised update returned."""
    beta = _beta(beta, momentum)
    if ns_method == POLAR_METHOD:
        if num_heads is not None:
            raise ValueError("Polar Express does not orthogonalise attention heads one by one")
        return compiled(_polar_update)(grad, momentum, beta, ns_steps, nesterov)
    return _deepspeed()(grad, momentum, beta, ns_steps=ns_steps, nesterov=nesterov, ns_method=ns_method,
                        is_expert_group=is_expert_group, num_heads=num_heads)  # fmt: skip


def _deepspeed() -> Any:
    global _deepspeed_update
    if _deepspeed_update is None:
        from deepspeed.runtime.zero.muon import original_muon

        found = original_muon.muon_update
        _deepspeed_update = getattr(found, "deepspeed_update", found)
    return _deepspeed_update


def fp32_iteration(ns_method: str = "gram") -> torch.dtype:
    """What DeepSpeed's ``ns_compute_dtype`` answers on a CPU once :func:`install` ran: fp32, for every
    method."""
    return torch.float32


def install() -> None:
    """Put :func:`muon_update` where ZeRO 1 and 2 look DeepSpeed's up (once; DeepSpeed's methods still
    run DeepSpeed's function); on a CPU, DeepSpeed's iterations in fp32.

    DeepSpeed runs its Gram iteration in fp16 wherever the accelerator multiplies fp16 matrices, a CPU
    with AVX512-FP16 or AMX-FP16 included, and its standard one in bf16 on any CPU. On such a CPU fp16
    was no faster (one thread, a batch of each of a preset's four shapes: the tiny preset's 1.9 times fp32's
    time, 4 × 128's 1.1 times, 112m's 0.93-0.99; bench/results/ns-dtype-cpu-2026-12-06.txt), and a
    run's model would depend on the CPU it ran on.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon import original_muon

    if original_muon.muon_update is not muon_update:
        muon_update.deepspeed_update = _deepspeed()  # type: ignore[attr-defined]
        original_muon.muon_update = muon_update
    if get_accelerator().device_name() == "cpu":
        original_muon.ns_compute_dtype = fp32_iteration
