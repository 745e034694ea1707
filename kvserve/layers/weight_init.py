"""Layers built for weights a loader is about to write skip torch's random initialisation.

``nn.Linear`` and ``nn.Embedding`` fill their weights with random numbers when built: for a
model of billions of parameters, seconds of CPU time (or a pass over device memory) spent on
values overwritten at once. Inside ``loaded_later()`` kvserve's ``Linear`` and ``Embedding``
keep the memory as allocated. Only a loader that writes every parameter (and checks it did) may
build inside it: the parameters hold whatever the allocator left there until then.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import nn

_SKIP = ContextVar("kvserve_weights_loaded_later", default=False)


@contextmanager
def loaded_later() -> Iterator[None]:
    """Layers built inside (this thread only) leave their weights uninitialised."""
    token = _SKIP.set(True)
    try:
        yield
    finally:
        _SKIP.reset(token)


def initialising() -> bool:
    return not _SKIP.get()


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        if initialising():
            super().reset_parameters()
