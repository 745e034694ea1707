"""The memory store: facts, past turns as vectors, and relations, per tenant, in one SQLite file.

    facts(id, tenant, subject, predicate, object, source, turn, created_at, embedding)
    cases(id, tenant, source, turn, text, created_at, embedding)      UNIQUE(tenant, source)

A fact is also an edge subject -predicate-> object: `related` follows edges in both directions
with a recursive query, so "where does the owner of Rex live?" reaches (Rex, owned by, Sam) and
(Sam, lives in, Oslo) in two hops. Cases (past turns, or anything an agent wants to recall by
meaning) are found by cosine similarity of their embeddings.

The vector index is numpy over float32 blobs in the same table: a tenant's rows are read and
scored in one matrix product. sqlite-vec would do this inside SQLite, but it needs a Python
whose sqlite3 module can load extensions, which the standard builds here cannot; brute force is
exact and takes well under a millisecond per thousand rows at 384 dimensions.

Every query names its tenant; no method reads across tenants.
"""
from __future__ import annotations

import re
import sqlite3
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvserve.memory.embed import Embedder
from kvserve.memory.responses_db import connect

_SCHEMA = """
CREATE TABLE IF NOT EXISTS facts (
    id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, subject TEXT NOT NULL, predicate TEXT NOT NULL,
    object TEXT NOT NULL, source TEXT, turn INTEGER, created_at REAL NOT NULL, embedding BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS facts_subject ON facts(tenant, subject COLLATE NOCASE);
CREATE INDEX IF NOT EXISTS facts_object ON facts(tenant, object COLLATE NOCASE);
CREATE TABLE IF NOT EXISTS cases (
    id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, source TEXT NOT NULL, turn INTEGER, text TEXT NOT NULL,
    created_at REAL NOT NULL, embedding BLOB NOT NULL, UNIQUE(tenant, source));
"""


@dataclass(frozen=True)
class Fact:
    id: int
    subject: str
    predicate: str
    object: str
    source: str | None
    turn: int | None
    created_at: float

    @property
    def text(self) -> str:
        return f"{self.subject} {self.predicate} {self.object}"


@dataclass(frozen=True)
class Case:
    id: int
    source: str
    turn: int | None
    text: str


@dataclass(frozen=True)
class Hit:
    item: Fact | Case
    score: float  # cosine similarity to the query; for `related`, 1 / hops
    why: str


