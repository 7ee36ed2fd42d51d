"""Memory planning: what a preset needs per GPU and in CPU memory under each ZeRO choice.

Counts parameters from the architecture (no model is built), then asks
DeepSpeed's own estimators for ZeRO-2 and ZeRO-3; stage 0/1 follow the same
accounting (mixed-precision Adam: 2 + 2 bytes of weights and gradients, 12
bytes of fp32 master weights and moments per parameter). These are model
states only: activations come on top and grow with micro-batch and context.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsgpt2.accelerator import prepare_deepspeed_environment
from dsgpt2.model import PRESETS


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


def plan_lines(preset: str, total: int, rows: list[PlanRow], gpus_per_node: int, nodes: int) -> list[str]:
    gib = 1024**3
    out = [
        f"{preset}: {total / 1e6:.0f}M parameters; model states on {nodes} node(s) × {gpus_per_node} GPU(s) "
        "(activations not included)",
        f"  {'option':<48} {'per GPU':>10} {'CPU per node':>14}",
    ]
    for r in rows:
        out.append(f"  {r.option:<48} {r.gpu_bytes / gib:>8.2f} GB {r.cpu_bytes / gib:>11.2f} GB")
    out.append(
        "  configs: ds_config.json (stage 1, bf16), ds_config_fp16.json, ds_config_zero2_offload.json, "
        "ds_config_zero3_offload.json, ds_config_cpu.json (CPU, fp32)"
    )
    return out
