"""When each decode CUDA graph is captured (``EngineConfig.cuda_graph_capture``).

    startup     every graph before the engine serves (start-up pays for all of them)
    lazy        a graph at the first use of its batch size: that step runs eagerly through
                the graph's own buffers, and the capture follows it before the next step
    background  lazy while requests run; in the idle gaps, the sizes not captured yet, one
                per gap, the most used first, then the largest

A key is (bucket, rows): a decode batch size and whether the graph is for verify rows
(``engine/decode_rows.py``). Its states:

    cold --eager step through the buffers--> warm --capture--> captured
      └──────────── idle gap: warm-up forward + capture ───────────┘

A warm key's kernels are compiled for its shape and the allocator holds its buffers (the step
that just ran it was the warm-up), so its capture only records that forward's launches: about
the host time of the eager step it follows. Hence the rule that bounds what a request waits:

- While requests are in flight, at most one capture between two steps, and only of a warm key:
  a waiting request is held up by at most one recorded forward beside its own eager step.
- A cold key is captured only in an idle gap (warm-up forward + capture), one per gap; the
  engine thread looks at its command queue between two, so a request that arrives waits for at
  most the one capture under way.
- Nothing is captured before the first step (except in ``startup`` mode, before serving).

Idle gaps are those of the server's engine thread (``AsyncEngine``); the offline ``LLM`` has
none, so there ``background`` captures as ``lazy`` does.

The device calls sit behind ``Capturer`` (``DecodeGraphs`` on CUDA; a fake in the CPU tests).
Captures run on the engine thread only, between steps with nothing in flight: ``LLMEngine.step``
does not launch a step ahead while a capture is due, and the capture synchronizes the device
before it records, so it never overlaps other work on the stream. Sleep drops the graphs (and
this plan with them); waking builds a new plan, armed afresh.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Protocol

log = logging.getLogger(__name__)

MODES = ("startup", "lazy", "background")


class Capturer(Protocol):
    def keys(self) -> list[Hashable]:
        """Every key that may be captured, largest first."""

    def warm_up(self, key: Hashable) -> None:
        """Run the key's forward once eagerly through its buffers (compile, warm the allocator)."""

    def capture(self, key: Hashable) -> None:
        """Record the key's forward into a graph (after a warm-up, or an eager step of that key)."""


class GraphCapture:
    def __init__(self, mode: str, capturer: Capturer, is_device_fault: Callable[[BaseException], bool]):
        assert mode in MODES, mode
        self.mode = mode
        self.capturer = capturer
        self.order = list(capturer.keys())  # largest first: later (smaller) captures reuse its pool
        self.captured: set = set()
        self.warm: set = set()
        self.failed: set = set()  # captures that raised: those sizes run eagerly from then on
        self.uses: Counter = Counter()  # eager steps by key
        self._is_device_fault = is_device_fault

    def start(self, progress: Callable | None = None) -> None:
        """``startup`` mode: capture every key now (``progress`` wraps the key list: a bar)."""
        if self.mode != "startup":
            return
        keys = progress(self.order) if progress is not None else self.order
        for key in keys:
            self._capture(key)

    def ready(self, key) -> bool:
        """Whether a step of ``key`` replays its graph (else it runs eagerly)."""
        return key in self.captured

    def ran_eagerly(self, key, through_buffers: bool = True) -> None:
        """A step of ``key`` ran eagerly; ``through_buffers``: on the graph's own buffers and
        shapes, so the key is warm."""
        self.uses[key] += 1
        if through_buffers and key not in self.failed and key not in self.captured:
            self.warm.add(key)

    @property
    def due(self) -> bool:
        """A warm key waits for its capture: the next gap between steps is for it. (Checked on
        every step: ``warm`` holds only keys not captured, so this is one truth test.)"""
        return bool(self.warm) and self.mode != "startup"

    @property
    def complete(self) -> bool:
        """Every key captured (or given up on)."""
        return len(self.captured) + len(self.failed) == len(self.order)

    def next_key(self, idle: bool):
        """The key to capture now, or None. Busy: a warm one (the most used). Idle: lazy, the
        keys used so far; background, every key, the most used first, then the largest."""
        if self.mode == "startup":
            return None
        left = [k for k in self.order if k not in self.captured and k not in self.failed]
        warm = [k for k in left if k in self.warm]
        if warm:
            return max(warm, key=lambda k: self.uses[k])  # max keeps the first (largest) of a tie
        if not idle:
            return None
        if self.mode == "lazy":
            left = [k for k in left if self.uses[k]]
        return max(left, key=lambda k: self.uses[k]) if left else None

    def capture_next(self, idle: bool):
        """Capture the key ``next_key(idle)`` names, if any; returns it (None: nothing to do)."""
        key = self.next_key(idle)
        if key is not None:
            self._capture(key)
        return key

    def _capture(self, key) -> None:
        try:
            if key not in self.warm:
                self.capturer.warm_up(key)
            self.capturer.capture(key)
        except Exception as e:  # noqa: BLE001 - that size runs eagerly; a device fault ends the engine
            self.failed.add(key)
            self.warm.discard(key)
            if self._is_device_fault(e):
                raise
            log.warning("CUDA graph capture of %s failed; that batch size runs eagerly: %r", key, e)
        else:
            self.captured.add(key)
        self.warm.discard(key)
