"""A ZeRO 1/2 checkpoint in DeepSpeed's universal form: what lets a run resume on another number of ranks.

ZeRO 1 and 2 save the fp32 master weights and the optimizer state as one flat partition per rank; a
partition only fits the number of ranks that cut it. The universal form holds each parameter whole, one
file per state (``zero/<name>/fp32.pt``, ``exp_avg.pt``, Muon's ``momentum_buffer.pt``...), and DeepSpeed
loads it into any number of ranks (``checkpoint.load_universal``: each rank takes its slice).

DeepSpeed's converter (``deepspeed.checkpoint.ds_to_universal``) names AdamW's two moments and nothing
else, so Muon's momentum would be lost; this one carries every per-element state the optimizer keeps,
for a model without tensor or pipeline parallelism (dsgpt2's). The form is written once, beside its
checkpoint (``global_stepN.universal``), through a temporary directory renamed when complete: a
conversion that dies part-way leaves nothing that could be loaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from dsgpt2.checkpoints.format import (
    COMPLETE,
    UNIVERSAL,
    damage,
    file_digests,
    model_states_file,
    read_marker,
    sealed,
)
from dsgpt2.errors import CheckpointError
from dsgpt2.files import atomic_write_text

log = logging.getLogger(__name__)

# DeepSpeed's names for the parts of a checkpoint (deepspeed.checkpoint.constants), as it writes them.
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
PARAM_SHAPES = "param_shapes"
PARAM_GROUPS = "param_groups"
ZERO_STAGE = "zero_stage"
PARAM = "param"
_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def universal_tag(tag: str) -> str:
    """The tag of ``tag``'s universal form, beside it in the same directory."""
    return tag + UNIVERSAL


def saved_zero_stage(ckpt_dir: Path, tag: str) -> int:
    """The ZeRO stage a partitioned checkpoint was saved under (read from rank 0's shard), whatever the
    DeepSpeed config of the run resuming it says (``ds_config.zero_stage``)."""
    shards = _shards(ckpt_dir / tag)
    if not shards:
        return 0
    try:
        state = torch.load(shards[0], map_location="cpu", weights_only=False, mmap=True)
        return _stage(state[OPTIMIZER_STATE_DICT])
    except Exception as exc:  # a damaged file fails in torch's zip reader or in unpickling
        raise CheckpointError(f"{shards[0]} cannot be read ({str(exc).strip()[:200]})") from None


def ensure_universal(ckpt_dir: Path, tag: str) -> str:
    """The universal form of the complete checkpoint ``tag`` of ``ckpt_dir``: made now unless an intact
    one is there already. Returns its tag (to load from ``ckpt_dir`` with ``load_universal``).

    Raises:
        CheckpointError: the checkpoint is not one of ZeRO 1 or 2, or its shards do not add up.
    """
    out = universal_tag(tag)
    if damage(ckpt_dir, out) is None:
        log.info("resuming from %s, the universal form of %s made before", ckpt_dir / out, tag)
        return out
    started = time.monotonic()
    tmp = ckpt_dir / f".{out}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert(ckpt_dir / tag, tmp)
        step = (read_marker(ckpt_dir, tag) or {}).get("step")
        marker = sealed({"step": step, "from": tag, "time": time.time(), "files": file_digests(tmp)})
        atomic_write_text(tmp / COMPLETE, json.dumps(marker, indent=1) + "\n")
        shutil.rmtree(ckpt_dir / out, ignore_errors=True)
        tmp.rename(ckpt_dir / out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "converted %s to DeepSpeed's universal form for another number of ranks: %s (%.1fs)",
        ckpt_dir / tag, ckpt_dir / out, time.monotonic() - started,
    )  # fmt: skip
    return out


