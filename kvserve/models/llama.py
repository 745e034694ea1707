"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5, Qwen3) over packed tokens.

The model knows nothing of requests: ``forward(input_ids [T], positions [T])`` reads the
step's paged-attention context set by the runner. Weights load from Hugging Face names; the
q/k/v and gate/up projections are merged into one matrix each at load time.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.layers.attention import get_forward_context
from kvserve.layers.linear import Linear, gate_up_silu, linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.arch import ModelArch


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rope = rope
        self.scale = self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        o = ctx.backend.forward(positions, q, k, v, self.rope, k_cache, v_cache,
                                ctx.attn_of(self.layer_idx), self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_silu(x, self.gate_up_proj))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(arch, layer_idx, rope)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, x, residual):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.rope = rope
        self.layers = nn.ModuleList(DecoderLayer(arch, i, rope) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, w, kind="logits").float()

    # -- weights ---------------------------------------------------------------------------
    # HF name suffix -> (our parameter suffix, shard index in the merged matrix)
    _MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        a = self.arch
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        offsets = {"qkv_proj": [0, q, q + kv, q + 2 * kv],
                   "gate_up_proj": [0, a.intermediate_size, 2 * a.intermediate_size]}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves
            target, shard = name, None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._MERGED:
                merged, shard = self._MERGED[parts[-2]]
                target = ".".join(parts[:-2] + [merged, parts[-1]])
            if target not in params:
                raise ModelLoadError(f"unexpected weight {name!r} for {a.family} model")
            p = params[target]
            if shard is None:
                dst = p.data
            else:
                o = offsets[target.split(".")[-2]]
                dst = p.data[o[shard]:o[shard + 1]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = set()
        for pname in params:
            mod = pname.split(".")[-2] if "." in pname else ""
            n_shards = {"qkv_proj": 3, "gate_up_proj": 2}.get(mod)
            expected |= {f"{pname}#{s}" for s in range(n_shards)} if n_shards else {f"{pname}#None"}
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(f"missing weights for {len(missing)} parameters, e.g. {missing[:3]}")
