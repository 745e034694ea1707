"""Building a model skips torch's default weight initialisation (every weight is loaded or drawn
by ``init_dummy_weights`` after), leaves torch's own initialisation intact for everyone else,
and a model whose weights are not all loaded is refused rather than run on uninitialised memory."""
from __future__ import annotations

import pytest
import torch

from kvserve.errors import ModelLoadError
from kvserve.layers.linear import Linear
from kvserve.layers.weight_init import initialising, loaded_later
from kvserve.models import loader
from kvserve.models.arch import ModelArch
from kvserve.models.presets import DUMMY_PRESETS


def _arch() -> ModelArch:
    return ModelArch.from_hf_config(DUMMY_PRESETS["tiny"])


def test_build_model_draws_no_random_numbers():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model = loader.build_model(_arch(), max_positions=64)
    # torch's default init of each Linear / Embedding would advance the global generator.
    assert torch.equal(torch.get_rng_state(), before)
    assert any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for m in model.modules())


def test_torch_default_init_untouched_by_a_build():
    torch.manual_seed(7)
    ref = torch.nn.Linear(16, 8)
    loader.build_model(_arch(), max_positions=64)
    torch.manual_seed(7)
    again = torch.nn.Linear(16, 8)
    assert torch.equal(ref.weight, again.weight) and torch.equal(ref.bias, again.bias)
    assert ref.weight.abs().sum() > 0  # torch's kaiming-uniform draw, not zeros


def test_initialisation_back_after_a_failed_build():
    with pytest.raises(RuntimeError), loaded_later():
        assert not initialising()
        raise RuntimeError("boom")
    assert initialising()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    Linear(16, 8)  # kvserve's own layer initialises again outside a build
    assert not torch.equal(torch.get_rng_state(), before)


def test_dummy_weights_fill_every_parameter():
    model = loader.build_model(_arch(), max_positions=64)
    loader.init_dummy_weights(model, seed=0)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    gen = torch.Generator().manual_seed(0)
    name, p = next((n, p) for n, p in model.named_parameters() if n == "embed_tokens.weight")
    # init_dummy_weights' first draw: normal(0, 0.02) from the seeded generator, in parameter order
    assert torch.equal(p, torch.empty_like(p).normal_(0.0, 0.02, generator=gen)), name


def test_missing_weight_refused():
    model = loader.build_model(_arch(), max_positions=64)
    ref = loader.build_model(_arch(), max_positions=64)
    loader.init_dummy_weights(ref, seed=0)
    hf = []
    for name, p in ref.named_parameters():
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            continue  # merged on load from q/k/v and gate/up: left out, so they are missing
        hf.append(("model." + name, p.detach()))
    with pytest.raises(ModelLoadError, match="missing weights"):
        model.load_weights(hf)



def test_missing_weights_are_named_as_checkpoints_name_them():
    """A missing part of a merged projection is named as the checkpoint names it (k_proj, not
    qkv_proj's shard 1), a plain weight by its own name."""
    a = _arch()
    model = loader.build_model(a, max_positions=64)
    ref = loader.build_model(a, max_positions=64)
    loader.init_dummy_weights(ref, seed=0)
    rows = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
    hf = []
    for name, p in ref.named_parameters():
        if ".qkv_proj." in name:
            for part, t in zip(("q", "k", "v"), p.detach().split(rows, 0)):
                if not (part == "k" and name.startswith("layers.0.")):  # layer 0's k_proj left out
                    hf.append(("model." + name.replace("qkv_proj", f"{part}_proj"), t))
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate", "up"), p.detach().chunk(2, 0)):
                hf.append(("model." + name.replace("gate_up_proj", f"{part}_proj"), t))
        elif name != "norm.weight":  # left out
            hf.append(("model." + name, p.detach()))
    with pytest.raises(ModelLoadError) as e:
        model.load_weights(hf)
    assert "missing weights for 2 parameters" in str(e.value)
    assert "'layers.0.self_attn.k_proj.weight'" in str(e.value) and "'norm.weight'" in str(e.value)
    assert "#" not in str(e.value)
