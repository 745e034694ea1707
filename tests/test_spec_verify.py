"""Speculative decoding's pieces without a model: n-gram lookup, and the verification rule,
whose output must be distributed exactly as the target's (scipy's chi-square tests against
distributions torch computes from the logits)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from kvserve.config import SpeculativeConfig
from kvserve.engine.sampler import SamplingRow
from kvserve.engine.spec import rejection
from kvserve.engine.spec.ngram import propose_ngram
from kvserve.engine.spec.policy import SpecPolicy

pytestmark = pytest.mark.unit

VOCAB = 12
N = 6000


def _row(temperature: float = 1.0) -> SamplingRow:
    return SamplingRow(temperature=temperature, top_k=-1, top_p=1.0, min_p=0.0, generator=None, num_logprobs=None)


def test_ngram_drafts_follow_the_latest_earlier_match():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 2, 5) == [4, 5, 9]
    assert propose_ngram([1, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2, 2, 5) == [8, 2]  # the latest of two matches
    assert propose_ngram([1, 2, 3, 4], 3, 2, 5) == []  # no suffix recurs
    assert propose_ngram([9, 1, 2, 1, 2], 5, 2, 5) == [1, 2, 1, 2, 1]  # a repeat overlapping the suffix
    assert propose_ngram([4, 5, 6, 0, 5, 6], 2, 3, 5) == []  # the 2-gram recurs, but min is 3


def test_ngram_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        toks = rng.integers(0, 4, size=int(rng.integers(2, 40))).tolist()
        got = propose_ngram(toks, 3, 2, 4)
        want = []
        L = len(toks)
        for n in range(min(4, L - 1), 1, -1):
            starts = [s for s in range(L - n) if toks[s:s + n] == toks[L - n:]]
            if starts:
                want = toks[starts[-1] + n:starts[-1] + n + 3]
                break
        assert got[:len(want)] == want


def test_greedy_keeps_the_argmax_prefix():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    best = logits.argmax(dim=-1).tolist()
    g = torch.Generator().manual_seed(0)
    wrong = (best[1] + 1) % VOCAB
    assert rejection.verify_request(logits, _row(0.0), [best[0], wrong, best[2]], None, g) == [best[0], best[1]]
    assert rejection.verify_request(logits, _row(0.0), best[:3], None, g) == best  # all kept, one more


def _first_tokens(logits, drafts, q, temperature=1.0, rule=rejection.verify_request):
    g = torch.Generator().manual_seed(1)
    return np.bincount([rule(logits, _row(temperature), drafts, q, g)[0] for _ in range(N)], minlength=VOCAB)


def _p_value(counts, probs):
    probs = probs / probs.sum()
    keep = probs * N >= 5  # chi-square needs expected counts of 5 or more: pool the rest
    exp = np.append(probs[keep], probs[~keep].sum()) * N
    obs = np.append(counts[keep], counts[~keep].sum())
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_point_mass_draft_leaves_the_target_distribution(temperature):
    """The first emitted token is the accepted draft or the residual draw: ~ p either way."""
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB) * 1.5
    p = (logits[0] / temperature).softmax(-1).numpy().astype(np.float64)
    draft = int(np.argsort(p)[-2])  # a likely token, neither certain nor hopeless
    assert _p_value(_first_tokens(logits, [draft, 3], None, temperature), p) > 1e-3


def test_sampled_draft_leaves_the_target_distribution():
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB) * 1.5
    q = torch.randn(1, VOCAB).softmax(-1)
    p = logits[0].softmax(-1).numpy().astype(np.float64)
    g = torch.Generator().manual_seed(4)
    counts = np.zeros(VOCAB, dtype=np.int64)
    for _ in range(N):
        d = int(torch.multinomial(q[0], 1, generator=g))  # the draft is drawn from q
        counts[rejection.verify_request(logits, _row(), [d], q, g)[0]] += 1
    assert _p_value(counts, p) > 1e-3


def test_the_chi_square_catches_a_wrong_rule():
    """Rejecting and then drawing from p itself (not p without the draft) over-weights the
    draft: the same test must reject it, or it proves nothing."""
    def wrong(logits, row, drafts, q, g):
        p = rejection.target_probs(logits, row)
        if float(torch.rand(1, generator=g)) < float(p[0, drafts[0]]):
            return drafts[:1]
        return [int(torch.multinomial(p[0], 1, generator=g))]

    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB) * 1.5
    p = logits[0].softmax(-1).numpy().astype(np.float64)
    draft = int(np.argsort(p)[-2])
    assert _p_value(_first_tokens(logits, [draft, 3], None, rule=wrong), p) < 1e-6


def test_policy_turns_off_at_large_batches_and_shrinks_on_rejection():
    pol = SpecPolicy(SpeculativeConfig("ngram", 8, verify_token_budget=64))
    assert pol.k_for_batch(1) == 8 and pol.k_for_batch(16) == 3 and pol.k_for_batch(32) == 1
    assert pol.k_for_batch(33) == 0  # above verify_token_budget // 2: no drafts

    class R:
        spec_acceptance = 0.5
    r = R()
    for _ in range(20):
        SpecPolicy.observe(r, 4, 0)
    assert r.spec_acceptance < 0.01 and SpecPolicy.k_for_request(r, 8) == 1
    for _ in range(20):
        SpecPolicy.observe(r, 4, 4)
    assert SpecPolicy.k_for_request(r, 8) == 8


def test_a_step_no_request_can_draft_in_is_planned_plain():
    """Every decoding request under a grammar or at its last token: the step is plain, so the
    next can be launched ahead (async scheduling), and the drafting side is not warmed up on
    steps that cannot draft."""
    from kvserve.engine.request import Request
    from kvserve.engine.spec.speculator import Speculator
    from kvserve.sampling_params import SamplingParams

    sp = Speculator(SpeculativeConfig("ngram", 4, prompt_lookup_min=1))
    reqs = [Request(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=9)) for i in range(6)]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1  # decoding
        r.grammar = object()
    reqs[5].grammar, reqs[5].max_tokens = None, 1  # its last token
    assert [sp.plan(reqs) for _ in range(3)] == [False] * 3
    assert sp.choice.decided == {}
    reqs[0].grammar = None  # one request that can draft: the choice decides again
    assert sp.plan(reqs) is True


def test_requests_under_a_grammar_or_at_their_last_token_get_no_drafts():
    from kvserve.engine.request import Request
    from kvserve.engine.spec.speculator import Speculator
    from kvserve.sampling_params import SamplingParams

    sp = Speculator(SpeculativeConfig("ngram", 4, prompt_lookup_min=1))
    reqs = [Request(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=m)) for i, m in enumerate((9, 9, 1))]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1  # decoding
    reqs[1].grammar = object()
    sp.propose(reqs)
    assert reqs[0].spec_token_ids == [3, 1]  # a new request's rate (0.5) is worth two drafts
    assert reqs[1].spec_token_ids == [] and reqs[2].spec_token_ids == []


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _run(choice, clock, steps, batch, cost, first_look_step=None):
    """``steps`` back-to-back pure decode steps; ``cost[drafted]``: seconds per token. With
    ``first_look_step``, the first step of each run of that side costs that many seconds per
    token instead (a draft model catching up on the tokens decoded without it)."""
    sides = []
    for _ in range(steps):
        drafted = choice.drafts(batch)
        per_token = cost[drafted]
        if first_look_step is not None and drafted and not (sides and sides[-1]):
            per_token = first_look_step
        launched = clock.t
        clock.t += per_token * batch
        choice.record(batch, drafted, batch, launched, pure=True)
        sides.append(drafted)
    return sides


def _looks(sides, side):
    """(first step, length) of each run of ``side`` in ``sides``."""
    runs, start = [], None
    for i, s in enumerate([*sides, None]):
        if s == side and start is None:
            start = i
        elif s != side and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def _gaps(runs, first):
    """Steps between the end of one look and the start of the next, the first from ``first``."""
    ends = [first] + [a + n for a, n in runs]
    return [a - e for (a, _), e in zip(runs, ends, strict=False)]


def test_draft_or_plain_takes_the_measured_cheaper_side_and_looks_again():
    from kvserve.engine.spec.policy import (
        MEASURED_FROM,
        PROBE_EVERY,
        PROBE_FIRST,
        PROBE_STEPS,
        WARMUP_STEPS,
        DraftOrPlain,
    )
    clock = _Clock()
    choice = DraftOrPlain(clock)
    choice.record(32, False, 32, 0.0, pure=False)  # the prefill before: an end, not a sample
    warm = 2 * WARMUP_STEPS
    # Drafted steps 2% dearer per token: a look costs little, so the gaps double.
    sides = _run(choice, clock, warm + 3 * PROBE_EVERY, 32, {True: 1.02e-3, False: 1e-3})
    # Drafted first, then plain, each until measured WARMUP_STEPS times.
    assert sides[:warm] == [True] * WARMUP_STEPS + [False] * WARMUP_STEPS
    # Then plain, drafting only while looked at again: PROBE_STEPS at a time, the first look
    # PROBE_FIRST steps after the choice, each gap twice the one before, up to PROBE_EVERY.
    looks = _looks(sides[warm:], True)
    assert all(n == PROBE_STEPS for _, n in looks)
    gaps = _gaps(looks, 0)
    assert gaps[:4] == [PROBE_FIRST, 2 * PROBE_FIRST, 4 * PROBE_FIRST, 8 * PROBE_FIRST]
    assert max(gaps) == PROBE_EVERY and gaps[-1] == PROBE_EVERY
    # A bucket of its own: batch 8, where plain steps cost twice as much. It warms up with the
    # choice of the bucket nearest it (plain), then drafts. A look at plain steps costs 4 steps
    # x 8 tokens x (2 - 1) = 32 tokens' worth of drafting: 1% of that many tokens is 400 steps.
    sides = _run(choice, clock, warm + 6 * 404, 8, {True: 1e-3, False: 2e-3})
    assert sides[:warm] == [False] * WARMUP_STEPS + [True] * WARMUP_STEPS
    looks = _looks(sides[warm:], False)
    assert all(n == PROBE_STEPS for _, n in looks)
    assert _gaps(looks, 0) == [PROBE_FIRST] + [400] * (len(looks) - 1) and len(looks) >= 5
    # When drafting turns dearer (the text stops repeating), its own times switch sides once
    # they are most of its window; the new choice is soon looked at again, then no more often
    # than its cost allows (4 x 8 x (4/2 - 1) tokens: 400 steps again).
    sides = _run(choice, clock, 2 * 404, 8, {True: 4e-3, False: 2e-3})
    switch = sides.index(False)
    assert sides[:4] == [True] * 4 and switch <= WARMUP_STEPS
    looks = _looks(sides[switch:], True)
    assert all(n == PROBE_STEPS for _, n in looks)
    assert _gaps(looks, 0)[:2] == [PROBE_FIRST, 400]
    # Below MEASURED_FROM decoding requests the rule alone decides, whatever the times say.
    assert _run(choice, clock, 50, MEASURED_FROM - 1, {True: 9e-3, False: 1e-3}) == [True] * 50


def test_draft_or_plain_spaces_its_looks_by_what_they_cost():
    """A draft model's first drafted step after plain ones catches up on the tokens decoded
    meanwhile: one step, so the median of drafting's steps does not see it, but the look pays
    it. The looks are spaced so that they cost about LOOK_SHARE of the time, with PROBE_MAX the
    longest gap."""
    from kvserve.engine.spec.policy import LOOK_SHARE, PROBE_MAX, PROBE_STEPS, WARMUP_STEPS, DraftOrPlain
    clock = _Clock()
    choice = DraftOrPlain(clock)
    choice.record(32, False, 32, 0.0, pure=False)
    cost = {True: 1.3e-3, False: 1e-3}
    steps = 2 * WARMUP_STEPS + 40_000
    sides = _run(choice, clock, steps, 32, cost, first_look_step=12e-3)
    looks = _looks(sides[2 * WARMUP_STEPS:], True)
    assert len(looks) >= 4 and all(n == PROBE_STEPS for _, n in looks)
    gaps = _gaps(looks, 0)
    # A look: one catch-up step (12 ms a token) and three at 1.3 ms, against 1 ms plain:
    # (12 + 3 * 1.3 - 4) * 32 tokens lost, and 1% of a gap's 32 tokens a step pays for them.
    lost = (12 + 3 * 1.3 - 4) * 32
    assert all(abs(g - lost / (LOOK_SHARE * 32)) <= 1 for g in gaps[1:])  # (1190: rounded up)
    # What the looks after the first cost, over the plain steps' time from the first look on.
    start = 2 * WARMUP_STEPS + looks[1][0]
    spent = sum(12e-3 + (PROBE_STEPS - 1) * 1.3e-3 - PROBE_STEPS * 1e-3 for _ in looks[1:]) * 32
    plain_time = sides[start:].count(False) * 32 * 1e-3
    assert spent <= 1.05 * LOOK_SHARE * plain_time
    # However dear a look, the choice is looked at again within PROBE_MAX steps.
    clock2 = _Clock()
    choice2 = DraftOrPlain(clock2)
    choice2.record(32, False, 32, 0.0, pure=False)
    sides = _run(choice2, clock2, 2 * WARMUP_STEPS + 3 * PROBE_MAX, 32, cost, first_look_step=1.0)
    gaps = _gaps(_looks(sides[2 * WARMUP_STEPS:], True), 0)
    assert gaps[1:] == [PROBE_MAX] * (len(gaps) - 1) and len(gaps) >= 3


def test_only_the_looks_own_steps_are_charged_to_them():
    """Steps of the side not chosen that no look scheduled (a seeded request's drafted steps,
    which the rule decides; a drafted step where no request found a draft, recorded as plain)
    leave the gaps as they are; so does recording each step after the next is scheduled
    (async scheduling)."""
    from kvserve.engine.spec.policy import WARMUP_STEPS, DraftOrPlain
    cost = {True: 1.05e-3, False: 1e-3}  # a look costs 6.4 tokens: under 1% of a doubled gap

    def gaps(stray_every=0, stray_side=True, ahead=False, steps=3000):
        clock = _Clock()
        choice = DraftOrPlain(clock)
        choice.record(32, False, 32, 0.0, pure=False)
        sides, pending = [], None
        for i in range(steps):
            if stray_every and i > 2 * WARMUP_STEPS and i % stray_every == 0:
                launched = clock.t  # not decided by drafts(): a stray step of stray_side
                clock.t += cost[stray_side] * 32
                choice.record(32, stray_side, 32, launched, pure=True)
                continue
            drafted = choice.drafts(32)
            if pending is not None:  # the step before ends after this one was scheduled
                choice.record(32, *pending)
            launched = clock.t
            clock.t += cost[drafted] * 32
            sides.append(drafted)
            if ahead:
                pending = (drafted, 32, launched, True)
            else:
                choice.record(32, drafted, 32, launched, pure=True)
        return _gaps(_looks(sides[2 * WARMUP_STEPS:], True), 0)

    plain = gaps()
    assert plain[:5] == [16, 32, 64, 128, 192]
    assert gaps(stray_every=7, stray_side=True)[:5] == plain[:5]  # seeded drafted steps
    ahead = gaps(ahead=True)  # each side's warm-up is measured a step later: the first look too
    assert ahead[0] - plain[0] in (0, 1, 2) and ahead[1:5] == plain[1:5]


def test_a_new_bucket_warms_up_with_its_nearest_bucket_choice_between_two():
    from kvserve.engine.spec.policy import WARMUP_STEPS, DraftOrPlain
    clock = _Clock()
    choice = DraftOrPlain(clock)
    choice.record(6, False, 6, 0.0, pure=False)
    _run(choice, clock, 2 * WARMUP_STEPS + 2, 6, {True: 2e-3, False: 1e-3})  # bucket 3: plain
    _run(choice, clock, 2 * WARMUP_STEPS + 2, 100, {True: 1e-3, False: 2e-3})  # bucket 7: drafted
    assert choice.looks[3][2] is False and choice.looks[7][2] is True
    assert _run(choice, clock, 1, 12, {True: 1e-3, False: 1e-3}) == [False]  # bucket 4: nearer 3
    assert _run(choice, clock, 1, 40, {True: 1e-3, False: 1e-3}) == [True]  # bucket 6: nearer 7
    assert _run(choice, clock, 1, 20, {True: 1e-3, False: 1e-3}) == [True]  # bucket 5: as near; the larger


def test_a_new_bucket_warms_up_with_its_nearest_bucket_choice():
    """While a batch drains, each smaller bucket is new; where the buckets around it decode
    plain, its warm-up starts plain too rather than with drafted steps."""
    from kvserve.engine.spec.policy import WARMUP_STEPS, DraftOrPlain
    clock = _Clock()
    choice = DraftOrPlain(clock)
    choice.record(32, False, 32, 0.0, pure=False)
    _run(choice, clock, 2 * WARMUP_STEPS + 4, 32, {True: 2e-3, False: 1e-3})
    assert choice.drafts(32) is False  # decided: plain
    for batch in (20, 12, 6):  # buckets 5, 4, 3, each met for the first time
        assert _run(choice, clock, WARMUP_STEPS, batch, {True: 2e-3, False: 1e-3}) == [False] * WARMUP_STEPS
    # A bucket nearer a drafting one starts drafted: batch 200 (bucket 8) after batch 100
    # (bucket 7) chose drafting.
    _run(choice, clock, 2 * WARMUP_STEPS + 4, 100, {True: 1e-3, False: 2e-3})
    assert choice.drafts(100) is True
    assert _run(choice, clock, 3, 200, {True: 1e-3, False: 2e-3}) == [True] * 3


def test_draft_or_plain_undoes_a_choice_made_on_a_bad_opening():
    """The warm-up steps are a request's first, where an n-gram lookup has the least text to
    match: drafting measured dearer there is looked at again within a few dozen steps, and once
    it is the cheaper side it is taken for good."""
    from kvserve.engine.spec.policy import PROBE_FIRST, PROBE_STEPS, WARMUP_STEPS, WINDOW, DraftOrPlain
    clock = _Clock()
    choice = DraftOrPlain(clock)
    choice.record(8, False, 8, 0.0, pure=False)
    sides = []
    for i in range(300):
        drafted = choice.drafts(8)
        launched = clock.t
        opening = i < WARMUP_STEPS  # drafted steps then cost 3x what they cost later
        clock.t += 8 * ((3e-3 if opening else 1e-3) if drafted else 2e-3)
        choice.record(8, drafted, 8, launched, pure=True)
        sides.append(drafted)
    warm = 2 * WARMUP_STEPS
    assert sides[WARMUP_STEPS:warm] == [False] * WARMUP_STEPS
    assert sides[warm] is False  # the opening made drafting look dearer
    back = warm + sides[warm:].index(True)
    assert back <= warm + PROBE_FIRST  # the first look at drafting
    settled = back + WINDOW  # by then drafting's window holds only its later steps
    assert settled < 60 and all(n == PROBE_STEPS for _, n in _looks(sides[settled:], False))
    assert sides[settled:].count(True) >= 0.9 * len(sides[settled:])


def test_draft_or_plain_ignores_steps_after_an_idle_gap_and_mixed_steps():
    from kvserve.engine.spec.policy import DraftOrPlain
    clock = _Clock()
    choice = DraftOrPlain(clock)
    clock.t = 1.0
    choice.record(4, True, 4, 0.99, pure=True)  # the first step: nothing before it to time from
    clock.t = 5.0
    choice.record(4, True, 8, 4.9, pure=True)  # launched 3.9 s after the last end: idle gap
    clock.t = 5.1
    choice.record(4, True, 8, 5.0, pure=False)  # a prefill chunk in the step
    assert choice.measured == {}
    clock.t = 5.2
    choice.record(4, True, 8, 5.1, pure=True)
    assert choice.measured == {(3, True): 1} and choice.cost((3, True)) == pytest.approx(0.1 / 8)


def test_draft_or_plain_is_not_decided_by_a_stall():
    """One drafted step stalls (a collection, a first use): the median still sees drafting as
    the cheaper side."""
    from kvserve.engine.spec.policy import WARMUP_STEPS, DraftOrPlain
    clock = _Clock()
    choice = DraftOrPlain(clock)
    choice.record(4, False, 4, 0.0, pure=False)
    for i in range(2 * WARMUP_STEPS):
        drafted = choice.drafts(4)
        launched = clock.t
        clock.t += (0.2 if i == 0 else 1e-3) if drafted else 2e-3
        choice.record(4, drafted, 4, launched, pure=True)
    assert choice.drafts(4) is True


def test_seeded_sampling_keeps_the_rule(monkeypatch):
    """A seeded request sampling at temperature > 0 draws differently in a verify step than in a
    plain one: while one decodes, the steps draft as the rule says whatever the times, so its
    seed reproduces its output."""
    from kvserve.engine.request import Request
    from kvserve.engine.spec.speculator import Speculator
    from kvserve.sampling_params import SamplingParams

    def decoding(**kw):
        r = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=9, **kw))
        r.num_computed_tokens = r.num_tokens - 1
        return r
    sp = Speculator(SpeculativeConfig("ngram", 4, prompt_lookup_min=1))
    monkeypatch.setattr(sp.choice, "drafts", lambda n: False)  # as if plain steps measured cheaper
    for kw, drafts in (({"temperature": 0.8, "seed": 3}, True), ({"temperature": 0.8}, False),
                       ({"temperature": 0.0, "seed": 3}, False)):
        r = decoding(**kw)
        assert sp.plan([r]) is drafts
        sp.propose([r])
        assert bool(r.spec_token_ids) is drafts, kw
