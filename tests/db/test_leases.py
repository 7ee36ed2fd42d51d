"""One writer at a time: the lease ingest and `dsgpt2 index` hold in meta_info."""

from __future__ import annotations

import os
import socket
import time

import pytest

from conftest import make_config
from dsgpt2.db.client import Connection
from dsgpt2.db.leases import LEASE_SECONDS, Lease, LeaseHeld, LeaseLost, alive


def _entry(conn: Connection) -> dict:
    return conn.meta.find_one({"collection": "a"}, {"_id": 0}) or {}


def test_a_lease_has_one_holder_until_it_lets_go() -> None:
    conn = Connection(make_config(["a"]))
    first = Lease.take(conn, "a", "sources.k")
    assert first.taken_from is None and _entry(conn)["sources"]["k"]["owner"] == first.owner
    # This process lives: its lease is refused to a second taker, whatever the heartbeat's age.
    conn.meta.update_one({"collection": "a"}, {"$set": {"sources.k.heartbeat": 0}})
    with pytest.raises(LeaseHeld) as held:
        Lease.take(conn, "a", "sources.k")
    assert held.value.holder == first.owner
    first.update({"$set": {"sources.k.records": 5}})
    first.beat()
    assert _entry(conn)["sources"]["k"]["records"] == 5
    first.release()
    second = Lease.take(conn, "a", "sources.k")
    assert second.owner != first.owner and second.taken_from is None
    # The first holder, back, finds its lease gone: none of its writes lands.
    with pytest.raises(LeaseLost):
        first.update({"$set": {"sources.k.records": 9}})
    assert _entry(conn)["sources"]["k"]["records"] == 5
    # Another path of the same entry is another lease.
    assert Lease.take(conn, "a", "indexing").owner != second.owner


def test_a_holder_elsewhere_is_alive_while_its_heartbeat_is_young() -> None:
    conn = Connection(make_config(["a"]))
    away = {"indexing": {"owner": "elsewhere:42:beef", "heartbeat": time.time()}}
    conn.meta.update_one({"collection": "a"}, {"$set": away}, upsert=True)
    with pytest.raises(LeaseHeld, match="elsewhere:42:beef holds it"):
        Lease.take(conn, "a", "indexing")
    conn.meta.update_one(
        {"collection": "a"}, {"$set": {"indexing.heartbeat": time.time() - LEASE_SECONDS - 1}}
    )
    taken = Lease.take(conn, "a", "indexing")
    assert taken.taken_from == "elsewhere:42:beef"


def test_a_holder_on_this_machine_is_alive_while_its_process_is() -> None:
    here = socket.gethostname()
    assert alive(f"{here}:{os.getpid()}:x", heartbeat=0)
    gone = 2**22 + 12345  # above any pid this machine hands out
    assert not alive(f"{here}:{gone}:x", heartbeat=time.time())
    assert alive(f"elsewhere:{gone}:x", heartbeat=time.time())
    assert not alive("elsewhere:1:x", heartbeat=None)