def convert(src: Path, dst: Path) -> None:
    """Write the universal form of the ZeRO 1/2 checkpoint directory ``src`` into ``dst``."""
    shards = _shards(src)
    if not shards:
        raise CheckpointError(f"{src} holds no ZeRO optimizer shards to convert")
    shapes = _param_shapes(src)
    parts: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    whole_states: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    steps: dict[str, Any] = {}
    common: dict[str, Any] = {}
    for n, path in enumerate(shards):
        osd = torch.load(path, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT]
        stage = _stage(osd)
        base = osd[BASE_OPTIMIZER_STATE]
        if stage not in (1, 2) or not isinstance(base, dict):
            why = "only ZeRO 1 and 2 are converted" if stage not in (1, 2) else "with elastic_checkpoint"
            raise CheckpointError(
                f"{src} was saved under ZeRO stage {stage} ({why}): resume it on its own ranks"
            )
        if n == 0:
            skip = {BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS}
            common = {k: v for k, v in osd.items() if k not in skip}
            common[PARAM_GROUPS] = base[PARAM_GROUPS]
        fp32 = osd[SINGLE_PARTITION_OF_FP32_GROUPS]
        for group, mapping in enumerate(osd[PARAM_SLICE_MAPPINGS]):
            state = dict(base["state"].get(group, {}))
            for key in _whole_states():
                if (kept := state.pop(key, None)) is not None:
                    for name, whole in _whole_tensors(kept, mapping, shapes, path):
                        whole_states[name].setdefault(key, whole)
            flat = {"fp32": fp32[group]}
            # Per-element state spans the partition (with its padding, at the end of the last rank's).
            flat.update(
                {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1 and k != "step"}
            )
            for name, fragment in mapping.items():
                for key, tensor in flat.items():
                    parts[name][key].append(tensor.narrow(0, fragment.start, fragment.numel).clone())
                if "step" in state:
                    steps[name] = state["step"]
    zero = dst / "zero"
    for name, states in parts.items():
        shape = shapes.get(name)
        if shape is None:
            raise CheckpointError(f"{src}: the shards hold {name!r}, which the model states do not list")
        (zero / name).mkdir(parents=True, exist_ok=True)
        for key, fragments in states.items():
            whole = torch.cat(fragments)
            if whole.numel() != shape.numel():
                raise CheckpointError(
                    f"{src}: the shards hold {whole.numel()} values of {name!r} ({key}), its shape "
                    f"{tuple(shape)} {shape.numel()}; a shard is missing or from another save"
                )
            torch.save({PARAM: whole.view(shape)}, zero / name / f"{key}.pt")
        for key, whole in whole_states.get(name, {}).items():
            torch.save({PARAM: whole.view(shape)}, zero / name / f"{key}.pt")
        if name in steps:
            torch.save(steps[name], zero / name / "step.pt")
    missing = sorted(set(shapes) - set(parts))
    if missing:
        raise CheckpointError(f"{src}: no shard holds {', '.join(missing[:3])}; a shard is missing")
    torch.save(common, zero / "optimizer_state.pt")
    for path in src.iterdir():
        if path.is_file() and not _SHARD.match(path.name) and path.name != COMPLETE:
            shutil.copy2(path, dst / path.name)


def _whole_states() -> set[str]:
    """The states the registered optimizers keep whole per parameter (Muon's momentum)."""
    from dsgpt2.optim.optimizers import OPTIMIZERS

    return {key for _, optimizer in OPTIMIZERS.items() for key in optimizer.whole_states}


def _whole_tensors(
    buffer: torch.Tensor, mapping: dict[str, Any], shapes: dict[str, torch.Size], path: Path
) -> list[tuple[str, torch.Tensor]]:
    """Muon's momentum of one rank's group, cut into its parameters. It is not laid out as the
    partition: it holds each parameter the partition touches whole (a matrix needs all of its momentum
    to be orthogonalised), one after the other, so a matrix split between two ranks is in both."""
    sizes = [(name, shapes[name].numel()) for name in mapping]
    if sum(n for _, n in sizes) != buffer.numel():
        raise CheckpointError(f"{path}: Muon's momentum holds {buffer.numel()} values, not its parameters'")
    out, start = [], 0
    for name, n in sizes:
        out.append((name, buffer.narrow(0, start, n).clone()))
        start += n
    return out


def restore_whole_states(optimizer: Any, folder: Path) -> None:
    """After DeepSpeed loaded a universal form into a ZeRO 1/2 ``optimizer``: the states an optimizer keeps
    whole per parameter (Muon's momentum) laid out as its step reads them (each parameter this rank's
    partition touches, whole: see :func:`_whole_tensors`), where DeepSpeed's loader laid them out as the
    partition. A no-op where the groups hold none."""
    state = optimizer.optimizer.state
    for group, params in enumerate(getattr(optimizer, "params_in_partition", [])):
        flat = optimizer.optimizer.param_groups[group]["params"][0]
        for key in _whole_states() & set(state.get(flat, {})):
            wholes = []
            for p in params:
                saved = folder / "zero" / optimizer.param_names[p] / f"{key}.pt"
                wholes.append(torch.load(saved, map_location="cpu", weights_only=False)[PARAM].flatten())
            held = state[flat][key]
            state[flat][key] = torch.cat(wholes).to(dtype=held.dtype, device=held.device)


def _stage(osd: dict[str, Any]) -> int:
    """The ZeRO stage one shard's optimizer state records (DeepSpeed writes it into every shard)."""
    return int(osd.get(ZERO_STAGE, 0))


def _shards(directory: Path) -> list[Path]:
    """The optimizer shards of a checkpoint directory, in the order of their data-parallel rank."""
    found = [(int(m.group(1)), p) for p in directory.glob("*optim_states.pt") if (m := _SHARD.match(p.name))]
    return [p for _, p in sorted(found)]


def _param_shapes(src: Path) -> dict[str, torch.Size]:
    """Every parameter's shape, by the name the shards use, from the model states file."""
    states = torch.load(model_states_file(src.parent, src.name), map_location="cpu", weights_only=False)
    groups = states.get(PARAM_SHAPES) or []
    return {name: torch.Size(shape) for group in groups for name, shape in group.items()}
