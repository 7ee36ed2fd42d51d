"""Next-token cross-entropy over the LM head, a chunk of tokens at a time.

transformers' causal-LM loss projects every position onto the vocabulary and upcasts the whole
``B × T × V`` logits tensor to float32 (3.3 GB for a 16 × 1,024 micro-batch at GPT-2's 50,257 tokens),
and autograd keeps it for the backward pass. Here a chunk of ``chunk`` tokens is projected, its loss
taken in float32, and, when gradients are wanted, its gradient with respect to the hidden states and
the head's weight computed at once (softmax minus one-hot: the standard cross-entropy gradient); then
the chunk's logits are freed. What the backward pass keeps is the gradients themselves: ``B × T × d``
and ``V × d`` (float32). The loss, and the gradients, equal transformers' to float rounding: each
chunk's logits are the same matmul in the model's dtype, upcast before the softmax.

:func:`with_chunked_loss` gives a ``GPT2LMHeadModel`` this loss for calls with ``labels`` (the
trainer's, ``dsgpt2 evaluate``'s and validation's), leaving the class, its weights and its state dict
as they are; a call without labels (generation, HellaSwag) is transformers' own forward. Under
``torch.compile`` (``compiled=True``) the chunks are traced into the model's graph: one compiled region
per micro-batch instead of a graph break and a few dozen eager dispatches per chunk, and, the chunks
unrolled in order, the same memory (only a chunk's logits at a time) as eager.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from dsgpt2.data.packing import IGNORE


class _ChunkedNLL(torch.autograd.Function):
    """Summed NLL of ``targets`` (N,) under ``hidden`` (N, d) @ ``weight`` (V, d).T, chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> Any:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for start in range(0, hidden.size(0), chunk):
            h = hidden[start : start + chunk]
            y = targets[start : start + chunk]
            logits = (h @ weight.t()).float()
            counted = y != IGNORE
            safe = torch.where(counted, y, torch.zeros_like(y))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            # Out of place: the Function's output mutated in place loses its gradient under
            # torch.compile on torch 2.11 (the eager gradients on 2.13), silently.
            total = total + torch.where(counted, lse - picked, torch.zeros_like(lse)).sum()
            if not (want_h or want_w):
                continue
            # d(lse - picked)/d logits = softmax - one-hot, zero on uncounted rows; in place on logits.
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(len(y), device=y.device), safe] -= 1.0
            grad.mul_(counted[:, None])
            grad = grad.to(hidden.dtype)
            if grad_h is not None:
                grad_h[start : start + chunk] = grad @ weight
            if grad_w is not None:
                grad_w += (grad.t() @ h).float()
            del logits, grad
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> Any:
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad_total.to(grad_h.dtype)
        dw = None if grad_w is None else (grad_w * grad_total).to(ctx.weight_dtype)
        return dh, dw, None, None


def lm_head_nll(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> Any:
    """Summed next-token NLL (float32) of ``labels`` (B, T) given the final hidden states (B, T, d) and
    the head's ``weight`` (V, d), and how many tokens it counts: position t predicts t + 1, labels
    equal to IGNORE are skipped."""
    d = hidden.size(-1)
    h = hidden[:, :-1].reshape(-1, d)
    y = labels[:, 1:].reshape(-1).to(h.device)
    return _ChunkedNLL.apply(h, weight, y, chunk), (y != IGNORE).sum()


_EAGER_NLL: list[Any] = []  # lm_head_nll kept out of torch.compile, made on first use


def _chunked_forward(self: Any, *args: Any, labels: Any = None, nll_sum: bool = False, **kwargs: Any) -> Any:
    """``GPT2LMHeadModel.forward`` with the chunked loss where labels are given; ``loss`` is the mean
    over counted tokens (0 where none counts), or the sum with ``nll_sum``. No logits then."""
    if labels is None:
        return type(self).forward(self, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    kwargs.pop("logits_to_keep", None)
    hidden = self.transformer(*args, **kwargs).last_hidden_state
    nll_of = lm_head_nll if self.loss_in_graph else _EAGER_NLL[0]
    nll, n = nll_of(hidden, self.lm_head.weight, labels, self.loss_chunk)
    return CausalLMOutputWithCrossAttentions(loss=nll if nll_sum else nll / n.clamp(min=1))


def with_chunked_loss(model: Any, chunk: int, compiled: bool = False) -> Any:
    """``model`` (a ``GPT2LMHeadModel``) computing its labelled loss in chunks of ``chunk`` tokens;
    0 leaves it as it is (transformers' loss over the whole logits). ``compiled``: the model will run
    under ``torch.compile``, which then traces the loss too (else it stays eager)."""
    if chunk > 0:
        if not _EAGER_NLL:
            # Left out of torch.compile: eager chunks, as transformers' loss is. Wrapped here, not
            # at import: torch.compiler.disable imports torch._dynamo, which sets an environment
            # variable (TORCHINDUCTOR_CACHE_DIR) that importing dsgpt2 must leave alone.
            _EAGER_NLL.append(torch.compiler.disable(lm_head_nll))
        model.loss_chunk = chunk
        model.loss_in_graph = compiled
        model.forward = types.MethodType(_chunked_forward, model)
    return model


def chunked(model: Any) -> bool:
    """Whether ``model``, or the model a DeepSpeed engine wraps, computes the chunked loss."""
    return getattr(getattr(model, "module", model), "loss_chunk", 0) > 0
