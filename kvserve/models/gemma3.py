"""Gemma 3 decoder (text) over packed tokens: local (sliding-window) and global attention layers.

How it differs from ``llama.py``:

    layer i      window ``arch.layer_windows[i]`` (None: global); RoPE base 10k local, 1M global
    attention    q/k per-head RMSNorm before RoPE; q scaled by query_pre_attn_scalar ** -0.5
    each block   x + post_norm(attn(pre_norm(x))), then the same around the MLP (four norms)
    MLP          GeGLU: gelu_tanh(x W_g) * (x W_u)
    embedding    scaled by sqrt(hidden); tied to the output
    logits       tanh-softcapped where the config sets final_logit_softcapping; its
                 attn_logit_softcapping is read by transformers' Gemma 3 but never applied
                 (released checkpoints set it null), and kvserve follows that reference

Gemma's RMSNorm multiplies by ``1 + weight``: the 1 is added once at load (the stored parameter
is ``1 + w``), so the shared ``RMSNorm`` and its fused CUDA kernel serve unchanged. The residual
add after each post-norm is fused into the next pre-norm, as in the Llama blocks.

KV memory and the window. Each layer reads its KV through its KV group's block table
(``engine/kv_groups.py``; ``ForwardContext.attn_of``): with ``window_kv="free"`` (the default)
the local layers' blocks wholly before every future query's window go back to the pool as
decoding advances, so a long context holds about (1/6 + 5/6 * window / context) of the KV of the
same model with every layer global; ``"keep"`` gives every layer one shared table. Either way a
local layer reads only the key tiles of its last ``window`` keys (both backends skip the rest).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.layers.attention import attend
from kvserve.layers.linear import Linear, head_logits
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.layers.weight_init import Embedding
from kvserve.models.arch import ModelArch
from kvserve.models.llama import LlamaForCausalLM


class Gemma3Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.rope = rope
        self.window = arch.layer_windows[layer_idx]
        self.scale = arch.query_pre_attn_scalar ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(attend(self, positions, q, k, v, self.window).reshape(-1, self.q_size))


class GeGLU(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Gemma3Attention(arch, layer_idx, rope)
        self.mlp = GeGLU(arch)
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)

    def forward(self, positions, x, residual):
        """``x`` is the previous block's post-normed branch, not yet added to ``residual``."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int):
        super().__init__()
        if not arch.layer_windows:
            raise ModelLoadError("a Gemma 3 model needs its layer types")
        self.arch = arch
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        # As transformers does: sqrt(hidden) in float32, rounded to the embedding's dtype.
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size ** 0.5), persistent=False)
        local = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_local_theta)
        full = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.ropes = nn.ModuleList([local, full])
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, i, full if w is None else local)
                                    for i, w in enumerate(arch.layer_windows))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale.to(self.embed_tokens.weight.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = head_logits(hidden, self.embed_tokens, self.lm_head).float()
        cap = self.arch.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names and values; every norm weight ``w`` is stored as ``1 + w``."""
        def shifted():
            for name, tensor in weights:
                name = name.removeprefix("language_model.")
                if name.endswith("norm.weight"):
                    tensor = 1.0 + tensor.float()
                yield name, tensor
        LlamaForCausalLM.load_weights(self, shifted())

    _MERGED = LlamaForCausalLM._MERGED
