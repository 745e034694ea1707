"""KV cache groups: how the layers of a model with sliding-window layers share the KV pool.

A group is a set of layers with the same attention window; every group's page (a block of the
pool) holds ``page_layers`` layers, so one pool of equal pages serves them all, and each request
holds one block table per group. Gemma-3-270M (18 layers, 15 local with a 512-token window, 3
global) gets six groups of three layers:

    group 0  global  layers  5 11 17     table [ 4,  9, 12, 30, 31, 33, 40 ]   every block
    group 1  local   layers  0  1  2     table [ -, -, -, -, 35, 36, 41 ]      the window's
    ...                                                                      blocks only
    group 5  local   layers 26 27 28 ...

A local group's table keeps every position (its ``p // block_size`` entry is the block of token
``p``) but entries wholly before every future query's window are ``NULL``: their blocks went
back to the pool as decoding advanced. So a context many windows long holds, per token, the KV of
the global layers plus ``window / context`` of the local ones'.

``page_layers`` is the greatest common divisor of the groups' layer counts, so no page slot
is wasted: 270M gives 3 (15 = 5 x 3 local, 3 global), Gemma-3-27B 2 (52 local, 10 global).
With one window for every layer (all global, or all local as Mistral's configs) there is one
group of all the layers and the pool is what it was without groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

NULL = -1  # a local table's entry whose block was freed (out of every future query's window)


def held_before(table: list[int], stop: int, floor: int = 0) -> list[int]:
    """The indices of ``table[floor:stop]`` up to the first NULL entry before ``stop`` (the NULLs
    run back from it), tail first."""
    held = []
    for i in range(stop - 1, floor - 1, -1):
        if table[i] == NULL:
            break
        held.append(i)
    return held


def null_before(table: list[int], stop: int, floor: int = 0) -> list[int]:
    """Set ``held_before``'s entries to NULL and return the blocks taken out, tail first."""
    freed = [table[i] for i in held_before(table, stop, floor)]
    table[stop - len(freed):stop] = [NULL] * len(freed)
    return freed


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group (None: global)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its index within its group's page
    page_layers: int  # layers one page (block) holds

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.windows)


def plan_groups(layer_windows: tuple[int | None, ...], num_layers: int, free_windows: bool = True) -> KVGroups:
    """The groups of a model whose layer ``i`` has window ``layer_windows[i]`` (empty: all global).
    Without ``free_windows`` every layer shares one group and one table (no block is freed)."""
    windows = tuple(layer_windows) or (None,) * num_layers
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # global first
    if not free_windows or len(kinds) == 1:
        w = kinds[0] if free_windows else None
        return KVGroups((w,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    k = 0
    for layers in members.values():
        k = gcd(k, len(layers))
    group_windows, layer_group, layer_slot = [], [0] * num_layers, [0] * num_layers
    for w in kinds:
        layers = members[w]
        for start in range(0, len(layers), k):
            for slot, i in enumerate(layers[start:start + k]):
                layer_group[i], layer_slot[i] = len(group_windows), slot
            group_windows.append(w)
    return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), k)
