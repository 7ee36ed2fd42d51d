"""Files that are either whole or absent: write a temporary file beside the target, then rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike[str], mode: str = "w", prefix: str | None = None
) -> Iterator[IO[Any]]:
    """Open a temporary file in ``path``'s directory; on a clean exit it replaces ``path``.

    The data is flushed to disk before the rename, so a crash leaves either the old file or the new
    one, never a part. On an error the temporary file is removed and ``path`` is left as it was.

    Args:
        path: the file to write.
        mode: ``"w"`` (UTF-8 text) or ``"wb"``.
        prefix: name prefix of the temporary file (default ``.NAME.``), for whoever cleans up
            after a killed writer.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one step."""
    with atomic_writer(path) as f:
        f.write(text)
