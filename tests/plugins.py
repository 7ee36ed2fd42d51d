"""Plugins outside the package, as a contributor or a user would write them: a toy optimizer and a toy
kind of checkpoint location, registered before the command runs. ``python tests/plugins.py ARGS`` is
``dsgpt2 ARGS`` with them registered."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from dsgpt2.files import atomic_write_text, file_sha256
from dsgpt2.optim.ds_config import EngineConfig
from dsgpt2.optim.optimizer import RunOptimizer
from dsgpt2.optim.optimizers import OPTIMIZERS
from dsgpt2.stores.base import STORES, Artifact


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


@STORES.register("mirror")
class MirrorStore:
    """``mirror:NAME``: files kept in the folder ``$DSGPT2_MIRROR/NAME``, which only put and get reach (as
    an object store's would be), each machine working on a copy of its own."""

    needs_connection: ClassVar[bool] = False
    staged = True

    def __init__(self, name: str, artifact: Artifact, local: Path) -> None:
        self.name, self.artifact, self.local = name, artifact, local
        self.kept = Path(os.environ["DSGPT2_MIRROR"]) / name
        self.location = f"mirror:{name}"

    @classmethod
    def open(cls, name: str, artifact: Artifact, conn: Any, local: Path) -> MirrorStore:
        return cls(name, artifact, local)

    def tags(self) -> dict[str, dict[str, Any]]:
        found = {}
        for path in sorted(self.kept.glob(f"*/{self.artifact.marker}")):
            marker = self.artifact.read_marker(path)
            if marker is not None:
                found[path.parent.name] = marker
        return found

    def started(self) -> list[str]:
        return sorted(
            p.name for p in self.kept.glob("*") if p.is_dir() and not (p / self.artifact.marker).exists()
        )

    def put(self, tag: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        out = {}
        for name in names:
            (self.kept / tag / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.local / tag / name, self.kept / tag / name)
            out[name] = file_sha256(self.kept / tag / name)
        return out

    def get(self, tag: str, name: str) -> dict[str, Any]:
        (self.local / tag / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.kept / tag / name, self.local / tag / name)
        return file_sha256(self.local / tag / name)

    def complete(self, tag: str, marker: dict[str, Any]) -> None:
        self.write(f"{tag}/{self.artifact.marker}", json.dumps(marker))

    def read(self, name: str) -> str | None:
        path = self.kept / name
        return path.read_text() if path.is_file() else None

    def write(self, name: str, text: str) -> None:
        (self.kept / name).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.kept / name, text)

    def delete(self, tag: str, files: Iterable[str] | None = None) -> int:
        (self.kept / tag / self.artifact.marker).unlink(missing_ok=True)
        gone = (
            [self.kept / tag / f for f in files] if files is not None else list((self.kept / tag).rglob("*"))
        )
        count = sum(1 for p in gone if p.is_file())
        if files is None:
            shutil.rmtree(self.kept / tag, ignore_errors=True)
        else:
            for path in gone:
                path.unlink(missing_ok=True)
        return count

    def holding(self, name: str) -> list[str]:
        top = self.kept.parent
        return sorted(f"mirror:{p.parent.relative_to(top)}" for p in top.rglob(name) if p.is_file())


if __name__ == "__main__":
    from dsgpt2.cli.main import main

    sys.exit(main(sys.argv[1:]))
