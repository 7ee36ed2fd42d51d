"""Memory planning: what a preset needs per GPU and in CPU memory under each ZeRO choice.

Counts parameters from the architecture (no model is built), then asks
DeepSpeed's own estimators for ZeRO-2 and ZeRO-3; stage 0/1 follow the same
accounting (mixed-precision Adam: 2 + 2 bytes of weights and gradients, 12
bytes of fp32 master weights and moments per parameter). These are model
states only: activations come on top and grow with micro-batch and context.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from unittest import mock

from dsgpt2.accelerator import prepare_deepspeed_environment
from dsgpt2.model.gpt2 import PRESETS


def gpt2_parameters(n_layer: int, n_embd: int, vocab: int, context: int) -> tuple[int, int]:
    """(total parameters, largest layer) of a GPT-2 with tied embeddings."""
    embeddings = vocab * n_embd + context * n_embd
    # Per block: attention qkv (3d² + 3d) and projection (d² + d), MLP (8d² + 5d), two layer norms (4d).
    per_block = 12 * n_embd**2 + 13 * n_embd
    total = embeddings + n_layer * per_block + 2 * n_embd
    return total, vocab * n_embd


@dataclass
class PlanRow:
    option: str
    gpu_bytes: float
    cpu_bytes: float


def plan(
    preset: str, vocab: int = 50257, gpus_per_node: int = 1, nodes: int = 1
) -> tuple[int, list[PlanRow]]:
    """Parameters of ``preset`` and the memory rows, one per ZeRO/offload option."""
    prepare_deepspeed_environment()
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    p = PRESETS[preset]
    total, largest = gpt2_parameters(p.n_layer, p.n_embd, vocab, p.context)
    world = gpus_per_node * nodes
    buffer = 1.5
    rows = [
        PlanRow("stage 0 (data parallel)", 16 * total, 0),
        PlanRow("stage 1 (optimizer states sharded)", 4 * total + 12 * total / world, 0),
    ]
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, offload, buffer)
        rows.append(PlanRow(f"stage 2{' + optimizer offload' if offload else ''}", gpu, cpu))
    for offload, params in ((False, False), (True, False), (True, True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total, largest, gpus_per_node, nodes, offload, params, True, buffer
        )
        label = (
            "stage 3" + (" + optimizer offload" if offload else "") + (" + param offload" if params else "")
        )
        rows.append(PlanRow(label, gpu, cpu))
    return total, rows


def plan_lines(
    preset: str,
    total: int,
    rows: list[PlanRow],
    gpus_per_node: int,
    nodes: int,
    *,
    act: Activations | None = None,
    shape: tuple[int, int] = (0, 0),
    gpu_memory: float = 80.0,
) -> list[str]:
    """The table ``dsgpt2 plan`` prints; with ``act`` (a micro-batch of ``shape`` = (micro-batch,
    context)), the activations, the total per GPU and the largest micro-batch in ``gpu_memory`` GB."""
    gib = 1024**3
    out = [f"{preset}: {total / 1e6:.0f}M parameters on {nodes} node(s) × {gpus_per_node} GPU(s)"]
    if act is None:
        out[0] += " (model states; activations not included)"
        out.append(f"  {'option':<48} {'per GPU':>10} {'CPU per node':>14}")
        for r in rows:
            out.append(f"  {r.option:<48} {r.gpu_bytes / gib:>8.2f} GB {r.cpu_bytes / gib:>11.2f} GB")
    else:
        micro, context = shape
        out.append(
            f"  activations of a micro-batch of {micro} × {context} tokens (bf16, eager): "
            f"{act.saved / gib:.2f} GB kept for backward + {act.working / gib:.2f} GB working"
        )
        fits = f"micro in {gpu_memory:g} GB"
        head = f"{'states':>9} {'+ activ.':>9} {'per GPU':>9} {'CPU/node':>9} {fits:>16}"
        out.append(f"  {'option':<44} {head}")
        for r in rows:
            room = LEFT_FREE * gpu_memory * gib - r.gpu_bytes - act.fixed
            largest = max(0, int(room // act.per_micro_row))
            out.append(
                f"  {r.option:<44} {r.gpu_bytes / gib:>6.2f} GB {act.total / gib:>6.2f} GB "
                f"{(r.gpu_bytes + act.total) / gib:>6.2f} GB {r.cpu_bytes / gib:>6.2f} GB "
                f"{largest if largest else 'none':>16}"
            )
        out.append(
            f"  largest micro-batch: at context {context}, with {1 - LEFT_FREE:.0%} of the GPU left to the "
            "allocator; torch.compile keeps fewer activations than eager"
        )
    out.append(
        "  configs: ds_config.json (stage 0, bf16 autocast), ds_config_fp16.json, "
        "ds_config_zero2_offload.json, ds_config_zero3_offload.json, ds_config_cpu.json (CPU, fp32)"
    )
    return out


LEFT_FREE = 0.9  # the share of a GPU's memory a plan fills: the caching allocator's fragmentation


@dataclass
class Activations:
    """What a micro-batch adds on top of the model states, per GPU (bytes)."""

    saved: float  # tensors kept for backward, at the end of the forward
    working: float  # the largest transient: a chunk of logits in the loss, a layer recomputed
    per_micro_row: float  # saved + working per sequence of the micro-batch (for fitting)
    fixed: float  # saved + working that do not grow with the micro-batch

    @property
    def total(self) -> float:
        return self.saved + self.working


def activations(
    preset: str,
    vocab: int,
    context: int,
    micro_batch: int,
    checkpointing: bool = False,
    *,
    loss_chunk: int = 0,
    probe_tokens: int = 32,
) -> Activations:
    """The activation memory of one micro-batch of ``micro_batch`` × ``context`` tokens in bf16 (eager).

    Measured, not modelled: the bytes autograd keeps for backward are counted (on fake tensors: nothing
    is computed) for the preset's own blocks (1 and 2 layers, ``probe_tokens`` and twice as many tokens),
    then scaled linearly to its layers and the micro-batch's tokens; the recomputed layer (checkpointing)
    and the chunked loss's logits (``loss_chunk`` tokens × vocabulary, in bf16 and float32) come on top.
    torch.compile keeps fewer tensors than eager.
    """
    layers = PRESETS[preset].n_layer
    one = _saved_bytes(preset, vocab, 1, probe_tokens, checkpointing, chunk=loss_chunk)
    per_layer = _saved_bytes(preset, vocab, 2, probe_tokens, checkpointing, chunk=loss_chunk) - one
    doubled = _saved_bytes(preset, vocab, 1, 2 * probe_tokens, checkpointing, chunk=loss_chunk) - one
    per_token = (doubled - per_layer) / probe_tokens  # outside the blocks: embeddings, final norm, loss
    per_token_layer = per_layer / probe_tokens
    fixed = one - probe_tokens * (per_token + per_token_layer)  # e.g. the head's float32 gradient
    tokens = micro_batch * context
    per_row = context * (per_token + layers * per_token_layer)
    working_fixed = 6.0 * min(loss_chunk, tokens) * vocab if loss_chunk else 0.0
    working_row = 0.0 if loss_chunk else 6.0 * context * vocab  # transformers' loss: bf16 + float32 logits
    if checkpointing:  # backward recomputes one block, whole
        full = _saved_bytes(preset, vocab, 2, probe_tokens, False, chunk=loss_chunk) - _saved_bytes(
            preset, vocab, 1, probe_tokens, False, chunk=loss_chunk
        )
        working_row += context * full / probe_tokens
    return Activations(
        saved=fixed + micro_batch * per_row,
        working=working_fixed + micro_batch * working_row,
        per_micro_row=per_row + working_row,
        fixed=fixed + working_fixed,
    )


@functools.lru_cache(maxsize=16)
def _saved_bytes(
    preset: str, vocab: int, layers: int, tokens: int, checkpointing: bool, *, chunk: int, rows: int = 1
) -> float:
    """Bytes of the tensors autograd keeps for backward after one forward of ``rows`` sequences of
    ``tokens`` tokens through ``preset``'s width with ``layers`` blocks (bf16, parameters not counted).

    The forward runs on fake tensors: every operator is dispatched as on the CPU (the same attention
    kernel, the same tensors saved), but only shapes and dtypes are computed, so a probe costs the same
    on a CPU without fast bf16 arithmetic as on one with it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsgpt2.model.gpt2 import build_model, checkpoint_activations, gpt2_config
    from dsgpt2.model.loss import with_chunked_loss

    cfg = gpt2_config(preset, vocab, tokens, 0, 0)
    cfg.n_layer = layers
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):  # shapes only: no weights drawn
        model = build_model(cfg).to(torch.bfloat16)
    with_chunked_loss(model, chunk)
    if checkpointing:
        checkpoint_activations(model)
    model.train()
    kept: dict[int, int] = {}
    with FakeTensorMode():
        on_cpu: dict[int, torch.Tensor] = {}  # one per tensor: the tied head and embedding stay one
        state = {}
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) not in on_cpu:
                like = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                on_cpu[id(t)] = like.requires_grad_(t.requires_grad)
            state[name] = on_cpu[id(t)]
        params = {on_cpu[id(p)].untyped_storage()._cdata for p in model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in params:
                kept[storage._cdata] = storage.nbytes()
            return t

        ids = torch.zeros(rows, tokens, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _one_sequence_per_row():
            # As the trainer calls it (model.gpt2.batch_inputs): no cache, no attention mask (transformers
            # drops an all-ones one after reading it, which fake tensors cannot: it would keep the
            # (tokens × tokens) mask a causal kernel does without).
            inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
            torch.func.functional_call(model, state, (), inputs)
    return float(sum(kept.values()))


def _one_sequence_per_row() -> contextlib.AbstractContextManager:
    """transformers looks for sequences packed in a row in the position ids, and cannot read fake ones: it
    would build the (tokens × tokens) mask that real ids, one sequence a row, let it leave out."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
