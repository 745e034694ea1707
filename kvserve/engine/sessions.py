"""Sessions: which conversations' KV stays on the GPU and which leaves for the tiers.

A session is a conversation whose turns carry the same ``session_id``. At the end of a turn it
remembers the turn's block keys; once it has been idle for ``idle_seconds`` (and is not pinned),
its blocks may leave the GPU prefix cache for the tiers, except blocks that a staying session
also holds (a shared system prompt, a forked history): that session would only load them back.
Time comes from ``clock`` (monotonic seconds), which tests replace.
"""
from __future__ import annotations

import time
from collections.abc import Callable


class Sessions:
    def __init__(self, idle_seconds: float, clock: Callable[[], float] = time.monotonic,
                 check_every: float = 0.25):
        self.idle_seconds = idle_seconds
        self.clock = clock
        self.check_every = check_every
        self.last_active: dict[str, float] = {}
        self.keys: dict[str, list[bytes]] = {}
        self.pinned: set[str] = set()
        self._next_check = 0.0

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.keys

    def __bool__(self) -> bool:
        return bool(self.keys)

    def touch(self, session_id: str) -> None:
        """Its next turn is here: active again, and its blocks stay until the turn runs."""
        if session_id in self.keys:
            self.last_active[session_id] = self.clock()

    def end_turn(self, session_id: str, keys: list[bytes]) -> None:
        self.last_active[session_id] = self.clock()
        self.keys[session_id] = keys

    def pin(self, session_id: str, pinned: bool = True) -> None:
        (self.pinned.add if pinned else self.pinned.discard)(session_id)

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
        now = self.clock()
        going = [sid for sid in self.keys
                 if (only is None or sid == only) and sid not in self.pinned
                 and (force or now - self.last_active[sid] >= self.idle_seconds)]
        if not going:
            return []
        for sid in going:
            self.last_active.pop(sid)
        gone = [self.keys.pop(sid) for sid in going]
        keep = {k for keys in self.keys.values() for k in keys}
        return list(dict.fromkeys(k for keys in gone for k in keys if k not in keep))
