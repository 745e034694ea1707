"""Sessions: which conversations' KV stays on the GPU and which leaves for the tiers.

A session is a conversation whose turns carry the same ``session_id``. At the end of a turn it
remembers the turn's block keys; once it has been idle for ``idle_seconds`` (and is not pinned),
its blocks may leave the GPU prefix cache for the tiers, except blocks that a staying session
also holds (a shared system prompt, a forked history): that session would only load them back.

The table is bounded, so no stream of new ids can grow it: a session unused for ``ttl_seconds``
is forgotten (a pinned one only through the cap), and past ``max_sessions`` the least recently
used goes, unpinned ones first. Forgetting a session drops its entry only; its blocks stay in
the prefix cache as ordinary cached blocks. Time comes from ``clock`` (monotonic seconds),
which tests replace.

Invariant: ``last_active`` holds exactly the known sessions, least recently used first;
``keys`` and ``pinned`` hold only known sessions.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class Sessions:
    def __init__(self, idle_seconds: float, clock: Callable[[], float] = time.monotonic,
                 check_every: float = 0.25, max_sessions: int = 4096, ttl_seconds: float = 3600.0):
        self.idle_seconds = idle_seconds
        self.clock = clock
        self.check_every = check_every
        self.max_sessions = max_sessions
        self.ttl_seconds = ttl_seconds
        self.last_active: OrderedDict[str, float] = OrderedDict()
        self.keys: dict[str, list[bytes]] = {}
        self.pinned: set[str] = set()
        self._next_check = 0.0

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.last_active

    def __len__(self) -> int:
        return len(self.last_active)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def touch(self, session_id: str) -> None:
        """Its next turn is here: active again, and its blocks stay until the turn runs."""
        if session_id in self.last_active:
            self._use(session_id)
        else:
            self.expire()

    def end_turn(self, session_id: str, keys: list[bytes]) -> None:
        self.keys[session_id] = keys
        self._use(session_id)  # (past the cap of pinned sessions, it may be the one to go)

    def pin(self, session_id: str, pinned: bool = True) -> None:
        """Pinning an id not seen yet starts it (its first turn's blocks then stay)."""
        if pinned:
            self.pinned.add(session_id)
            self._use(session_id)
        else:
            self.pinned.discard(session_id)
            self.expire()

    def _use(self, session_id: str) -> None:
        self.last_active[session_id] = self.clock()
        self.last_active.move_to_end(session_id)
        self.expire()

    def expire(self) -> None:
        """Forget sessions past their TTL, then the least recently used beyond the cap."""
        now = self.clock()
        for sid, t in list(self.last_active.items()):
            if now - t < self.ttl_seconds:
                break  # the rest are newer
            if sid not in self.pinned:
                self._forget(sid)
        while len(self.last_active) > self.max_sessions:
            lru = next((s for s in self.last_active if s not in self.pinned), next(iter(self.last_active)))
            self._forget(lru)

    def _forget(self, session_id: str) -> None:
        self.last_active.pop(session_id, None)
        self.keys.pop(session_id, None)
        self.pinned.discard(session_id)

    def due(self) -> bool:
        """Whether the periodic idle check should run now (at most every ``check_every`` s)."""
        now = self.clock()
        if not self.keys or now < self._next_check:
            return False
        self._next_check = now + self.check_every
        return True

    def take_idle(self, force: bool = False, only: str | None = None) -> list[bytes]:
        """Forget the sessions that go (idle, or all unpinned with ``force``; ``only``: just
        that one) and return the keys of their blocks that no staying session holds."""
        self.expire()
        now = self.clock()
        going = [sid for sid in self.keys
                 if (only is None or sid == only) and sid not in self.pinned
                 and (force or now - self.last_active[sid] >= self.idle_seconds)]
        if not going:
            return []
        gone = [self.keys[sid] for sid in going]
        for sid in going:
            self._forget(sid)
        keep = {k for keys in self.keys.values() for k in keys}
        return list(dict.fromkeys(k for keys in gone for k in keys if k not in keep))
