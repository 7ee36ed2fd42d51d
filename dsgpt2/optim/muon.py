"""Muon on the blocks' matrices, AdamW on the other weights: the ``muon`` optimizer of a run.

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

Each orthogonalised update is sized for its layer by ``--muon_scale``. DeepSpeed's ``muon_update``
multiplies it by ``sqrt(max(1, rows / cols))`` of the weight *as stored*, a rule written for
``nn.Linear``'s (out, in) layout; GPT-2's ``Conv1D`` stores (in, out), so that rule would give the MLP's
expanding ``c_fc`` ×1 and its contracting ``c_proj`` ×2, the reverse of the layer's. The rule here is
computed from the layer's (fan-out, fan-in) and applied as a per-group factor on the learning rate
(each group's ``lr_scale``) divided by what DeepSpeed multiplies in: it holds at ZeRO 0, 1 and 2, where
DeepSpeed orthogonalises, and needs nothing of its internals. The weight decay is divided by the same
factor, so every matrix decays by the same ``lr × weight decay`` (decoupled: on the weights, not the
gradient, as AdamW and the Muon authors apply it).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from dsgpt2.errors import ConfigError
from dsgpt2.model.gpt2 import param_groups
from dsgpt2.optim.ds_config import EngineConfig, zero_stage
from dsgpt2.optim.optimizer import OPTIMIZERS, RunOptimizer
from dsgpt2.optim.schedule import MOMENTUM_START, momentum_at
from dsgpt2.settings.options import NON_NEGATIVE_INT, POSITIVE_NUMBER, Checked, Range, option

log = logging.getLogger(__name__)

# Muon's defaults: the learning rate of the modded-nanogpt speedrun's first Muon records and of
# DeepSpeed's MuonWithAuxAdam, the momentum of the Muon paper (Nesterov, as both apply it).
MUON_LR = 0.02
MUON_MOMENTUM = 0.95
# The optimizer-state key DeepSpeed's MuonWithAuxAdam keeps a matrix's momentum under: the batched step
# keeps it there too, and the universal form of a checkpoint carries it (dsgpt2.checkpoints.universal).
MUON_MOMENTUM_KEY = "momentum_buffer"
# How large each matrix's update is (see muon_scale); "storage" is DeepSpeed's rule on the weight as
# stored, what runs trained before the choice existed used (their checkpoints resume with it).
SCALES = ("spectral", "rms", "storage")
# Chosen by `make bench` suite `recipe` (docs/training/optimizers.md): rms trained the better model on
# both corpora at 4 x 128 (held-out perplexity 94.6 and 43.1 against spectral's 99.5 and 47.3).
MUON_SCALE = "rms"
MUON_WEIGHT_DECAY = 0.0
# The orthogonalisation (--muon_ns): DeepSpeed's fixed quintic, or Polar Express (dsgpt2.optim.muon_update),
# by the ``ns_method`` a Muon group carries.
NS_METHODS = {"quintic": "gram", "polar_express": "polar_express"}
MUON_NS = "quintic"


def layer_shape(module: Any) -> tuple[int, int] | None:
    """The (fan-out, fan-in) of a linear layer, whatever the layout of its weight: ``nn.Linear`` stores
    (out, in), GPT-2's ``Conv1D`` (in, out). None for any other module."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        fan_in, fan_out = module.weight.shape
        return fan_out, fan_in
    if isinstance(module, torch.nn.Linear):
        fan_out, fan_in = module.weight.shape
        return fan_out, fan_in
    return None


def muon_scale(rule: str, fan_out: int, fan_in: int) -> float:
    """The factor on an orthogonalised update of a (fan-out × fan-in) layer under ``rule``:

    - ``spectral``: ``sqrt(max(1, fan_out / fan_in))`` (Keller Jordan's Muon, the speedrun): the update's
      spectral norm fits the layer's input-to-output scale;
    - ``rms``: ``0.2 · sqrt(max(fan_out, fan_in))`` (Moonlight, Liu et al., 2025): the update's RMS is
      AdamW's typical 0.2, so AdamW's learning rate and weight decay carry over.
    """
    if rule == "spectral":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if rule == "rms":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    raise ValueError(f"no Muon scale {rule!r}")


