"""Sampler tests: masks and penalties against a direct per-row computation, greedy, seeding,
the sampled distribution, log-probs and banned tokens. Pure torch on the CPU, fast."""
from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.engine.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p_min_p

NEG = torch.finfo(torch.float32).min


def row(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, generator=None, num_logprobs=None, **kw):
    return SamplingRow(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       generator=generator, num_logprobs=num_logprobs, **kw)


# -- reference implementations (plain python, float64) -----------------------------------------

def _softmax(vals: dict[int, float]) -> dict[int, float]:
    m = max(vals.values())
    e = {i: math.exp(v - m) for i, v in vals.items()}
    s = sum(e.values())
    return {i: x / s for i, x in e.items()}


def ref_keep(logits: list[float], k: int, p: float, min_p: float) -> tuple[set[int], float]:
    """Token ids kept by top-k, then top-p, then min-p (each on the renormalised survivors of
    the previous one). Also returns the smallest distance of a top-p / min-p decision from its
    threshold, so the test can refuse ambiguous (float-rounding) cases."""
    kept = dict(enumerate(float(x) for x in logits))
    margin = math.inf
    if k > 0:
        order = sorted(kept, key=lambda i: kept[i], reverse=True)
        kept = {i: kept[i] for i in order[:k]}
    if p < 1.0:
        probs = _softmax(kept)
        order = sorted(probs, key=lambda i: probs[i], reverse=True)
        cum, keep = 0.0, []
        for i in order:
            keep.append(i)
            cum += probs[i]
            margin = min(margin, abs(cum - p))
            if cum >= p:
                break
        kept = {i: kept[i] for i in keep}
    if min_p > 0.0:
        probs = _softmax(kept)
        thresh = min_p * max(probs.values())
        top = max(probs.values())
        for v in probs.values():
            if v != top:  # the max always stays (exact even at min_p == 1)
                margin = min(margin, abs(v - thresh) / max(thresh, 1e-30))
        kept = {i: v for i, v in kept.items() if probs[i] >= thresh}
    return set(kept), margin


def ref_penalties(logits: list[float], r: SamplingRow) -> list[float]:
    out = [float(x) for x in logits]
    vocab = len(out)
    if r.repetition_penalty != 1.0 and r.seen_tokens:
        for t in set(r.seen_tokens):
            if t >= vocab:
                continue
            out[t] = out[t] / r.repetition_penalty if out[t] > 0 else out[t] * r.repetition_penalty
    if (r.presence_penalty or r.frequency_penalty) and r.output_tokens:
        counts: dict[int, int] = {}
        for t in r.output_tokens:
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            if t < vocab:
                out[t] -= r.frequency_penalty * c + r.presence_penalty
    return out


