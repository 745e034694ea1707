"""``RotaryEmbedding`` rotates exactly as transformers' Llama does (its ``apply_rotary_pos_emb``
given the same cos/sin tables), bit for bit in float32 and bfloat16, at random positions; the
tables it gathers for a step's positions tensor are reused for that tensor only."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvserve.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_rotation_equals_transformers_bit_for_bit(dtype, D):
    g = torch.Generator().manual_seed(D)
    rope = RotaryEmbedding(D, 4096, 10000.0)
    pos = torch.randint(0, 4096, (13,), generator=g)
    q = (torch.randn(13, 9, D, generator=g) * 3).to(dtype)
    k = (torch.randn(13, 3, D, generator=g) * 3).to(dtype)
    cos, sin = rope.cos[pos].to(dtype), rope.sin[pos].to(dtype)
    rq, rk = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    got_q, got_k = rope(pos, q, k)
    assert torch.equal(got_q, rq) and torch.equal(got_k, rk)
    assert not torch.equal(got_q, q)


def test_tables_follow_the_positions_tensor():
    rope = RotaryEmbedding(16, 64, 10000.0)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    a = torch.tensor([3, 40])
    first = rope(a, q, k)
    again = rope(a, q, k)  # the step's next layer: the same tensor, the same tables
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    b = torch.tensor([5, 41])  # the next step's positions
    moved = rope(b, q, k)
    fresh = RotaryEmbedding(16, 64, 10000.0)(b, q, k)
    assert all(torch.equal(x, y) for x, y in zip(moved, fresh))
    assert not torch.equal(moved[0], first[0])
    half = rope(a, q.bfloat16(), k.bfloat16())  # another dtype: its own tables
    assert half[0].dtype == torch.bfloat16
    assert torch.equal(half[0], RotaryEmbedding(16, 64, 10000.0)(a, q.bfloat16(), k.bfloat16())[0])
