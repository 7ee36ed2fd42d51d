"""Muon's update of one matrix (or a batch of matrices of one shape): Nesterov momentum, then the
orthogonalisation ``--muon_ns`` chooses.

- ``quintic``: DeepSpeed's ``muon_update`` as it is, five Newton–Schulz iterations of the fixed quintic
  (3.4445, −4.7750, 2.0315) of the Muon authors (DeepSpeed's Gram form, in fp32 on a CPU).
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
    update = polar_express(update, ns_steps) * (math.sqrt(rows / cols) if rows > cols else 1.0)
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


def install() -> None:
    """Put :func:`muon_update` where ZeRO 1 and 2 look DeepSpeed's up (once; DeepSpeed's methods still
    run DeepSpeed's function)."""
    from deepspeed.runtime.zero.muon import original_muon

    if original_muon.muon_update is not muon_update:
        muon_update.deepspeed_update = _deepspeed()  # type: ignore[attr-defined]
        original_muon.muon_update = muon_update
