"""A request's sampling row: kept from step to step once nothing is banned, and never shared with
what differs (a draw with drafts, another draw, a fork with its own tokens and generator)."""
from __future__ import annotations

import torch

from kvserve.engine.request import Request
from kvserve.engine.sampling_rows import sampling_row
from kvserve.sampling_params import SamplingParams


def _request(**kw) -> Request:
    params = SamplingParams(max_tokens=16, **kw)
    return Request("r", [5, 6, 7], params, eos_token_ids=(9,))


def test_stop_tokens_banned_until_min_tokens_then_the_row_is_kept():
    r = _request(min_tokens=2, stop_token_ids=[7], repetition_penalty=1.3)
    assert sampling_row(r, 0).banned_tokens == (7, 9)
    r.append_token(1)
    assert sampling_row(r, 0).banned_tokens == (7, 9)
    r.append_token(2)
    row = sampling_row(r, 0)
    assert row.banned_tokens == ()
    r.append_token(3)
    again = sampling_row(r, 0)
    assert again is row
    # It reads the request's lists as they grow: the penalties see every token.
    assert again.seen_tokens == [5, 6, 7, 1, 2, 3] and again.output_tokens == [1, 2, 3]


def test_drafts_and_other_draws_get_their_own_rows():
    r = _request(frequency_penalty=0.5, seed=11, n=2)
    own = sampling_row(r, 0)
    drafted = sampling_row(r, 0, [8, 4])
    assert drafted is not own and drafted.seen_tokens == [5, 6, 7, 8, 4] and drafted.output_tokens == [8, 4]
    assert own.seen_tokens == [5, 6, 7] and own.output_tokens == []
    second = sampling_row(r, 1)
    assert second.generator is r.generators[1] and own.generator is r.generators[0]
    assert sampling_row(r, 0) is own


def test_a_fork_samples_with_its_own_tokens_and_generator():
    r = _request(presence_penalty=0.4, seed=3, n=2)
    parent_row = sampling_row(r, 0)
    r.append_token(4)
    child = r.fork(1)
    child.append_token(8)
    child_row = sampling_row(child, 0)
    assert child_row is not parent_row
    assert child_row.generator is child.generators[0] is r.generators[1]
    assert child_row.output_tokens == [4, 8] and parent_row.output_tokens == [4]
    # The parent keeps its row after the fork: its first generator and lists are the same.
    r.generators = r.generators[:1]
    assert sampling_row(r, 0) is parent_row and parent_row.generator is r.generators[0]
    a, b = (torch.empty(4).exponential_(generator=row.generator) for row in (parent_row, child_row))
    assert not torch.equal(a, b)


def test_a_replaced_generator_is_read_again():
    r = _request(seed=2)
    first = sampling_row(r, 0)
    r.generators = [torch.Generator().manual_seed(4)]
    row = sampling_row(r, 0)
    assert row is not first and row.generator is r.generators[0]