class MemoryStore:
    """`path`: a SQLite file (may be the one the stored responses live in) or ":memory:"."""

    def __init__(self, embed: Embedder, path: str = ":memory:"):
        self.embed, self.path = embed, path
        self._db: sqlite3.Connection = connect(path)
        self._lock = threading.Lock()
        self._db.executescript(_SCHEMA)

    def _vec(self, text: str) -> bytes:
        return np.asarray(self.embed([text])[0], dtype="<f4").tobytes()

    # facts -----------------------------------------------------------------------------------
    def add_fact(self, tenant: str | None, subject: str, predicate: str, obj: str, source: str | None = None,
                 turn: int | None = None) -> int:
        vec = self._vec(f"{subject} {predicate} {obj}")
        with self._lock:
            cur = self._db.execute("INSERT INTO facts (tenant, subject, predicate, object, source, turn, created_at, "
                                   "embedding) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                   (tenant or "", subject, predicate, obj, source, turn, time.time(), vec))
        return cur.lastrowid

    def facts(self, tenant: str | None, subject: str | None = None, predicate: str | None = None,
              obj: str | None = None) -> list[Fact]:
        """Facts matching every given field (case-insensitive), oldest first."""
        where, args = ["tenant = ?"], [tenant or ""]
        for col, v in (("subject", subject), ("predicate", predicate), ("object", obj)):
            if v is not None:
                where.append(f"{col} = ? COLLATE NOCASE")
                args.append(v)
        with self._lock:
            rows = self._db.execute(f"SELECT id, subject, predicate, object, source, turn, created_at FROM facts "
                                    f"WHERE {' AND '.join(where)} ORDER BY id", args).fetchall()
        return [Fact(*r) for r in rows]

    def update_fact(self, tenant: str | None, fact_id: int, obj: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT subject, predicate FROM facts WHERE id = ? AND tenant = ?",
                                   (fact_id, tenant or "")).fetchone()
        if row is None:
            return False
        vec = self._vec(f"{row[0]} {row[1]} {obj}")
        with self._lock:
            self._db.execute("UPDATE facts SET object = ?, embedding = ?, created_at = ? WHERE id = ? AND tenant = ?",
                             (obj, vec, time.time(), fact_id, tenant or ""))
        return True

    def delete_fact(self, tenant: str | None, fact_id: int) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM facts WHERE id = ? AND tenant = ?",
                                    (fact_id, tenant or "")).rowcount > 0

    def remember(self, tenant: str | None, subject: str, predicate: str, obj: str, source: str | None = None,
                 turn: int | None = None) -> int:
        """Set a single-valued fact: the newest statement of (subject, predicate) replaces older ones."""
        old = self.facts(tenant, subject=subject, predicate=predicate)
        for f in old:
            self.delete_fact(tenant, f.id)
        return self.add_fact(tenant, subject, predicate, obj, source, turn)

    def forget_source(self, tenant: str | None, source: str) -> int:
        """Delete every fact and case taken from ``source`` (a deleted response); returns how many."""
        with self._lock:
            return sum(self._db.execute(f"DELETE FROM {table} WHERE tenant = ? AND source = ?",
                                        (tenant or "", source)).rowcount for table in ("facts", "cases"))

    # cases -----------------------------------------------------------------------------------
    def add_case(self, tenant: str | None, source: str, text: str, turn: int | None = None,
                 vector: np.ndarray | None = None) -> int | None:
        """Index a past turn under `source` (e.g. its response id); None if already indexed.
        `vector`: its embedding, if the caller embedded a batch at once."""
        vec = self._vec(text) if vector is None else np.asarray(vector, dtype="<f4").tobytes()
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO cases (tenant, source, turn, text, created_at, embedding) "
                                   "VALUES (?, ?, ?, ?, ?, ?)", (tenant or "", source, turn, text, time.time(), vec))
        return cur.lastrowid if cur.rowcount else None

    def has_case(self, tenant: str | None, source: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM cases WHERE tenant = ? AND source = ?",
                                    (tenant or "", source)).fetchone() is not None

    # retrieval -------------------------------------------------------------------------------
    def _nearest(self, table: str, cols: str, tenant: str | None, query: str, k: int, exclude: set[str]):
        with self._lock:
            rows = self._db.execute(f"SELECT {cols}, embedding FROM {table} WHERE tenant = ?",
                                    (tenant or "",)).fetchall()
        rows = [r for r in rows if table != "cases" or r[1] not in exclude]
        if not rows or k <= 0:
            return []
        mat = np.frombuffer(b"".join(r[-1] for r in rows), dtype="<f4").reshape(len(rows), -1)
        scores = mat @ np.asarray(self.embed([query])[0], dtype=np.float32)
        order = np.argsort(-scores, kind="stable")[:k]
        return [(rows[i][:-1], float(scores[i])) for i in order]

    def search_facts(self, tenant: str | None, query: str, k: int = 5) -> list[Hit]:
        hits = self._nearest("facts", "id, subject, predicate, object, source, turn, created_at", tenant, query, k,
                             set())
        return [Hit(Fact(*r), s, f"similar to the input (cosine {s:.2f})") for r, s in hits]

    def search_cases(self, tenant: str | None, query: str, k: int = 5, exclude: set[str] = frozenset()) -> list[Hit]:
        hits = self._nearest("cases", "id, source, turn, text", tenant, query, k, exclude)
        return [Hit(Case(*r), s, f"a past turn similar to the input (cosine {s:.2f})") for r, s in hits]

    def related(self, tenant: str | None, entity: str, max_hops: int = 2, limit: int = 20) -> list[Hit]:
        """Facts reachable from `entity` within `max_hops` edges (either direction), nearest first."""
        with self._lock:
            rows = self._db.execute(
                """WITH RECURSIVE reach(node, hops) AS (
                       SELECT ? COLLATE NOCASE, 0
                       UNION
                       SELECT CASE WHEN f.subject = reach.node COLLATE NOCASE THEN f.object ELSE f.subject END,
                              reach.hops + 1
                       FROM facts f JOIN reach
                         ON f.tenant = ? AND (f.subject = reach.node COLLATE NOCASE
                                              OR f.object = reach.node COLLATE NOCASE)
                       WHERE reach.hops < ?)
                   SELECT f.id, f.subject, f.predicate, f.object, f.source, f.turn, f.created_at, MIN(r.hops) + 1
                   FROM facts f JOIN reach r
                     ON f.tenant = ? AND (f.subject = r.node COLLATE NOCASE OR f.object = r.node COLLATE NOCASE)
                   WHERE r.hops < ?
                   GROUP BY f.id ORDER BY MIN(r.hops), f.id LIMIT ?""",
                (entity, tenant or "", max_hops, tenant or "", max_hops, limit)).fetchall()
        return [Hit(Fact(*r[:7]), 1.0 / r[7], f"{r[7]} hop{'s' if r[7] > 1 else ''} from {entity!r}") for r in rows]


# Rule-based extraction: a small model (the 135M default) does not fill an extraction schema
# reliably, so facts come from first-person statements of these shapes; anything else is still
# recalled as a case by similarity.
_RULES = [
    (re.compile(r"\bmy ([a-z][a-z' ]{1,40}?) (?:is|are) (?:called |named )?([^.,;!?]{1,80})", re.I), "user", None),
    (re.compile(r"\bI (live|work|study|grew up|was born) (in|at|for) ([^.,;!?]{1,80})", re.I), "user", "verb"),
    (re.compile(r"\bI (like|love|hate|prefer|own|drive|speak|play) ([^.,;!?]{1,80})", re.I), "user", "simple"),
    (re.compile(r"\bI am (allergic to|afraid of|married to) ([^.,;!?]{1,80})", re.I), "user", "simple"),
    (re.compile(r"\b([A-Z][a-z]+)(?:'s)? ([a-z][a-z ]{1,30}?) is ([^.,;!?]{1,80})"), None, "possessive"),
]


def extract_facts(text: str) -> list[tuple[str, str, str]]:
    """(subject, predicate, object) triples stated in `text`."""
    out = []
    for rx, subject, kind in _RULES:
        for m in rx.finditer(text):
            g = [x.strip() for x in m.groups()]
            if kind is None:
                out.append((subject, g[0].lower(), g[1]))
            elif kind == "verb":
                out.append((subject, f"{g[0].lower()} {g[1].lower()}", g[2]))
            elif kind == "simple":
                out.append((subject, g[0].lower(), g[1]))
            elif g[0].lower() not in ("my", "i", "it", "this", "that", "the", "there", "what", "who"):
                out.append((g[0], g[1].lower(), g[2]))
    return out
