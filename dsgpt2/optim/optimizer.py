"""What an optimizer is to the trainer (:class:`RunOptimizer`), and AdamW, the DeepSpeed config's own.

An optimizer of a run says what it needs of the DeepSpeed config (:meth:`RunOptimizer.engine_config`,
a new dict: the config is built once, :func:`dsgpt2.optim.ds_config.build_ds_config`), why a config
cannot carry it (:meth:`RunOptimizer.unfit`), and what ``deepspeed.initialize`` is handed to train the
model with it (:meth:`RunOptimizer.build`). They are registered by name in
:mod:`dsgpt2.optim.optimizers`, which ``--optimizer`` chooses from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from dsgpt2.model.gpt2 import param_groups

if TYPE_CHECKING:
    from dsgpt2.optim.ds_config import EngineConfig


class RunOptimizer:
    """One optimizer a run can train with; built from the run's optimizer options.

    A subclass sets:

    - ``name``: the ``--optimizer`` value;
    - ``own_rates``: where its weights take learning rates of their own, what they are (a run under
      the DeepSpeed config's one-rate scheduler is refused with it); None: one rate serves;
    - ``keys``: the optimizer options that are its own (refused with another optimizer), and
      ``legacy``: the values those of a checkpoint saved before they existed trained with;
    - ``compiles``: what its first step compiles, if anything (said before the wait);
    - ``trainer_clips``: whether the trainer may take the DeepSpeed config's gradient clipping over.

    and implements :meth:`build` (and, as it needs, :meth:`unfit`, :meth:`settle`,
    :meth:`engine_config`).
    """

    name: ClassVar[str]
    own_rates: ClassVar[str | None] = None
    keys: ClassVar[tuple[str, ...]] = ()
    legacy: ClassVar[dict[str, Any]] = {}
    compiles: ClassVar[str | None] = None
    trainer_clips: ClassVar[bool] = True

    def __init__(self, options: Any) -> None:
        self.options = options

    @classmethod
    def unfit(cls, ds_config: dict[str, Any]) -> str | None:
        """Why this optimizer cannot train under ``ds_config`` (the file as read); None where it can."""
        return None

    def settle(self) -> None:
        """Fill in the options of its own that the run left unset and a resume must keep."""

    def engine_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The DeepSpeed config it trains under, from ``config`` (not changed: a new dict where it
        differs)."""
        return config

    def build(self, model: Any, ds: EngineConfig) -> dict[str, Any]:
        """What ``deepspeed.initialize`` is given to train ``model`` (``optimizer=`` or
        ``model_parameters=``)."""
        raise NotImplementedError


class AdamW(RunOptimizer):
    """The DeepSpeed config's optimizer (AdamW in every shipped config) on every weight, with decay on
    the matrices and embeddings only (:func:`dsgpt2.model.gpt2.param_groups`)."""

    name = "adamw"

    def build(self, model: Any, ds: EngineConfig) -> dict[str, Any]:
        decay = float(ds.optimizer_params.get("weight_decay", 0.0))
        return {"model_parameters": param_groups(model, decay)}
