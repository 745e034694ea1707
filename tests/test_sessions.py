"""The session table stays bounded: a TTL and an LRU cap (pinned sessions go last), on a fake
clock; a hypothesis run of random turns, pins and idle checks keeps its invariants."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.sessions import Sessions

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _sessions(**kw) -> tuple[Sessions, Clock]:
    clock = Clock()
    return Sessions(idle_seconds=30, clock=clock, **{"max_sessions": 3, "ttl_seconds": 100, **kw}), clock


def test_ttl_forgets_unused_sessions_but_not_pinned_ones():
    s, clock = _sessions()
    s.end_turn("a", [b"ka"])
    s.pin("p")
    clock.t += 60
    s.end_turn("b", [b"kb"])
    clock.t += 41  # "a" and "p" unused for 101 s, "b" for 41 s
    s.touch("b")
    assert "a" not in s and "b" in s and "p" in s
    assert set(s.keys) == {"b"} and s.pinned == {"p"}


def test_cap_forgets_the_least_recently_used_unpinned_first():
    s, clock = _sessions()
    s.pin("p")
    for sid in ("a", "b"):
        clock.t += 1
        s.end_turn(sid, [sid.encode()])
    clock.t += 1
    s.touch("a")  # "b" is now the least recently used unpinned
    s.end_turn("c", [b"c"])
    assert set(s.last_active) == {"p", "a", "c"} and len(s) == 3
    assert s.keys == {"a": [b"a"], "c": [b"c"]}


def test_many_distinct_ids_stay_within_the_cap():
    s, _ = _sessions(max_sessions=50)
    for i in range(10_000):
        s.end_turn(f"s{i}", [i.to_bytes(8, "little")])
    assert len(s) == 50 and len(s.keys) == 50
    assert "s9999" in s and "s9949" not in s


def test_unpin_of_an_unknown_id_creates_nothing():
    s, _ = _sessions()
    s.pin("ghost", False)
    assert "ghost" not in s and not s.pinned


ops = st.lists(st.tuples(st.sampled_from(["turn", "touch", "pin", "unpin", "idle", "force", "wait"]),
                         st.integers(0, 7), st.floats(0, 80)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_the_table_bounded(steps):
    s, clock = _sessions(max_sessions=4, ttl_seconds=100)
    for op, i, dt in steps:
        sid = f"s{i}"
        if op == "turn":
            s.end_turn(sid, [bytes([i]), b"shared"])
        elif op == "touch":
            s.touch(sid)
        elif op in ("pin", "unpin"):
            s.pin(sid, op == "pin")
        elif op in ("idle", "force"):
            gone = s.take_idle(force=op == "force")
            assert not set(gone) & {k for keys in s.keys.values() for k in keys}
        else:
            clock.t += dt
        assert len(s) <= 4
        assert set(s.keys) <= set(s.last_active) and s.pinned <= set(s.last_active)
        times = list(s.last_active.values())
        assert times == sorted(times)  # least recently used first
        if op != "wait":  # every change expires what is due
            assert all(clock.t - t < 100 or sid in s.pinned for sid, t in s.last_active.items())
