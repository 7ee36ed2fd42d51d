"""What an optimizer is to the trainer (:class:`RunOptimizer`), and AdamW, the DeepSpeed config's own.

An optimizer of a run says what it needs of the DeepSpeed config (:meth:`RunOptimizer.engine_config`,
a new dict: the config is built once, :func:`dsgpt2.optim.ds_config.build_ds_config`), why a config
cannot carry it (:meth:`RunOptimizer.unfit`), and what ``deepspeed.initialize`` is handed to train the
model with it (:meth:`RunOptimizer.build`). They are registered by name in
:mod:`dsgpt2.optim.optimizers`, which ``--optimizer`` chooses from.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from dsgpt2.errors import ConfigError
from dsgpt2.model.gpt2 import param_groups
from dsgpt2.registry import Registry

if TYPE_CHECKING:
    from dsgpt2.optim.ds_config import EngineConfig

log = logging.getLogger(__name__)


class RunOptimizer:
    """One optimizer a run can train with; built from the run's optimizer options.

    A subclass sets:

    - ``name``: the ``--optimizer`` value;
    - ``own_rates``: where its weights take learning rates of their own, what they are (a run under
      the DeepSpeed config's one-rate scheduler is refused with it); None: one rate serves;
    - ``keys``: the optimizer options that are its own (refused with another optimizer), and
      ``legacy``: the values those of a checkpoint saved before they existed trained with;
    - ``compiles``: what its first step compiles under --compile, if anything (said before the wait;
      without --compile it runs eagerly);
    - ``trainer_clips``: whether the trainer may take the DeepSpeed config's gradient clipping over;
    - ``whole_states``: the names of its per-parameter states that it keeps whole for each parameter a
      ZeRO partition touches, rather than cut as the partition (what a checkpoint's universal form
      carries as they are laid out: :mod:`dsgpt2.checkpoints.universal`).

    and implements :meth:`build` (and, as it needs, :meth:`unfit`, :meth:`settle`,
    :meth:`engine_config`, :meth:`resume_refusal`).
    """

    name: ClassVar[str]
    own_rates: ClassVar[str | None] = None
    keys: ClassVar[tuple[str, ...]] = ()
    legacy: ClassVar[dict[str, Any]] = {}
    compiles: ClassVar[str | None] = None
    trainer_clips: ClassVar[bool] = True
    whole_states: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: Any) -> None:
        self.options = options

    @classmethod
    def unfit(cls, ds_config: dict[str, Any]) -> str | None:
        """Why this optimizer cannot train under ``ds_config`` (the file as read); None where it can."""
        return None

    def settle(self, ds_config: dict[str, Any]) -> None:
        """Fill in the options of its own that the run left unset with what it trains with (``ds_config``:
        the DeepSpeed config file as read, for defaults taken from it): recorded, a resume keeps them."""

    def engine_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The DeepSpeed config it trains under, from ``config`` (not changed: a new dict where it
        differs)."""
        return config

    @classmethod
    def resume_refusal(cls, then: dict[str, Any], now: dict[str, Any]) -> str | None:
        """Why a run asking for the options ``now`` cannot take on the optimizer state of a checkpoint
        trained with the options ``then`` (both by flag name; the same optimizer), as the end of a
        sentence naming the checkpoint; None where it can."""
        return None

    @classmethod
    def resumed(cls, key: str, saved: dict[str, Any]) -> Any:
        """The value of its option ``key`` that a checkpoint of the options ``saved`` trained with (None:
        the default, settled by this run): the saved one, else ``legacy``'s."""
        return saved.get(key, cls.legacy.get(key))

    def build(self, model: Any, ds: EngineConfig) -> dict[str, Any]:
        """What ``deepspeed.initialize`` is given to train ``model`` (``optimizer=`` or
        ``model_parameters=``)."""
        raise NotImplementedError


# Every optimizer by its --optimizer name: each class registers itself where it is defined
# (@OPTIMIZERS.register(name)); dsgpt2.optim.optimizers imports the built-in ones.
OPTIMIZERS: Registry[type[RunOptimizer]] = Registry("optimizer", "--optimizer")


@OPTIMIZERS.register("adamw")
class AdamW(RunOptimizer):
    """The DeepSpeed config's optimizer (AdamW in every shipped config) on every weight, with decay on
    the matrices and embeddings only (:func:`dsgpt2.model.gpt2.param_groups`)."""

    name = "adamw"

    def build(self, model: Any, ds: EngineConfig) -> dict[str, Any]:
        from dsgpt2.optim.ds_config import zero_stage

        if not (ds.config.get("optimizer") or {}).get("type"):  # DeepSpeed would build no optimizer
            raise ConfigError(
                "--optimizer adamw trains with the DeepSpeed config's optimizer section, and "
                "--deepspeed_config has none: add one, as configs/ds_config_cpu.json's "
                '("optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], '
                '"weight_decay": 0.1}}), or train with --optimizer muon'
            )
        p = ds.optimizer_params
        decay = float(p.get("weight_decay", 0.0))
        clip = float(ds.config.get("gradient_clipping") or 0.0)
        clipping = f"gradient clipping at {clip:g}" if clip else (
            "no gradient clipping (the DeepSpeed config sets none; AdamW usually trains with "
            '"gradient_clipping": 1.0)'
        )  # fmt: skip
        betas = ", ".join(f"{b:g}" for b in p.get("betas", (0.9, 0.999)))
        log.info(
            "optimizer: AdamW (lr %g, betas %s, eps %g, weight decay %g on the matrices and embeddings), %s; "
            "ZeRO stage %d",
            float(p.get("lr", 0.0)), betas, float(p.get("eps", 1e-8)), decay, clipping, zero_stage(ds.config),
        )  # fmt: skip
        return {"model_parameters": param_groups(model, decay)}
