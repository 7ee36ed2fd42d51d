"""The checkpoint options of a run: where checkpoints go (a directory, or a location a store kind's
scheme names: :mod:`dsgpt2.stores`), how many stay, where a run resumes from; and the name of the
resolved configuration saved beside each checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsgpt2.errors import ConfigError
from dsgpt2.files import check_writable_dir
from dsgpt2.settings.options import NON_NEGATIVE_INT, POSITIVE_INT, Checked, as_path, option

RESOLVED = "config.yaml"  # the run's resolved configuration, beside each checkpoint's files


@dataclass
class CheckpointOptions(Checked):
    """Where checkpoints go, how many stay, and where a run resumes from."""

    ckpt_dir: Path = option(Path("runs/ckpt"), "where checkpoints are saved")
    save_interval: int = option(500, "save every N steps", check=POSITIVE_INT)
    keep_last: int = option(3, "keep the last K checkpoints (0: all)", check=NON_NEGATIVE_INT)
    load_dir: Path | None = option(None, "resume from this directory (an error if it holds none)")
    ckpt_id: str | None = option(None, "resume from this tag instead of `latest`")
    no_resume: bool = option(
        False, "never resume: a fresh run, refused where --ckpt_dir holds checkpoints (never overwritten)"
    )
    ignore_fingerprint: bool = option(
        False, "resume although the corpus or tokenizer changed since the checkpoint"
    )

    def convert(self) -> None:
        self.ckpt_dir, self.load_dir = Path(self.ckpt_dir), as_path(self.load_dir)
        if self.ckpt_id and not self.load_dir:
            self.load_dir = self.ckpt_dir

    def check(self) -> None:
        from dsgpt2.checkpoints.format import CHECKPOINTS  # not at import: it reads checkpoints with torch
        from dsgpt2.stores.base import split_location

        for flag, location in (("--ckpt_dir", self.ckpt_dir), ("--load_dir", self.load_dir)):
            try:  # a stored location is spelt right
                split_location(location, CHECKPOINTS)
            except ConfigError as exc:
                raise ConfigError(f"{flag} {exc}") from None
        if self.no_resume and self.load_dir:
            raise ConfigError("--no_resume contradicts --load_dir/--ckpt_id; drop one")

    def check_files(self) -> None:
        """A checkpoint directory can be written (found before the first step, not at the first save).

        Raises:
            ConfigError: naming --ckpt_dir and why.
        """
        from dsgpt2.checkpoints.format import CHECKPOINTS
        from dsgpt2.stores.base import split_location

        if split_location(self.ckpt_dir, CHECKPOINTS) is None:
            check_writable_dir(self.ckpt_dir, "--ckpt_dir")
            _check_not_another_artifact(self.ckpt_dir)

    def check_workspace(self, workspace: Path) -> None:
        """The run's workspace is no checkpoint's directory (its files would overwrite the checkpoint's).

        Raises:
            ConfigError: ``workspace`` is a checkpoint or inside one.
        """
        from dsgpt2.checkpoints.format import COMPLETE

        for there in (workspace, *workspace.parents):
            if (there / COMPLETE).is_file():
                raise ConfigError(
                    f"--workspace {workspace} is {'inside ' if there != workspace else ''}the checkpoint "
                    f"{there}: its logs and config.yaml would overwrite the checkpoint's; give a directory "
                    "of its own, such as runs/workspace"
                )


def _check_not_another_artifact(ckpt_dir: Path) -> None:
    """A checkpoint directory that holds an exported model or a tokenizer is refused: an export there
    (``--overwrite``) or a tokenizer written again would replace the checkpoints with it."""
    from dsgpt2.checkpoints.format import LATEST
    from dsgpt2.checkpoints.weights import RUN_INFO

    if (ckpt_dir / LATEST).exists():  # a run's already (made so before this check): it resumes
        return
    for name, what in ((RUN_INFO, "an exported model"), ("tokenizer.json", "a tokenizer")):
        if (ckpt_dir / name).is_file():
            raise ConfigError(
                f"--ckpt_dir {ckpt_dir} holds {what} ({name}), not checkpoints; give a directory of "
                "its own, such as runs/ckpt"
            )
