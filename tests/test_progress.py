"""Progress bars while loading: on stderr when it is a terminal and show_progress is on; nothing
on a pipe or with show_progress off (``kvserve/progress.py``)."""
from __future__ import annotations

import io

import pytest
import tqdm

from kvserve import progress as progress_mod
from kvserve.engine.graph_capture import GraphCapture
from kvserve.llm import LLM
from tests.test_bad_input import _tiny_hf_dir
from tests.test_graph_capture import KEYS, FakeCapturer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty, show, bar", [(True, True, True), (False, True, False), (True, False, False)])
def test_a_bar_only_on_a_terminal_when_asked(monkeypatch, tty, show, bar):
    err = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(progress_mod.sys, "stderr", err)
    items = [1, 2, 3]
    got = progress_mod.progress(show, "Loading weights", "tensor", items)
    assert isinstance(got, tqdm.tqdm) == bar and list(got) == items
    assert progress_mod.progress(show, "x", "tensor", total=3) is None or bar
    assert ("Loading weights" in err.getvalue()) == bar


def test_weights_and_startup_capture_show_their_bars(monkeypatch, tmp_path):
    err = Terminal()
    monkeypatch.setattr(progress_mod.sys, "stderr", err)
    LLM(_tiny_hf_dir(str(tmp_path / "hf")), kv_cache_memory="16MiB", tokenizer=None)
    assert "Loading weights" in err.getvalue() and "tensor" in err.getvalue()
    cap = FakeCapturer()
    GraphCapture("startup", cap, lambda e: False).start(
        lambda keys: progress_mod.progress(True, "Capturing CUDA graphs", "graph", keys))
    assert f"Capturing CUDA graphs:   0%|          | 0/{len(KEYS)}" in err.getvalue()
    assert [k for op, k in cap.events if op == "capture"] == KEYS
