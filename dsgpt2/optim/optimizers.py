"""The optimizers a run can train with, in one registry (torchtitan's ``build_optimizers``): a new one
is a :class:`~dsgpt2.optim.optimizer.RunOptimizer` class registered where it is defined (the built-in
ones imported here); ``--optimizer``'s choices, a resume's checks and the engine's build all read
:data:`OPTIMIZERS`. A plugin (or a test) registers its
own the same way before the run is built::

    @OPTIMIZERS.register("sgd")
    class Sgd(RunOptimizer): ...

Their options are :class:`OptimizerOptions`; each optimizer names the ones that are its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsgpt2.errors import ConfigError
from dsgpt2.optim.muon import Muon, MuonOptions
from dsgpt2.optim.optimizer import OPTIMIZERS, AdamW, RunOptimizer
from dsgpt2.settings.options import Checked, option

# A new run's optimizer, and the one it falls back to where the DeepSpeed config cannot carry it.
DEFAULT = Muon.name
FALLBACK = AdamW.name


@dataclass
class OptimizerChoice(Checked):
    """Which optimizer trains the weights."""

    optimizer: str | None = option(
        None,
        "muon (the default for a new run): Muon on the blocks' 2-D weights (attention and MLP), AdamW (the "
        "DeepSpeed config's settings, --lr) on embeddings, biases and norms; adamw: the DeepSpeed config's "
        "AdamW on every weight. A resumed run without it continues with its checkpoint's",
        choices=OPTIMIZERS.choices(),
    )


@dataclass
class OptimizerOptions(MuonOptions, OptimizerChoice):
    """Which optimizer trains the weights, and the settings each optimizer declares as its own (Muon's:
    :class:`~dsgpt2.optim.muon.MuonOptions`), as flags."""

    def check(self) -> None:
        self.check_own_flags()

    def chosen(self) -> RunOptimizer:
        """The optimizer these options choose (set: :meth:`TrainConfig.settle` fills it in)."""
        return OPTIMIZERS[str(self.optimizer)](self)

    def given(self, name: str | None = None) -> list[str]:
        """The flags given that belong to an optimizer (``name``'s; any: None)."""
        owners = [OPTIMIZERS[name]] if name else [cls for _, cls in OPTIMIZERS.items()]
        return [f"--{k}" for cls in owners for k in cls.keys if getattr(self, k, None) is not None]

    def check_own_flags(self) -> None:
        """Refuse an optimizer's settings for a run that trains with another.

        Raises:
            ConfigError: a flag of one optimizer given, and the run trains with another.
        """
        if self.optimizer is None:
            return
        for owner, cls in OPTIMIZERS.items():
            given = self.given(owner)
            if owner != self.optimizer and given:
                named = " and ".join(given)
                raise ConfigError(
                    f"{named} set the {cls.__name__} optimizer, and this run trains with --optimizer "
                    f"{self.optimizer}: add --optimizer {owner}, or leave out {named}"
                )

    def take_resumed(self, saved: dict[str, object]) -> list[str]:
        """Fill what this run left unset from the options of the checkpoint it resumes (``saved``): the
        optimizer, and its own settings where the checkpoint's optimizer is this run's (a checkpoint
        saved before a setting existed: the value it trained with). Returns the flags taken."""
        taken = []
        theirs = str(saved.get("optimizer") or FALLBACK)  # saved before Muon: AdamW
        if self.optimizer is None:
            self.optimizer = theirs
            taken.append(f"--optimizer {theirs}")
        if self.optimizer == theirs:
            cls = OPTIMIZERS[theirs]
            for key in cls.keys:
                if getattr(self, key) is None:
                    value = cls.resumed(key, saved)
                    setattr(self, key, value)
                    if value is not None:
                        taken.append(typed(key, value))
        return taken

    def settle(self, unfit: str | None, ds_config: dict[str, Any] | None = None) -> list[str]:
        """Choose the optimizer of a new run (the default, or the fallback where the DeepSpeed config
        cannot carry it, ``unfit`` saying why, and no option of the default's was given) and fill in
        its own settings. Returns what was decided, as lines for the log."""
        said = []
        if self.optimizer is None:
            self.optimizer = FALLBACK if unfit and not self.given(DEFAULT) else DEFAULT
            if self.optimizer == FALLBACK:
                said.append(f"optimizer: AdamW, not Muon, under this DeepSpeed config: {unfit}")
        self.chosen().settle(ds_config or {})
        self.check_own_flags()
        return said


def typed(key: str, value: object) -> str:
    """An option as the command line takes it: a switch as ``--key`` or ``--no_key``, else ``--key value``."""
    if isinstance(value, bool):
        return f"--{key}" if value else f"--no_{key}"
    return f"--{key} {value}"


def check_optimizer(options: OptimizerOptions, ds_config: dict[str, Any]) -> None:
    """Refuse a DeepSpeed config the chosen optimizer cannot train under, before anything is built.

    Raises:
        ConfigError: e.g. Muon under ZeRO stage 3, or with a DeepSpeed config whose optimizer is not AdamW.
    """
    name = options.optimizer
    if why := OPTIMIZERS[str(name)].unfit(ds_config):
        raise ConfigError(
            f"--optimizer {name} cannot train under this DeepSpeed config: {why}. Use a ZeRO 0-2 config "
            f"with AdamW as its optimizer (configs/ds_config.json), or --optimizer {FALLBACK}"
        )
