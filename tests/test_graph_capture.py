"""When decode CUDA graphs are captured (``engine/graph_capture.py``), on the CPU: the plan by
itself, and a whole engine whose runner holds fake graphs (``FakeGraphs``: a "replay" runs the
step eagerly, a capture records the call). Checked: the first step never captures; each size is
captured once; while requests are in flight at most one capture falls between two steps, only of
a size the step before ran (no warm-up forward), never with a step in flight; cold sizes only in
idle gaps; sleep drops the graphs and waking re-arms them; the tokens never change."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.graph_capture import GraphCapture
from kvserve.engine.model_runner import ModelRunner
from kvserve.errors import ConfigError
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KEYS = [(8, False), (4, False), (2, False), (1, False)]


class FakeCapturer:
    def __init__(self, keys=KEYS, fail=()):
        self._keys, self.fail, self.events = list(keys), set(fail), []

    def keys(self):
        return self._keys

    def warm_up(self, key):
        self.events.append(("warm_up", key))

    def capture(self, key):
        self.events.append(("capture", key))
        if key in self.fail:
            raise RuntimeError("capture failed")


def _plan(mode, **kw) -> tuple[GraphCapture, FakeCapturer]:
    cap = FakeCapturer(**kw)
    return GraphCapture(mode, cap, lambda e: isinstance(e, torch.OutOfMemoryError)), cap


def test_startup_captures_every_size_before_serving_largest_first():
    plan, cap = _plan("startup")
    plan.start()
    assert cap.events == [e for k in KEYS for e in (("warm_up", k), ("capture", k))]
    assert all(plan.ready(k) for k in KEYS) and not plan.due
    assert plan.capture_next(idle=True) is None


@pytest.mark.parametrize("mode", ["lazy", "background"])
def test_busy_captures_only_the_size_just_run_eagerly(mode):
    plan, cap = _plan(mode)
    plan.start()
    assert cap.events == [] and not plan.ready((2, False))
    assert plan.capture_next(idle=False) is None  # nothing ran yet: nothing is warm
    plan.ran_eagerly((2, False))
    assert plan.due
    assert plan.capture_next(idle=False) == (2, False)
    assert cap.events == [("capture", (2, False))]  # the eager step was its warm-up
    assert plan.ready((2, False)) and not plan.due
    assert plan.capture_next(idle=False) is None


def test_idle_gaps_background_most_used_then_largest():
    plan, cap = _plan("background")
    plan.ran_eagerly((1, False), through_buffers=False)
    plan.ran_eagerly((1, False), through_buffers=False)
    plan.ran_eagerly((2, False), through_buffers=False)
    got = [plan.capture_next(idle=True) for _ in range(5)]
    assert got == [(1, False), (2, False), (8, False), (4, False), None]
    assert cap.events == [e for k in got[:4] for e in (("warm_up", k), ("capture", k))]


def test_idle_gaps_lazy_only_sizes_used():
    plan, cap = _plan("lazy")
    assert plan.capture_next(idle=True) is None
    plan.ran_eagerly((4, False), through_buffers=False)
    assert plan.capture_next(idle=True) == (4, False)
    assert plan.capture_next(idle=True) is None
    assert cap.events == [("warm_up", (4, False)), ("capture", (4, False))]


def test_a_failed_capture_leaves_that_size_eager():
    plan, cap = _plan("background", fail={(8, False)})
    assert plan.capture_next(idle=True) == (8, False)
    assert not plan.ready((8, False))
    plan.ran_eagerly((8, False))
    assert not plan.due and plan.capture_next(idle=True) == (4, False)  # never retried


def test_a_device_fault_in_a_capture_is_raised_once():
    plan, cap = _plan("background")

    def oom(key):
        raise torch.OutOfMemoryError("CUDA out of memory")
    cap.capture = oom
    with pytest.raises(torch.OutOfMemoryError):
        plan.capture_next(idle=True)
    assert plan.failed == {(8, False)}  # the next idle pass moves on instead of failing again


@pytest.mark.parametrize("mode", ["eager", "", None, 1, "LAZY"])
def test_bad_mode_is_a_config_error(mode):
    with pytest.raises(ConfigError) as e:
        LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False, cuda_graph_capture=mode)
    assert e.value.option == "cuda_graph_capture" and "startup, lazy, background" in str(e.value)


# -- a whole engine with fake graphs ----------------------------------------------------------
class FakeGraphs(FakeCapturer):
    """DecodeGraphs' interface on the CPU: up to 8 decode rows; a step through the graphs runs
    the runner's eager forward (so the tokens are the engine's own), recorded as "replay" or
    "eager"; ``events`` also gets every step launched."""

    def __init__(self, runner, events):
        super().__init__()
        self.runner, self.events, self.buckets = runner, events, [1, 2, 4, 8]
        self.capture_seconds, self.memory_bytes = 0.0, 0

    def key(self, n, rows=False):
        return next(b for b in self.buckets if b >= n), False

    def fits(self, batch, width, rows=False):
        return batch <= 8 and not rows

    def capture(self, key):
        eng = ENGINE.get("engine")
        assert eng is None or eng._inflight is None, "a capture while a step is in flight"
        super().capture(key)

    def run(self, ids, positions, slots, seq_lens, tables, res=None, patch=None, rows=False, replay=True):
        self.events.append(("replay" if replay else "eager", self.key(len(ids))))
        rt, bs = self.runner, self.runner.block_size
        seqs = [(int(n) - 1, 1, [int(b) for b in tables[i, :-(-int(n) // bs)]]) for i, n in enumerate(seq_lens)]
        return rt._forward([int(t) for t in ids], seqs, patch=patch, model=(rt.model, rt.kv_cache.layers, None))[0]


ENGINE: dict = {}


@pytest.fixture
def fake_graphs(monkeypatch):
    """Every runner built in the test gets FakeGraphs where CUDA would capture real ones (also
    on waking); returns the shared event list."""
    events: list = []
    launch = ModelRunner.launch

    def prepare_device(self):
        self.graphs = FakeGraphs(self, events)
        self.arm_graphs(self.graphs)

    def launch_logged(self, out):
        events.append(("step", len(out.scheduled)))
        return launch(self, out)
    monkeypatch.setattr(ModelRunner, "prepare_device", prepare_device)
    monkeypatch.setattr(ModelRunner, "launch", launch_logged)
    yield events
    ENGINE.clear()


def _tiny(**kw) -> LLM:
    llm = LLM("dummy:tiny", device="cpu", kv_cache_memory="16MiB", show_progress=False, block_size=4, **kw)
    ENGINE["engine"] = llm.engine
    return llm


PROMPTS = [[3 + i, 9, 27, 4 + 2 * i, 100 + i][: 2 + i % 4] for i in range(6)]


def _run(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                         use_tqdm=False)]


def _check_busy_rule(events: list) -> None:
    """Between two steps at most one capture, no warm-up, and only of the size the step just
    before it ran eagerly (a step's graph run is logged after its launch); the first step and
    what comes before it capture nothing."""
    steps = [i for i, e in enumerate(events) if e[0] == "step"]
    assert steps and not any(e[0] in ("capture", "warm_up") for e in events[:steps[0]])
    for a, b in zip(steps, steps[1:] + [len(events)]):
        between = events[a + 1:b]
        caps = [i for i, e in enumerate(between) if e[0] == "capture"]
        assert len(caps) <= 1 and not any(e[0] == "warm_up" for e in between), between
        if caps:
            assert ("eager", between[caps[0]][1]) in between[:caps[0]], between


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", ["lazy", "background"])
def test_engine_captures_each_size_once_after_its_first_step(fake_graphs, mode, async_scheduling):
    ref = _run(_tiny(enforce_eager=True, async_scheduling=async_scheduling))
    fake_graphs.clear()
    llm = _tiny(cuda_graph_capture=mode, async_scheduling=async_scheduling)
    assert fake_graphs == []  # nothing captured at start-up
    assert _run(llm) == ref
    _check_busy_rule(fake_graphs)
    runs = [e for e in fake_graphs if e[0] in ("eager", "replay")]
    assert runs[0][0] == "eager"
    caps = [e[1] for e in fake_graphs if e[0] == "capture"]
    assert caps and len(caps) == len(set(caps))
    for key in caps:  # eager until captured, replayed after
        first_cap = fake_graphs.index(("capture", key))
        assert ("replay", key) not in fake_graphs[:first_cap]
        assert ("eager", key) not in fake_graphs[first_cap:]
    fake_graphs.clear()
    assert _run(llm) == ref  # a second batch: the sizes seen replay, nothing more is captured
    assert not any(e[0] == "capture" for e in fake_graphs)
    assert not any(e[0] == "eager" and e[1] in caps for e in fake_graphs)


def test_idle_gaps_capture_the_rest_one_at_a_time(fake_graphs):
    llm = _tiny(cuda_graph_capture="background")
    eng = llm.engine
    _run(llm, PROMPTS[:1])  # one sequence: size 1, captured after its first decode step
    assert [e for e in fake_graphs if e[0] == "capture"] == [("capture", (1, False))]
    fake_graphs.clear()
    while eng.capture_idle_graph():
        pass
    assert fake_graphs == [e for k in [(8, False), (4, False), (2, False)]
                           for e in (("warm_up", k), ("capture", k))]
    eng.add_request("r", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    eng.step()
    assert not eng.capture_idle_graph()  # a request in flight: no idle capture


def test_lazy_idle_gap_captures_nothing_unused(fake_graphs):
    llm = _tiny(cuda_graph_capture="lazy")
    assert not llm.engine.capture_idle_graph() and fake_graphs == []


def test_sleep_drops_the_graphs_and_wake_rearms_them(fake_graphs):
    llm = _tiny(cuda_graph_capture="lazy", enable_sleep_mode=True)
    ref = _run(llm)
    first = [e for e in fake_graphs if e[0] == "capture"]
    llm.sleep(1)
    rt = llm.engine.runner
    assert rt.graphs is None and rt.graph_capture is None
    assert not llm.engine.capture_idle_graph()  # asleep: nothing to capture
    llm.wake_up()
    assert rt.graph_capture is not None and not rt.graph_capture.captured
    fake_graphs.clear()
    assert _run(llm) == ref
    _check_busy_rule(fake_graphs)
    assert [e for e in fake_graphs if e[0] == "capture"] == first  # the same sizes, again after their first use


def test_the_engine_thread_captures_in_idle_gaps_and_serves_between(fake_graphs):
    """AsyncEngine's idle loop: one capture per pass, the command queue looked at between two;
    a request served meanwhile gets the engine's own tokens."""
    import asyncio

    from kvserve.engine.async_engine import AsyncEngine
    llm = _tiny(cuda_graph_capture="background")
    want = _run(llm, PROMPTS[:1])
    cap = llm.engine.runner.graph_capture
    fake_graphs.clear()

    async def run():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            got = None
            async for out in ae.add_request("r", {"prompt_token_ids": PROMPTS[0]}, GREEDY):
                got = out.outputs[0].token_ids
            for _ in range(500):
                if cap.complete:
                    break
                await asyncio.sleep(0.01)
            return got
        finally:
            ae.shutdown()
    assert asyncio.run(run()) == want[0]
    assert cap.complete and not cap.failed
    caps = [e[1] for e in fake_graphs if e[0] == "capture"]
    assert sorted(caps) == sorted(k for k in KEYS if k != (1, False))  # size 1 was captured before
    idle = [i for i, e in enumerate(fake_graphs) if e[0] == "warm_up"]
    assert all(fake_graphs[i + 1] == ("capture", fake_graphs[i][1]) for i in idle)  # never split by a step