def scale_factors(model: Any, params: list[Any], rule: str) -> list[float]:
    """Per weight of ``params``: the factor its learning rate takes so that DeepSpeed's update, times it,
    is sized by ``rule`` for the weight's layer (1.0 everywhere under ``storage``)."""
    from dsgpt2.optim.muon_update import deepspeed_scale

    if rule == "storage":
        return [1.0] * len(params)
    shapes = {id(m.weight): shape for m in model.modules() if (shape := layer_shape(m)) is not None}
    factors = []
    for p in params:
        if id(p) not in shapes:
            raise ValueError(f"a Muon weight of shape {tuple(p.shape)} is not a linear layer's")
        factors.append(muon_scale(rule, *shapes[id(p)]) / deepspeed_scale(p.shape[-2], p.shape[-1]))
    return factors


def is_hidden_matrix(name: str, param: Any) -> bool:
    """A weight Muon trains: a 2-D weight of a transformer block (attention's and the MLP's
    projections), never the embeddings, the head, a bias or a norm."""
    return param.dim() == 2 and name.startswith("transformer.h.") and not name.endswith(".bias")


def muon_param_groups(
    model: Any,
    adamw: dict[str, Any],
    lr: float,
    *,
    muon_lr: float,
    momentum: float,
    weight_decay: float = MUON_WEIGHT_DECAY,
    scale: str = MUON_SCALE,
    ns: str = MUON_NS,
    cautious: bool = False,
    momentum_warmup: int = 0,
    normuon: bool = False,
    soap: bool = False,
) -> list[dict[str, Any]]:
    """``MuonWithAuxAdam``'s groups: every other weight under AdamW (``adamw``: the DeepSpeed config's
    ``optimizer.params``; ``lr``: its peak; decay on the embeddings only, as :func:`param_groups`), then
    the hidden matrices under Muon (``muon_lr``, ``momentum``, ``weight_decay``), one group per update
    factor of ``scale`` (:func:`scale_factors`), in the order of the model's first weight of each.
    Each group's ``lr_scale`` is its peak ÷ ``lr``: the schedule sets ``lr × curve × lr_scale``, and
    where ``momentum_warmup`` is set, the momentum (from 0.85 to ``momentum`` over that many steps).
    ``ns`` names the orthogonalisation (:data:`NS_METHODS`); ``cautious`` decays a weight only where the
    update and the weight agree in sign; ``normuon`` evens out the update's rows, ``soap``
    preconditions the momentum as SOAP does before it is orthogonalised (both ZeRO 0 only).
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
    by_factor: dict[float, list[Any]] = {}
    for p, factor in zip(muon, scale_factors(model, muon, scale), strict=True):
        by_factor.setdefault(round(factor, 12), []).append(p)
    for factor, params in by_factor.items():
        # The decay divided by the factor: p ← p·(1 − lr·wd) decays each matrix at muon_lr × wd.
        groups.append({"params": params, "use_muon": True, "lr": muon_lr * factor,
                       "momentum": momentum_at(momentum, momentum_warmup, 0), "momentum_peak": momentum,
                       "momentum_warmup": momentum_warmup, "ns_method": NS_METHODS[ns], "cautious": cautious,
                       "normuon": normuon, "soap": soap,
                       "weight_decay": weight_decay / factor, "lr_scale": muon_lr * factor / lr,
                       "muon_factor": factor})  # fmt: skip
    # ZeRO 1 and 2 ask each parameter, not its group, whether Muon steps it.
    for group in groups:
        for p in group["params"]:
            p.use_muon = group["use_muon"]
    return groups


def muon_unfit(ds_config: dict[str, Any]) -> str | None:
    """Why Muon cannot train under ``ds_config``; None where it can."""
    if zero_stage(ds_config) == 3:
        return "ZeRO stage 3 shards each matrix across the ranks, and Muon orthogonalises whole ones"
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if str(offload).lower() != "none" or zero.get("cpu_offload"):
        return "its ZeRO offloads the optimizer (offload_optimizer), and DeepSpeed offloads only its own"
    kind = str((ds_config.get("optimizer") or {}).get("type", "AdamW"))
    if kind.lower() not in ("adamw", "adam"):
        return f"its optimizer is {kind}, and Muon takes its AdamW settings from an AdamW one"
    return None


def decayed_step(params: Any, update: Any, lr: float, weight_decay: float, cautious: bool) -> None:
    """``params ← params − lr·(update + decay·params)``, the decay (decoupled, as AdamW's) only where
    ``update`` and the weight agree in sign under ``cautious`` (Chen et al., 2025: "Cautious Weight
    Decay"; the speedrun's and nanochat's Muon): a weight the update already pulls towards zero is not
    pulled twice. ``params``: a tensor, or a list of them whose update is ``update`` stacked."""
    import torch

    batch = isinstance(params, list)
    if not cautious:  # in place, no copy of the weights: p·(1 − lr·decay) − lr·update
        if batch:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
            torch._foreach_add_(params, list(update.unbind(0)), alpha=-lr)
        else:
            params.mul_(1 - lr * weight_decay)
            params.add_(update, alpha=-lr)
        return
    stacked = torch.stack(params) if batch else params
    step = update + weight_decay * stacked * ((update * stacked) >= 0)
    if batch:
        torch._foreach_add_(params, list(step.unbind(0)), alpha=-lr)
    else:
        params.add_(step, alpha=-lr)


def soap_step(states: list[dict[str, Any]], grads: Any, momentum: Any, beta: Any, ns_method: str) -> Any:
    """SOAP-Muon's update of the matrices of one shape whose optimizer states are ``states`` (made
    where they are not yet), ``grads`` and ``momentum`` stacked (the momentum updated in place)."""
    import torch

    from dsgpt2.optim import muon_update

    for state in states:
        if muon_update.SOAP_STEP_KEY not in state:
            state.update(muon_update.soap_state(grads[0]))
            state[muon_update.SOAP_STEP_KEY] = 0
    stacked = {key: torch.stack([state[key] for state in states]) for key in muon_update.SOAP_KEYS}
    step = int(states[0][muon_update.SOAP_STEP_KEY])
    update = muon_update.soap_muon_update(grads, momentum, beta, stacked, step, ns_method=ns_method)
    for key, value in stacked.items():
        torch._foreach_copy_([state[key] for state in states], list(value.unbind(0)))
    for state in states:
        state[muon_update.SOAP_STEP_KEY] = step + 1
    return update


@functools.cache
def batched_muon_class() -> type:
    """DeepSpeed's ``MuonWithAuxAdam`` whose step orthogonalises the whole matrices of one shape together:
    one batched Newton–Schulz per shape and group (GPT-2's 48 hidden matrices at 112m in 4 calls rather
    than 48), and their decay and update applied by multi-tensor ops. DeepSpeed's iteration takes a batch
    as it is (``zeropower_via_*`` orthogonalise each matrix of it), and scales by each matrix's own
    shape. Under ZeRO 1 and 2 DeepSpeed has orthogonalised each gradient before the step and hands it
    flat: only the decay and the update are left. Its groups' ``cautious`` chooses the decay
    (:func:`decayed_step`), at every stage; ZeRO 1 and 2 know it as DeepSpeed's own (it is one)."""
    import warnings
    from collections import defaultdict

    import torch
    from deepspeed.runtime.zero import utils as zero_utils

    from dsgpt2.optim import muon_update

    # Inductor lowers DeepSpeed's compiled Newton–Schulz through a torch helper that warns of its own
    # deprecation, once per run on the user's screen: not the user's to act on.
    warnings.filterwarnings("ignore", r"`torch\._prims_common\.check` is deprecated", FutureWarning)
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    class BatchedMuon(MuonWithAuxAdam):  # type: ignore[misc]
        def __init__(self, param_groups: list[dict[str, Any]], **kwargs: Any) -> None:
            # DeepSpeed's constructor admits its own methods only: --muon_ns's is set once it is built.
            methods = [g.pop("ns_method", None) for g in param_groups]
            super().__init__(param_groups, **kwargs)
            for group, method in zip(self.param_groups, methods, strict=True):
                if method is not None:
                    group["ns_method"] = method

        def _states(self, params: list[Any], key: str, make: Any) -> list[Any]:
            """The state ``key`` of each of ``params``, made by ``make(p)`` where it is not yet."""
            for p in params:
                if key not in self.state[p]:
                    self.state[p][key] = make(p)
            return [self.state[p][key] for p in params]

        def _step_shape(self, group: dict[str, Any], params: list[Any]) -> None:
            """One step of the whole matrices ``params`` of ``group``, all of one shape, as one batch."""
            buffers = self._states(params, MUON_MOMENTUM_KEY, torch.zeros_like)
            momentum, method = torch.stack(buffers), group.get("ns_method", "gram")
            grads = torch.stack([p.grad for p in params])
            if group.get("soap"):
                states = [self.state[p] for p in params]
                update = soap_step(states, grads, momentum, group["momentum"], method)
            else:
                update = muon_update.muon_update(grads, momentum, beta=group["momentum"], ns_method=method)
            torch._foreach_copy_(buffers, list(momentum.unbind(0)))
            if group.get("normuon"):
                seconds = self._states(params, muon_update.NORMUON_KEY, muon_update.normuon_state)
                second = torch.stack(seconds)
                update = muon_update.normuon(update, second)
                torch._foreach_copy_(seconds, list(second.unbind(0)))
            decayed_step(params, update, group["lr"], group["weight_decay"], group.get("cautious", False))

        @torch.no_grad()
        def step(self, closure: Any = None, step_id: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            muon = [g for g in self.param_groups if g["use_muon"]]
            for group in muon:
                shapes: dict[tuple[int, ...], list[Any]] = defaultdict(list)
                for p in group["params"]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    if p.dim() < 2:  # a flat ZeRO partition: its gradient holds the update already
                        if group.get("normuon") or group.get("soap"):
                            raise RuntimeError("NorMuon and SOAP step whole matrices, not a flat partition")
                        decayed_step(p, p.grad.reshape(p.shape), group["lr"], group["weight_decay"],
                                     group.get("cautious", False))  # fmt: skip
                    else:
                        shapes[tuple(p.shape)].append(p)
                for params in shapes.values():
                    self._step_shape(group, params)
            # AdamW's part as DeepSpeed steps it, shown only its own groups.
            every = self.param_groups
            self.param_groups = [g for g in every if not g["use_muon"]]
            try:
                super().step(step_id=step_id)
            finally:
                self.param_groups = every
            return loss

    if BatchedMuon not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(BatchedMuon)
    return BatchedMuon


MUON = ("optimizer", "muon")  # what Muon's own options serve


@dataclass
class MuonOptions(Checked):
    """Muon's own settings, as flags (refused with another optimizer; a resume keeps its checkpoint's)."""

    muon_lr: float | None = option(
        None,
        f"muon: the peak learning rate of the Muon weights (default: --lr under --muon_scale rms, {MUON_LR} "
        "under spectral or storage); --lr stays AdamW's",
        type=float,
        check=POSITIVE_NUMBER,
        serves=MUON,
    )
    muon_momentum: float | None = option(
        None,
        f"muon: its momentum (default {MUON_MOMENTUM}, the Muon authors')",
        type=float,
        check=Range(float, 0, 1, high_open=True),
        serves=MUON,
    )
    muon_weight_decay: float | None = option(
        None,
        "muon: decoupled weight decay of the Muon weights, p ← p·(1 − lr·decay) (default: the DeepSpeed "
        f"config's AdamW decay under --muon_scale rms, {MUON_WEIGHT_DECAY} under spectral or storage)",
        type=float,
        check=Range(float, 0),
        serves=MUON,
    )
    muon_scale: str | None = option(
        None,
        f"muon: each matrix's update size (default {MUON_SCALE}): rms, 0.2·sqrt(max(fan-out, fan-in)) of the "
        "layer, Moonlight's, where AdamW's --lr and decay carry over; spectral, sqrt(max(1, fan-out / "
        "fan-in)), the speedrun's; storage: DeepSpeed's rule on the weight as stored (runs before this "
        "choice existed)",
        choices=list(SCALES),
        serves=MUON,
    )
    muon_ns: str | None = option(
        None,
        f"muon: the orthogonalisation (default {MUON_NS}): quintic, five Newton–Schulz iterations of the "
        "Muon authors' fixed quintic (DeepSpeed's); polar_express, Polar Express's five, each with its own "
        "coefficients (the speedrun's since 2025)",
        choices=list(NS_METHODS),
        serves=MUON,
    )
    muon_cautious: bool | None = option(
        None,
        "muon: cautious weight decay: decay a weight only where its update has the same sign (default off)",
        serves=MUON,
    )
    muon_normuon: bool | None = option(
        None,
        "muon: NorMuon: each row of an orthogonalised update divided by its running RMS, the update's size "
        "kept (default off; ZeRO 0 only)",
        serves=MUON,
    )
    muon_soap: bool | None = option(
        None,
        "muon: SOAP-Muon: the momentum preconditioned as SOAP does (Adam in the eigenbasis of the "
        "gradient's Shampoo factors) before it is orthogonalised (default off; ZeRO 0 only)",
        serves=MUON,
    )
    muon_momentum_warmup: int | None = option(
        None,
        f"muon: raise the momentum linearly from {MOMENTUM_START} to --muon_momentum over this many first "
        "steps (default 0: none)",
        check=NON_NEGATIVE_INT,
        serves=MUON,
    )


MUON_KEYS = tuple(f.name for f in fields(MuonOptions))


@OPTIMIZERS.register("muon")
class Muon(RunOptimizer):
    """Muon on the blocks' 2-D weights, AdamW (the DeepSpeed config's settings, its peak the run's) on
    the others, in DeepSpeed's ``MuonWithAuxAdam`` (see the module doc)."""

    name = "muon"
    own_rates = "Muon (--optimizer muon, the default for a new run), whose weights take their own (--muon_lr)"
    keys = MUON_KEYS
    # What checkpoints saved before these settings existed trained with.
    legacy: ClassVar[dict[str, Any]] = {
        "muon_scale": "storage",
        "muon_weight_decay": 0.0,
        "muon_ns": "quintic",
        "muon_cautious": False,
        "muon_normuon": False,
        "muon_soap": False,
        "muon_momentum_warmup": 0,
    }
    compiles = "Muon's Newton–Schulz iteration"
    # ZeRO 1 and 2 would clip the orthogonalised updates (see engine_config).
    trainer_clips = False
    # Its momentum holds each parameter a partition touches whole (a matrix is orthogonalised whole).
    whole_states = (MUON_MOMENTUM_KEY,)

    @classmethod
    def resume_refusal(cls, then: dict[str, Any], now: dict[str, Any]) -> str | None:
        theirs = then.get("muon_scale") or cls.legacy["muon_scale"]
        ours = now.get("muon_scale")
        if ours and ours != theirs:
            # Muon's weights are grouped by update size: the saved groups are not this run's.
            return (
                f"was trained with --muon_scale {theirs} and this run asks for --muon_scale {ours}: "
                f"resume it with --muon_scale {theirs} (or without it), or train with {ours} in another "
                "--ckpt_dir"
            )
        return None

    @classmethod
    def resumed(cls, key: str, saved: dict[str, Any]) -> Any:
        if key == "muon_weight_decay" and key not in saved and saved.get("muon_scale") == "rms":
            # Saved with --muon_scale and before every setting was recorded: it trained with the
            # default under rms, the DeepSpeed config's decay (settled from it).
            return None
        return super().resumed(key, saved)

    @classmethod
    def unfit(cls, ds_config: dict[str, Any]) -> str | None:
        return muon_unfit(ds_config)

    def settle(self, ds_config: dict[str, Any]) -> None:
        o = self.options
        if o.muon_scale is None:
            o.muon_scale = MUON_SCALE
        if o.muon_momentum is None:
            o.muon_momentum = MUON_MOMENTUM
        if o.muon_weight_decay is None:
            adamw = (ds_config.get("optimizer") or {}).get("params") or {}
            o.muon_weight_decay = default_weight_decay(o.muon_scale, adamw)
        if o.muon_ns is None:
            o.muon_ns = MUON_NS
        if o.muon_cautious is None:
            o.muon_cautious = False
        if o.muon_normuon is None:
            o.muon_normuon = False
        if o.muon_soap is None:
            o.muon_soap = False
        for flag, keeps in (("normuon", "a second moment for each row of a matrix"),
                            ("soap", "two factors and a second moment for each whole matrix")):  # fmt: skip
            if getattr(o, f"muon_{flag}") and (why := normuon_unfit(ds_config)):
                raise ConfigError(
                    f"--muon_{flag} keeps {keeps}, which {why} has no place for: train it under a ZeRO 0 "
                    f"config in fp32 or torch_autocast (configs/ds_config.json), or leave out --muon_{flag}"
                )
        if o.muon_momentum_warmup is None:
            o.muon_momentum_warmup = 0
        if o.muon_momentum_warmup and o.muon_momentum <= MOMENTUM_START:
            raise ConfigError(
                f"--muon_momentum_warmup raises the momentum from {MOMENTUM_START} to --muon_momentum, and "
                f"--muon_momentum is {o.muon_momentum}: give a momentum above {MOMENTUM_START}, or leave out "
                "--muon_momentum_warmup"
            )

    def engine_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` without its ``optimizer`` block (the engine is handed this one) and with gradient
        clipping off.

        Clipping is off because ZeRO 1 and 2 clip after the Muon update is made (the global norm of
        orthogonalised updates, about 27 times the raw gradients' at the first step of the tiny
        model), which would scale every Muon step down by that factor and make ZeRO 0 and ZeRO 2 train
        different models; Muon's update has a fixed size whatever the gradient's.
        """
        return {**{k: v for k, v in config.items() if k != "optimizer"}, "gradient_clipping": 0.0}

    def build(self, model: Any, ds: EngineConfig) -> dict[str, Any]:
        # The schedule is dsgpt2's whenever Muon trains (own_rates: the DeepSpeed scheduler is refused).
        assert ds.schedule is not None
        return {"optimizer": build_muon(model, ds.optimizer_params, ds.schedule.peak, self.options,
                                        zero_stage(ds.config))}  # fmt: skip


def normuon_unfit(ds_config: dict[str, Any]) -> str | None:
    """What in ``ds_config`` steps Muon's matrices as flat partitions, where NorMuon's rows are not
    (ZeRO 1 and 2; DeepSpeed's own bf16 or fp16 optimizer at ZeRO 0); None where it can train."""
    if (stage := zero_stage(ds_config)) != 0:
        return f"ZeRO stage {stage}'s partitioned Muon"
    for section in ("bf16", "bfloat16", "fp16"):
        if (ds_config.get(section) or {}).get("enabled"):
            return f"DeepSpeed's {section} optimizer (the config's {section} section)"
    return None


def default_weight_decay(scale: str, adamw: dict[str, Any]) -> float:
    """Muon's decay where none is given: under Moonlight's rule (``rms``) the update's RMS is AdamW's, and
    AdamW's decay (``adamw``: the DeepSpeed config's optimizer settings) carries over."""
    return float(adamw.get("weight_decay", 0.0)) if scale == "rms" else MUON_WEIGHT_DECAY


def build_muon(model: Any, adamw: dict[str, Any], lr: float, options: Any, stage: int = 0) -> Any:
    """The Muon optimizer of ``model`` at ZeRO ``stage``: AdamW's part from ``adamw`` (the DeepSpeed
    config's optimizer settings), ``lr`` its peak; Muon's from ``options``, their defaults where unset."""
    from torch.optim import AdamW

    from dsgpt2.optim import muon_update

    scale = options.muon_scale or MUON_SCALE
    weight_decay = options.muon_weight_decay
    if weight_decay is None:
        weight_decay = default_weight_decay(scale, adamw)
    muon_lr = options.muon_lr if options.muon_lr is not None else lr if scale == "rms" else MUON_LR
    momentum = MUON_MOMENTUM if options.muon_momentum is None else options.muon_momentum
    ns, cautious, normuon, soap = (
        options.muon_ns or MUON_NS,
        bool(options.muon_cautious),
        bool(options.muon_normuon),
        bool(options.muon_soap),
    )
    warmup = options.muon_momentum_warmup or 0
    groups = muon_param_groups(model, adamw, lr, muon_lr=muon_lr, momentum=momentum,
                               weight_decay=weight_decay, scale=scale, ns=ns, cautious=cautious,
                               momentum_warmup=warmup, normuon=normuon, soap=soap)  # fmt: skip
    # ZeRO 1 and 2 orthogonalise each gradient themselves, through DeepSpeed's muon_update: --muon_ns's.
    muon_update.install()
    muon = batched_muon_class()
    # AdamW's part in one fused kernel per group, as DeepSpeed's own AdamW steps alone: torch's default
    # on a CPU steps each tensor by itself, half a dozen host ops for each of GPT-2's ~100 small ones.
    optimizer = muon(groups, adam_optimizer=AdamW, adam_optimizer_kwargs={"fused": True})
    n_muon = sum(p.numel() for g in groups if g["use_muon"] for p in g["params"])
    n_all = sum(p.numel() for g in groups for p in g["params"])
    factors = ", ".join(f"{g['muon_factor']:.3g}" for g in groups if g["use_muon"])
    warmed = f" (from {MOMENTUM_START} over {warmup} steps)" if warmup else ""
    log.info(
        "optimizer: Muon (lr %g, momentum %g%s, weight decay %g%s, %s scale: ×%s; %s) on %.1fM weights of "
        "the blocks' matrices, AdamW (lr %g) on the other %.1fM; ZeRO stage %d",
        muon_lr, momentum, warmed, weight_decay, " (cautious)" if cautious else "", scale, factors,
        ("Polar Express" if ns == "polar_express" else "quintic Newton–Schulz")
        + (", NorMuon" if normuon else "") + (", SOAP" if soap else ""),
        n_muon / 1e6, lr,
        (n_all - n_muon) / 1e6, stage,
    )  # fmt: skip
    return optimizer