def nonzero_logits(gen: torch.Generator, n: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    x = torch.randn(n, vocab, generator=gen) * scale
    x[x.abs() < 1e-3] = 0.5  # random, distinct and never exactly 0 (for the repetition sign rule)
    return x


# -- top-k / top-p / min-p ---------------------------------------------------------------------

ROW_PARAMS = [  # (top_k, top_p, min_p)
    (-1, 1.0, 0.0),   # all off
    (0, 1.0, 0.0),    # 0 is off too
    (1, 1.0, 0.0),
    (5, 1.0, 0.0),
    (17, 1.0, 0.0),
    (10_000, 1.0, 0.0),  # larger than the vocabulary
    (-1, 0.5, 0.0),
    (-1, 0.9, 0.0),
    (-1, 0.05, 0.0),  # smaller than the largest prob: only the first token stays
    (-1, 1.0, 0.1),
    (-1, 1.0, 0.5),
    (-1, 1.0, 1.0),  # only the max
    (8, 0.7, 0.0),
    (20, 0.8, 0.2),
    (-1, 0.6, 0.05),
    (3, 1.0, 0.3),
]


@pytest.mark.parametrize("vocab", [7, 64, 301])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_top_p_min_p_matches_reference(vocab, seed):
    gen = torch.Generator().manual_seed(1000 * vocab + seed)
    rng = random.Random(seed)
    params = list(ROW_PARAMS)
    for _ in range(8):  # plus random ones
        params.append((rng.choice([-1, 0, rng.randint(1, vocab + 3)]), rng.choice([1.0, rng.uniform(0.05, 0.99)]),
                       rng.choice([0.0, rng.uniform(0.0, 0.9)])))
    rng.shuffle(params)
    logits = nonzero_logits(gen, len(params), vocab)
    original = logits.clone()
    out = apply_top_k_top_p_min_p(logits, torch.tensor([p[0] for p in params]),
                                  torch.tensor([p[1] for p in params]), torch.tensor([p[2] for p in params]))
    assert torch.equal(logits, original), "the input logits must not be modified"
    assert out.shape == logits.shape
    checked = 0
    for i, (k, p, mp) in enumerate(params):
        keep, margin = ref_keep(logits[i].tolist(), k, p, mp)
        if margin < 1e-5:
            continue  # a float32 rounding decision: either answer is right
        checked += 1
        got_keep = {j for j in range(vocab) if out[i, j] > NEG}
        assert got_keep == keep, f"row {i} (top_k={k}, top_p={p}, min_p={mp})"
        # Kept tokens keep their logit; the others are the dtype's minimum.
        for j in range(vocab):
            assert out[i, j].item() == (logits[i, j].item() if j in keep else NEG), (i, j)
    assert checked >= len(params) - 2


def test_top_k_top_p_min_p_off_is_identity():
    gen = torch.Generator().manual_seed(3)
    logits = nonzero_logits(gen, 4, 50)
    n = logits.shape[0]
    out = apply_top_k_top_p_min_p(logits, torch.tensor([-1, 0, -1, 0]), torch.ones(n), torch.zeros(n))
    assert torch.equal(out, logits)


@pytest.mark.parametrize("vocab", [40, 49152])
def test_top_k_top_p_min_p_one_row_does_not_affect_another(vocab):
    gen = torch.Generator().manual_seed(4)
    logits = nonzero_logits(gen, 5, vocab)
    ks, ps, mps = torch.tensor([3, -1, 10, -1, 1]), torch.tensor([1.0, 0.5, 0.9, 1.0, 1.0]), \
        torch.tensor([0.0, 0.0, 0.1, 0.3, 0.0])
    batch = apply_top_k_top_p_min_p(logits, ks, ps, mps)
    for i in range(5):
        single = apply_top_k_top_p_min_p(logits[i:i + 1], ks[i:i + 1], ps[i:i + 1], mps[i:i + 1])
        assert torch.equal(batch[i:i + 1], single), i


@pytest.mark.parametrize("vocab", [301, 49152])
def test_top_p_one_leaves_a_row_alone_next_to_a_top_p_row(vocab):
    """top_p == 1 is "off" (docstring: it leaves a row alone), also when another row of the
    batch uses top-p. The float32 cumsum of a row's sorted probs overshoots 1.0 by rounding, so
    ``cumsum - probs >= 1.0`` drops that row's tail tokens."""
    gen = torch.Generator().manual_seed(1 if vocab == 301 else 0)
    logits = nonzero_logits(gen, 2, vocab)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([-1, -1]), torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.0]))
    dropped = (out[0] == NEG).nonzero().flatten().tolist()
    assert dropped == [], f"{len(dropped)} of {vocab} tokens masked in a top_p=1.0 row"
    alone = apply_top_k_top_p_min_p(logits[:1], torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.equal(out[:1], alone)


# -- penalties ---------------------------------------------------------------------------------

def test_penalties_match_reference():
    vocab = 40
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    rows = [
        row(),  # no penalties
        row(repetition_penalty=1.3, seen_tokens=[1, 2, 2, 3, 39, 5, 5, 5]),
        row(repetition_penalty=0.7, seen_tokens=[0, 10, 20, 30]),  # < 1: seen tokens favoured
        row(presence_penalty=0.5, output_tokens=[4, 4, 4, 6]),
        row(frequency_penalty=0.25, output_tokens=[4, 4, 4, 6, 7, 7]),
        row(presence_penalty=-1.0, frequency_penalty=1.5, output_tokens=[1, 1, 9]),
        row(repetition_penalty=2.0, presence_penalty=0.3, frequency_penalty=0.2,
            seen_tokens=[rng.randrange(vocab) for _ in range(30)],
            output_tokens=[rng.randrange(vocab) for _ in range(12)]),
        row(repetition_penalty=1.5, seen_tokens=[3, 7, 1000]),  # an id beyond the vocabulary is ignored
        row(repetition_penalty=1.5, seen_tokens=[]),
        row(frequency_penalty=1.0, output_tokens=None),
    ]
    logits = nonzero_logits(gen, len(rows), vocab)
    # Make sure both signs are exercised on seen tokens.
    logits[1, 1], logits[1, 2], logits[2, 10], logits[2, 20] = 2.0, -2.0, 1.5, -1.5
    expected = [ref_penalties(logits[i].tolist(), r) for i, r in enumerate(rows)]
    got = logits.clone()
    apply_penalties(got, rows)
    for i in range(len(rows)):
        assert got[i].tolist() == pytest.approx(expected[i], rel=1e-6, abs=1e-6), i
    assert torch.equal(got[0], logits[0])
    assert got[1, 1].item() == pytest.approx(2.0 / 1.3) and got[1, 2].item() == pytest.approx(-2.0 * 1.3)
    assert got[2, 10].item() == pytest.approx(1.5 / 0.7) and got[2, 20].item() == pytest.approx(-1.5 * 0.7)
    assert got[4, 4].item() == pytest.approx(logits[4, 4].item() - 0.75)


def test_sampler_applies_penalties_before_greedy():
    vocab = 10
    logits = torch.zeros(1, vocab)
    logits[0, 3], logits[0, 5] = 5.0, 4.0
    # Token 3 was emitted 3 times: 5 - 3*0.5 - 0.1 = 3.4 < 4 -> the argmax moves to 5.
    r = row(temperature=0.0, presence_penalty=0.1, frequency_penalty=0.5, output_tokens=[3, 3, 3])
    assert Sampler(torch.device("cpu"))(logits.clone(), [r]).token_ids == [5]
    r = row(temperature=0.0, repetition_penalty=1.5, seen_tokens=[3])  # 5 / 1.5 < 4
    assert Sampler(torch.device("cpu"))(logits.clone(), [r]).token_ids == [5]


# -- the sampler -------------------------------------------------------------------------------

def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(6)
    logits = nonzero_logits(gen, 16, 100)
    rows = [row(temperature=0.0, top_k=(i % 3) * 2 - 1, top_p=0.5 if i % 2 else 1.0) for i in range(16)]
    out = Sampler(torch.device("cpu"))(logits.clone(), rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_mixed_with_sampled_rows_stay_argmax():
    gen = torch.Generator().manual_seed(7)
    logits = nonzero_logits(gen, 12, 50)
    rows = [row(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(12)]
    for seed in range(5):
        out = Sampler(torch.device("cpu"), seed=seed)(logits.clone(), rows)
        for i in range(0, 12, 2):
            assert out.token_ids[i] == int(logits[i].argmax())


def test_top_k_one_equals_greedy():
    gen = torch.Generator().manual_seed(8)
    logits = nonzero_logits(gen, 8, 60)
    out = Sampler(torch.device("cpu"))(logits.clone(), [row(temperature=2.0, top_k=1)] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_sampled_tokens_respect_top_k_top_p_min_p():
    vocab = 30
    gen = torch.Generator().manual_seed(9)
    base = nonzero_logits(gen, 1, vocab, scale=1.0)[0]
    settings = [(4, 1.0, 0.0), (-1, 0.6, 0.0), (-1, 1.0, 0.4), (6, 0.8, 0.1)]
    sampler = Sampler(torch.device("cpu"), seed=1)
    for k, p, mp in settings:
        keep, margin = ref_keep(base.tolist(), k, p, mp)
        assert margin > 1e-5
        n = 2000
        out = sampler(base.repeat(n, 1), [row(temperature=1.0, top_k=k, top_p=p, min_p=mp)] * n)
        seen = set(out.token_ids)
        assert seen <= keep, (k, p, mp, seen - keep)
        assert seen == keep or len(keep) > 10  # with 2000 draws every kept token shows up


def test_seeded_row_is_independent_of_the_batch():
    vocab, steps = 64, 25
    gen = torch.Generator().manual_seed(10)
    my_logits = [nonzero_logits(gen, 1, vocab, scale=1.0)[0] for _ in range(steps)]
    settings = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01)

    def run(sampler_seed: int, batch_for_step) -> list[int]:
        sampler = Sampler(torch.device("cpu"), seed=sampler_seed)
        mine = row(generator=torch.Generator().manual_seed(1234), **settings)
        toks = []
        for t in range(steps):
            others, pos = batch_for_step(t)
            rows = [o for o, _ in others]
            logits = [lg for _, lg in others]
            rows.insert(pos, mine)
            logits.insert(pos, my_logits[t])
            out = sampler(torch.stack(logits), rows)
            toks.append(out.token_ids[pos])
        return toks

    alone = run(0, lambda t: ([], 0))
    assert len(set(alone)) > 3  # really sampled, not degenerate

    other_gen = torch.Generator().manual_seed(11)
    rng = random.Random(11)

    def crowded(t):
        n = rng.randint(1, 9)
        others = []
        for _ in range(n):
            kind = rng.random()
            if kind < 0.3:
                r = row(temperature=0.0)
            elif kind < 0.6:
                r = row(temperature=rng.uniform(0.3, 2.0), top_k=rng.choice([-1, 5]))
            else:  # other seeded rows with their own generators
                r = row(temperature=1.0, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
            others.append((r, nonzero_logits(other_gen, 1, vocab)[0]))
        return others, rng.randint(0, n)

    assert run(99, crowded) == alone
    assert run(5, crowded) == alone

    # And the same generator seed gives the same tokens in a fresh sampler.
    assert run(0, lambda t: ([], 0)) == alone


def test_unseeded_rows_are_reproducible_for_a_sampler_seed():
    gen = torch.Generator().manual_seed(12)
    logits = nonzero_logits(gen, 6, 40, scale=1.0)
    rows = [row(temperature=1.0)] * 6
    a = Sampler(torch.device("cpu"), seed=3)(logits.clone(), rows).token_ids
    b = Sampler(torch.device("cpu"), seed=3)(logits.clone(), rows).token_ids
    assert a == b


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_matches_softmax_distribution(temperature):
    vocab, n = 8, 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25])
    probs = (logits.double() / temperature).softmax(-1).tolist()
    out = Sampler(torch.device("cpu"), seed=1234)(logits.repeat(n, 1), [row(temperature=temperature)] * n)
    counts = [0] * vocab
    for t in out.token_ids:
        counts[t] += 1
    # 7 degrees of freedom: P(chi2 > 40) ~ 1e-6. Fixed seed, so deterministic anyway.
    assert _chi_square(counts, probs) < 40, (counts, [round(p * n) for p in probs])


def test_seeded_row_sampling_matches_softmax_distribution():
    vocab, n = 6, 6000
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5, 2.0, -0.5]])
    probs = logits.double().softmax(-1)[0].tolist()
    sampler = Sampler(torch.device("cpu"))
    r = row(temperature=1.0, generator=torch.Generator().manual_seed(77))
    counts = [0] * vocab
    for _ in range(n):
        counts[sampler(logits.clone(), [r]).token_ids[0]] += 1
    assert _chi_square(counts, probs) < 35, counts


