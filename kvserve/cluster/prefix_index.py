"""Where prefixes are cached across replicas, as the router saw it, and the routing rule.

The router keeps, per replica, the chained block hashes of the prompts it sent there (SGLang's
router keeps the same thing as a radix tree of text). A block's hash chains every block before it
(engine/kv_cache_manager.py: the same ``hash_block`` and ``salt_root``), so a set of hashes *is*
a radix tree: a prompt's cached prefix on a replica is its leading run of hashes found in that
replica's set, and two prompts sharing k blocks share exactly their first k hashes.

Why the router's own record rather than replicas publishing their caches: it is exact about
what it sent, costs no messages on the request path, and is current the moment a request is
routed (a replica's report would lag by its period, so a burst of one prefix would scatter).
What it cannot see, evictions under memory pressure, it approximates with an LRU of about the
replica's KV size in blocks (each replica reports its size and free KV; see router.py).

Invariants:
  1. ``len(held[r]) <= capacity[r]``; the least recently routed hashes go first.
  2. A replica that leaves (died, scaled down) leaves the index, with its sessions.

Rule (``choose``): a request's session goes back to its replica while that replica is a
candidate. Otherwise every candidate is priced in prompt tokens,

    cost(r) = tokens to prefill on r  +  queue_weight * in_flight(r)  +  (full_kv_penalty if r's KV is nearly full)

and the cheapest wins (ties: the least loaded, then the one holding fewest blocks). A replica
batches continuously, so a request it is running costs a newcomer one decode row in each step of
its prefill, a few prompt tokens' worth, not a place in a queue: a conversation stays where its
history is cached until its replica holds many more requests than another (ten more outweigh 320
cached tokens). The in-flight count is the router's own, exact the moment it routes; a replica's
reported queue lags by its report period and mostly catches requests that just arrived. A
prompt with nothing cached anywhere goes to the least loaded replica.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvserve.engine.kv_cache_manager import hash_block, salt_root


def block_hashes(tokens: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of ``tokens``, as the prefix cache chains them."""
    hashes: list[bytes] = []
    parent = salt_root(cache_salt)
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, b"", list(tokens[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Load:
    """What the router knows of a replica's load when it routes."""
    in_flight: int = 0  # requests it routed there that have not completed
    kv_free: float = 1.0  # the replica's last report: fraction of its KV blocks free


@dataclass
class PrefixIndex:
    block_size: int = 16
    queue_weight: float = 32.0  # prompt tokens one request in flight is worth
    full_kv: float = 0.05  # below this fraction of free KV a replica is priced as full
    full_kv_penalty: float = 1e6
    default_capacity: int = 4096  # blocks per replica until it reports its size
    held: dict[Hashable, OrderedDict] = field(default_factory=dict)
    capacity: dict[Hashable, int] = field(default_factory=dict)
    sessions: OrderedDict = field(default_factory=OrderedDict)  # session key -> replica
    max_sessions: int = 65536

    def matched(self, replica: Hashable, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` the replica is believed to hold."""
        held = self.held.get(replica)
        n = 0
        if held:
            for h in hashes:
                if h not in held:
                    break
                n += 1
        return n

    def record(self, replica: Hashable, hashes: Sequence[bytes], session: Hashable | None = None) -> None:
        """The request with these hashes went to ``replica``: it holds them now."""
        held = self.held.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        cap = self.capacity.get(replica, self.default_capacity)
        while len(held) > cap:
            held.popitem(last=False)
        if session is not None:
            self.sessions[session] = replica
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def set_capacity(self, replica: Hashable, blocks: int) -> None:
        self.capacity[replica] = max(1, blocks)

    def forget(self, replica: Hashable) -> None:
        self.held.pop(replica, None)
        self.capacity.pop(replica, None)
        for s in [s for s, r in self.sessions.items() if r == replica]:
            del self.sessions[s]

    def keep_only(self, replicas: set) -> None:
        for r in [r for r in self.held if r not in replicas]:
            self.forget(r)
        for s in [s for s, r in self.sessions.items() if r not in replicas]:
            del self.sessions[s]

    def cost(self, replica: Hashable, hashes: Sequence[bytes], num_tokens: int, load: Load) -> float:
        prefill = num_tokens - self.matched(replica, hashes) * self.block_size
        full = self.full_kv_penalty if load.kv_free < self.full_kv else 0.0
        return prefill + self.queue_weight * load.in_flight + full

    def choose(self, candidates: Sequence[Hashable], hashes: Sequence[bytes], num_tokens: int,
               loads: dict[Hashable, Load], session: Hashable | None = None) -> list[Hashable]:
        """``candidates`` ranked best first (the router tries them in order)."""
        if not candidates:
            return []
        sticky = self.sessions.get(session) if session is not None else None

        def key(r):
            ld = loads.get(r, Load())
            return (r != sticky, self.cost(r, hashes, num_tokens, ld), ld.in_flight, len(self.held.get(r, ())))
        return sorted(candidates, key=key)
