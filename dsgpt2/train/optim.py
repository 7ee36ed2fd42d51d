"""The optimizer a run trains with: the DeepSpeed config's AdamW, or Muon on the blocks' matrices.

Muon (Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks") is SGD with
momentum whose update is orthogonalised by a few Newton–Schulz iterations: every direction of a
weight matrix moves at the same rate. It is for the 2-D weights of the hidden layers; the embeddings,
the head, the biases and the norms stay with AdamW, as its authors prescribe. DeepSpeed's
``MuonWithAuxAdam`` does both in one optimizer under ZeRO 0, 1 and 2 (at ZeRO 1 and 2 the whole
matrices' gradients are orthogonalised before they are partitioned), its state saved and loaded by
the engine like AdamW's. It is built here, from the DeepSpeed config's AdamW settings, rather than from
an ``optimizer`` block of type Muon: DeepSpeed's own choice of the Muon weights takes every matrix
whose name lacks "embed", which puts GPT-2's token and position embeddings (``wte``, ``wpe``) under
Muon.
"""

from __future__ import annotations

import logging
from typing import Any

from dsgpt2.errors import ConfigError
from dsgpt2.model.gpt2 import param_groups

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "muon")
# Muon's defaults: the learning rate of the modded-nanogpt speedrun's first Muon records and of
# DeepSpeed's MuonWithAuxAdam, the momentum of the Muon paper (Nesterov, as both apply it).
MUON_LR = 0.02
MUON_MOMENTUM = 0.95


def is_hidden_matrix(name: str, param: Any) -> bool:
    """A weight Muon trains: a 2-D weight of a transformer block (attention's and the MLP's
    projections), never the embeddings, the head, a bias or a norm."""
    return param.dim() == 2 and name.startswith("transformer.h.") and not name.endswith(".bias")


def muon_param_groups(
    model: Any, adamw: dict[str, Any], lr: float, muon_lr: float, momentum: float
) -> list[dict[str, Any]]:
    """``MuonWithAuxAdam``'s groups: the hidden matrices under Muon (``muon_lr``, ``momentum``, no weight
    decay, as in the speedrun), every other weight under AdamW (``adamw``: the DeepSpeed config's
    ``optimizer.params``; ``lr``: its peak; decay on the embeddings only, as :func:`param_groups`).
    Each group's ``lr_scale`` is its peak ÷ ``lr``: the schedule sets ``lr × curve × lr_scale``.
    Tied weights appear once."""
    hidden = {id(p) for name, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(name, p)}
    betas = tuple(adamw.get("betas", (0.9, 0.999)))
    eps = float(adamw.get("eps", 1e-8))
    groups: list[dict[str, Any]] = []
    for group in param_groups(model, float(adamw.get("weight_decay", 0.0))):
        rest = [p for p in group["params"] if id(p) not in hidden]
        if rest:
            groups.append({"params": rest, "use_muon": False, "lr": lr, "betas": betas, "eps": eps,
                           "weight_decay": group["weight_decay"], "lr_scale": 1.0})  # fmt: skip
    # Last: the first group's rate is the run's logged one (--lr's curve).
    muon = [p for p in model.parameters() if id(p) in hidden]
    groups.append({"params": muon, "use_muon": True, "lr": muon_lr, "momentum": momentum,
                   "weight_decay": 0.0, "lr_scale": muon_lr / lr})  # fmt: skip
    # ZeRO 1 and 2 ask each parameter, not its group, whether Muon steps it.
    for group in groups:
        for p in group["params"]:
            p.use_muon = group["use_muon"]
    return groups


def check_optimizer(optimizer: str, ds_config: dict[str, Any]) -> None:
    """Refuse a DeepSpeed config ``optimizer`` cannot train under, before anything is built.

    Raises:
        ConfigError: Muon under ZeRO stage 3, or with a DeepSpeed config whose optimizer is not AdamW.
    """
    from dsgpt2.train.ds_config import zero_stage

    if optimizer != "muon":
        return
    if zero_stage(ds_config) == 3:
        raise ConfigError(
            "--optimizer muon trains under ZeRO stage 0, 1 or 2: ZeRO 3 shards each matrix across the "
            "ranks, and Muon orthogonalises whole ones. Use a stage 2 config (configs/ds_config.json) "
            "or --optimizer adamw"
        )
    kind = str((ds_config.get("optimizer") or {}).get("type", "AdamW"))
    if kind.lower() not in ("adamw", "adam"):
        raise ConfigError(
            f"--optimizer muon takes its AdamW settings from the DeepSpeed config's optimizer, which is "
            f"{kind}: set its type to AdamW"
        )


def build_muon(
    model: Any, ds_config: dict[str, Any], lr: float, muon_lr: float | None, momentum: float | None
) -> Any:
    """The Muon optimizer of ``model`` (AdamW's part from ``ds_config``'s optimizer, ``lr`` its peak),
    and ``ds_config`` made to suit it (in place): its ``optimizer`` block dropped (the engine is handed
    this one), and gradient clipping off.

    Gradient clipping is off because ZeRO 1 and 2 clip after the Muon update is made (the global norm
    of orthogonalised updates, about 27 times the raw gradients' at the first step of the tiny
    model), which would scale every Muon step down by that factor and make ZeRO 0 and ZeRO 2 train
    different models; Muon's update has a fixed size whatever the gradient's.
    """
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from torch.optim import AdamW

    from dsgpt2.train.ds_config import zero_stage

    check_optimizer("muon", ds_config)
    block = ds_config.pop("optimizer", None) or {}
    if clip := ds_config.get("gradient_clipping"):
        log.info("Muon: gradient clipping (%s in the DeepSpeed config) is off", clip)
    ds_config["gradient_clipping"] = 0.0
    muon_lr = MUON_LR if muon_lr is None else muon_lr
    momentum = MUON_MOMENTUM if momentum is None else momentum
    groups = muon_param_groups(model, block.get("params") or {}, lr, muon_lr, momentum)
    optimizer = MuonWithAuxAdam(groups, adam_optimizer=AdamW)
    n_muon = sum(p.numel() for p in groups[-1]["params"])
    n_all = sum(p.numel() for g in groups for p in g["params"])
    log.info(
        "optimizer: Muon (lr %g, momentum %g) on %.1fM weights of the blocks' matrices, AdamW (lr %g) on "
        "the other %.1fM; ZeRO stage %d",
        muon_lr, momentum, n_muon / 1e6, lr, (n_all - n_muon) / 1e6, zero_stage(ds_config),
    )  # fmt: skip
    return optimizer
