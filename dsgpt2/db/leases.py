"""One writer at a time: a lease kept in a collection's meta_info entry, at a path of its own
(``sources.KEY`` for an ingest of one source, ``indexing`` for a numbering pass), as ``{owner,
heartbeat}``.

A lease is taken by a conditional update on the owner it was read with, so two processes racing for it
cannot both win; its holder refreshes the heartbeat while it works and every write it makes under the
lease is conditional on still holding it (:meth:`Lease.update`). A holder that stopped giving signs of
life is taken over: on this machine as soon as its process is gone, elsewhere once its heartbeat is older
than :data:`LEASE_SECONDS`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

from dsgpt2.db.client import Connection, DatabaseError, with_retries
from dsgpt2.errors import LeaseContested, LeaseHeld, LeaseLost
from dsgpt2.files import process_alive

log = logging.getLogger(__name__)

LEASE_SECONDS = 60.0  # a heartbeat older than this belongs to a process that died
_ATTEMPTS = 5


def alive(owner: str, heartbeat: Any) -> bool:
    """Whether the holder ``owner`` (``host:pid:token``) may still be working: on this machine, while its
    process lives; elsewhere, while its heartbeat is younger than :data:`LEASE_SECONDS`."""
    host, _, rest = owner.rpartition(":")[0].rpartition(":")
    pid = int(rest) if rest.isdigit() else -1
    if host == socket.gethostname() and pid > 0:
        return process_alive(pid)
    return isinstance(heartbeat, int | float) and time.time() - heartbeat < LEASE_SECONDS


class Lease:
    """The lease at ``path`` of collection ``collection``'s meta_info entry, held by this process."""

    def __init__(self, conn: Connection, collection: str, path: str, owner: str, taken_from: str | None):
        self.conn, self.collection, self.path, self.owner = conn, collection, path, owner
        self.taken_from = taken_from  # the stopped holder this one took over from, if any

    @classmethod
    def take(cls, conn: Connection, collection: str, path: str) -> Lease:
        """Hold the lease at ``path``.

        Raises:
            LeaseHeld: a live process holds it.
            LeaseContested: other processes keep taking it while this one tries.
        """
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        meta = conn.meta
        # The entry exists before the conditional update takes the lease.
        meta.update_one({"collection": collection}, {"$setOnInsert": {"collection": collection}}, upsert=True)
        for _ in range(_ATTEMPTS):
            entry = meta.find_one({"collection": collection}, {"_id": 0, path: 1}) or {}
            held = _at(entry, path)
            holder, heartbeat = held.get("owner"), held.get("heartbeat")
            if holder and alive(str(holder), heartbeat):
                age = time.time() - heartbeat if isinstance(heartbeat, int | float) else 0.0
                raise LeaseHeld(str(holder), age)
            # Taken only if nobody took it since it was read (a racing process reads it held, above).
            took = meta.update_one(
                {"collection": collection, f"{path}.owner": holder},
                {"$set": {f"{path}.owner": owner, f"{path}.heartbeat": time.time()}},
            )
            if took.modified_count == 1:
                return cls(conn, collection, path, owner, str(holder) if holder else None)
        raise LeaseContested(f"{collection}: other processes keep taking {path!r}; run one at a time")

    def update(self, update: dict[str, Any]) -> None:
        """Apply ``update`` to the meta_info entry while this process holds the lease (each field of it
        written so that a retry lands once: ``$set``, ``$max``, ``$unset``).

        Raises:
            LeaseLost: another process took the lease over.
        """
        held = {"collection": self.collection, f"{self.path}.owner": self.owner}
        meta, config = self.conn.meta, self.conn.config
        done = with_retries(lambda: meta.update_one(held, update), config, "recording progress")
        if done.matched_count == 0:
            raise LeaseLost(f"{self.collection}: another process took {self.path!r} over")

    def beat(self) -> None:
        """A sign of life.

        Raises:
            LeaseLost: another process took the lease over.
        """
        self.update({"$set": {f"{self.path}.heartbeat": time.time()}})

    def release(self) -> None:
        """Let go (whatever ended the work: another process may take it at once)."""
        held = {"collection": self.collection, f"{self.path}.owner": self.owner}
        try:
            self.conn.meta.update_one(held, {"$set": {f"{self.path}.owner": None}})
        except DatabaseError as exc:  # the server is gone: the error that ended the work says more
            log.debug("%s: %s not released (%s)", self.collection, self.path, exc)


def _at(entry: dict[str, Any], path: str) -> dict[str, Any]:
    for part in path.split("."):
        entry = entry.get(part) if isinstance(entry, dict) else None  # type: ignore[assignment]
    return entry if isinstance(entry, dict) else {}
