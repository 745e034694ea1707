"""Progress bars while loading (weights, snapshots, CUDA graph capture): tqdm on stderr, shown
only where someone watches (``show_progress`` and stderr a terminal), so logs and pipes stay clean."""
from __future__ import annotations

import sys
from collections.abc import Iterable


def progress(show: bool, desc: str, unit: str, iterable: Iterable | None = None, total: int | None = None):
    """A bar over ``iterable`` (or one advanced by ``update`` when None); where no bar is shown,
    ``iterable`` itself (None without one)."""
    if not (show and sys.stderr.isatty()):
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
