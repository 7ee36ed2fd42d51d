"""A plugin outside the package, as a contributor or a user would write one: a toy optimizer registered
before the command runs. ``python tests/plugins.py ARGS`` is ``dsgpt2 ARGS`` with it registered."""

from __future__ import annotations

import sys
from typing import Any

from dsgpt2.train.ds_config import EngineConfig
from dsgpt2.train.optimizer import RunOptimizer
from dsgpt2.train.optimizers import OPTIMIZERS


@OPTIMIZERS.register("sgd")
class Sgd(RunOptimizer):
    """SGD with Nesterov momentum on every weight, at the run's learning rate."""

    name = "sgd"

    def engine_config(self, config: dict[str, Any]) -> dict[str, Any]:
        # The engine is handed this optimizer: the file's AdamW block is not DeepSpeed's to build.
        return {k: v for k, v in config.items() if k != "optimizer"}

    def build(self, model: Any, ds: EngineConfig) -> dict[str, Any]:
        import torch

        lr = float(ds.optimizer_params["lr"])
        return {"optimizer": torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)}


if __name__ == "__main__":
    from dsgpt2.cli.main import main

    sys.exit(main(sys.argv[1:]))
