"""Logging setup: INFO on rank 0, warnings and errors only on the other ranks."""

from __future__ import annotations

import logging
import os
import sys


def process_rank() -> int:
    """The global rank of this process as the launcher set it (0 when none did)."""
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def setup_logging(verbose: bool = False, rank: int | None = None) -> None:
    """Configure the ``dsgpt2`` logger once for this process.

    Args:
        verbose: log DEBUG on rank 0 instead of INFO.
        rank: global rank; read from the launcher's environment when omitted.
    """
    rank = process_rank() if rank is None else rank
    logger = logging.getLogger("dsgpt2")
    if rank == 0:
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    else:
        logger.setLevel(logging.WARNING)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        prefix = "" if rank == 0 else f"[rank {rank}] "
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
        logger.addHandler(handler)
    logger.propagate = False
