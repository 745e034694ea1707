"""Stored responses for the Responses API: one SQLite file (WAL), one row per response.

    responses(id, tenant, previous_id, created_at, input_items, output_items, body)

A row holds only its own turn (the input items it was sent, the output items it produced) and
the id of its predecessor; `chain` walks `previous_id` back with a recursive query, so a
conversation of n turns costs n rows, not n^2 items. Every lookup is by (id, tenant): another
tenant's response is as absent as one that never was. Deleting a response removes its row; a
later turn that pointed at it then rebuilds from the turns after it (`chain` stops at the gap).
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time

MAX_CHAIN = 10_000  # turns followed back; ids are fresh per response, so a chain has no cycle

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    previous_id TEXT,
    created_at REAL NOT NULL,
    input_items TEXT NOT NULL,
    output_items TEXT NOT NULL,
    body TEXT NOT NULL
);
"""


def connect(path: str) -> sqlite3.Connection:
    """A connection for use from any thread (callers serialise with their own lock)."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    if path != ":memory:":
        db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer; a crash loses no commit
        db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")
    return db


class ResponseStore:
    """`path`: a file (durable across restarts) or ":memory:" (lost with the process)."""

    def __init__(self, path: str = ":memory:"):
        self.path = path
        self._db = connect(path)
        self._lock = threading.Lock()
        self._db.executescript(_SCHEMA)

    def put(self, rid: str, tenant: str | None, previous_id: str | None, input_items: list[dict],
            output_items: list[dict], body: dict) -> None:
        with self._lock:
            self._db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (rid, tenant or "", previous_id, time.time(), json.dumps(input_items),
                              json.dumps(output_items), json.dumps(body)))

    def get(self, rid: str, tenant: str | None) -> dict | None:
        """The response object as it was returned, or None (unknown, or another tenant's)."""
        with self._lock:
            row = self._db.execute("SELECT body FROM responses WHERE id = ? AND tenant = ?",
                                   (rid, tenant or "")).fetchone()
        return None if row is None else json.loads(row[0])

    def input_items(self, rid: str, tenant: str | None) -> list[dict] | None:
        with self._lock:
            row = self._db.execute("SELECT input_items FROM responses WHERE id = ? AND tenant = ?",
                                   (rid, tenant or "")).fetchone()
        return None if row is None else json.loads(row[0])

    def delete(self, rid: str, tenant: str | None) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ? AND tenant = ?", (rid, tenant or ""))
        return cur.rowcount > 0

    def chain(self, rid: str, tenant: str | None) -> list[tuple[str, list[dict], list[dict]]] | None:
        """(id, input items, output items) of every turn up to and including `rid`, oldest
        first; None if `rid` is not this tenant's. The walk never crosses into another tenant."""
        with self._lock:
            rows = self._db.execute(
                """WITH RECURSIVE turn(id, previous_id, input_items, output_items, depth) AS (
                       SELECT id, previous_id, input_items, output_items, 0 FROM responses
                       WHERE id = ? AND tenant = ?
                       UNION ALL
                       SELECT r.id, r.previous_id, r.input_items, r.output_items, turn.depth + 1
                       FROM responses r JOIN turn ON r.id = turn.previous_id
                       WHERE r.tenant = ? AND turn.depth < ?)
                   SELECT id, input_items, output_items FROM turn ORDER BY depth DESC""",
                (rid, tenant or "", tenant or "", MAX_CHAIN)).fetchall()
        if not rows:
            return None
        return [(r[0], json.loads(r[1]), json.loads(r[2])) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