def test_logprobs_are_log_softmax_of_raw_logits_with_rank():
    vocab = 50
    gen = torch.Generator().manual_seed(13)
    logits = nonzero_logits(gen, 6, vocab, scale=1.0)
    rows = [
        row(temperature=0.0, num_logprobs=5),
        row(temperature=1.0, num_logprobs=0),
        row(temperature=3.0, num_logprobs=3),  # hot: the sampled token is often not rank 1
        row(temperature=1.0, num_logprobs=None),
        row(temperature=0.0, num_logprobs=2, repetition_penalty=3.0, seen_tokens=list(range(25))),
        row(temperature=2.0, num_logprobs=20, frequency_penalty=2.0, output_tokens=[1, 2, 3]),
    ]
    ref = logits.double().log_softmax(-1)
    ranks_seen = set()
    for seed in range(10):
        out = Sampler(torch.device("cpu"), seed=seed)(logits.clone(), rows)
        assert out.logprobs[3] is None
        for i, r in enumerate(rows):
            if r.num_logprobs is None:
                continue
            tok = out.token_ids[i]
            lp, rank, top = out.logprobs[i]
            assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
            expected_rank = 1 + sum(1 for j in range(vocab) if ref[i, j] > ref[i, tok])
            assert rank == expected_rank, (i, tok)
            ranks_seen.add(rank)
            assert len(top) == r.num_logprobs
            exp_ids = sorted(range(vocab), key=lambda j: -ref[i, j].item())[:r.num_logprobs]
            assert [t for t, _ in top] == exp_ids
            for t, v in top:
                assert v == pytest.approx(ref[i, t].item(), abs=1e-5)
        # Greedy row 0: the argmax of the raw logits, rank 1.
        assert out.logprobs[0][1] == 1
    assert any(rk > 1 for rk in ranks_seen)


def test_banned_tokens_are_never_sampled():
    vocab, n = 12, 3000
    logits = torch.zeros(n, vocab)
    logits[:, 0] = 5.0  # the favourite, banned
    logits[:, 7] = 4.0  # banned too
    banned = (0, 7, 999)  # an id beyond the vocabulary is ignored
    sampler = Sampler(torch.device("cpu"), seed=0)
    out = sampler(logits.clone(), [row(temperature=1.5, banned_tokens=banned)] * n)
    assert not {0, 7} & set(out.token_ids)
    assert len(set(out.token_ids)) == vocab - 2
    # Greedy: the argmax among the allowed tokens.
    g = logits[:1].clone()
    g[0, 3] = 1.0
    assert sampler(g, [row(temperature=0.0, banned_tokens=banned)]).token_ids == [3]
    # Seeded rows, mixed batches.
    rows = [row(temperature=1.0, generator=torch.Generator().manual_seed(s), banned_tokens=(0,)) for s in range(50)]
    rows += [row(temperature=0.0, banned_tokens=(0, 7))] * 5
    out = sampler(logits[:55].clone(), rows)
    assert 0 not in out.token_ids
    assert all(t not in (0, 7) for t in out.token_ids[50:])
