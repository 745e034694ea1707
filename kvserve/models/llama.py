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
from kvserve.layers.attention import attend
from kvserve.layers.linear import Linear, gate_up_silu, head_logits
from kvserve.layers.norm import RMSNorm
from kvserve.layers.parallel import Shard, TPGroup, column_linear, embedding, row_linear, take
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.arch import ModelArch


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding, tp: TPGroup | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        d = arch.head_dim
        q, kv = _heads(arch.num_heads, d, tp), _heads(arch.num_kv_heads, d, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = q.local // d, kv.local // d, d
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = column_linear(arch.hidden_size, [q, kv, kv], arch.attention_bias, tp)
        self.o_proj = row_linear(q, arch.hidden_size, tp)
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
        return self.o_proj(attend(self, positions, q, k, v).reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPGroup | None = None):
        super().__init__()
        i = arch.intermediate_size
        cols = Shard(i, i, 0) if tp is None else tp.cols(i)
        self.gate_up_proj = column_linear(arch.hidden_size, [cols, cols], False, tp)
        self.down_proj = row_linear(cols, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_silu(x, self.gate_up_proj))


def _heads(n: int, head_dim: int, tp: TPGroup | None) -> Shard:
    return Shard(n * head_dim, n * head_dim, 0) if tp is None else tp.heads(n, head_dim)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = Attention(arch, layer_idx, rope, tp)
        self.mlp = MLP(arch, tp)
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
    """``tp``: this rank's group when the layers are split across ranks (``layers/parallel.py``)."""

    def __init__(self, arch: ModelArch, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        self.arch, self.tp = arch, tp
        self.embed_tokens = embedding(arch.vocab_size, arch.hidden_size, tp)
        rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.rope = rope
        self.layers = nn.ModuleList(DecoderLayer(arch, i, rope, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None
        if not arch.tie_word_embeddings:
            self.lm_head = (Linear(arch.hidden_size, arch.vocab_size, bias=False) if tp is None
                            else column_linear(arch.hidden_size, [tp.cols(arch.vocab_size, pad=True)], False, tp))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in float32; split across ranks: rank 0's (gathered), None elsewhere."""
        logits = head_logits(hidden, self.embed_tokens, self.lm_head)
        if self.tp is not None:
            logits = self.tp.gather_last_dim(logits)
            return None if logits is None else logits[:, :self.arch.vocab_size].float()
        return logits.float()

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
                from kvserve.models.awq_gptq import TENSORS
                if name.endswith(TENSORS):  # a packed checkpoint whose config does not say how
                    raise ModelLoadError(f"weight {name!r} is a packed quantized tensor, but the checkpoint's "
                                         f"config.json has no usable quantization_config (quant_method awq, gptq "
                                         f"or compressed-tensors)")
                raise ModelLoadError(f"unexpected weight {name!r} for {a.family} model")
            p = params[target]
            split = getattr(p, "tp_shards", None)  # this rank's slice of a split weight
            if split is not None:
                cut = split[shard or 0]
                dst = p.data.narrow(p.tp_dim, sum(c.local for c in split[:shard or 0]), cut.local)
                want = tuple(cut.full if d == p.tp_dim else n for d, n in enumerate(dst.shape))
            elif shard is None:
                dst = p.data
            else:
                o = offsets[target.split(".")[-2]]
                dst = p.data[o[shard]:o[shard + 1]]
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())
            if shape != (want if split is not None else tuple(dst.shape)):
                raise ModelLoadError(f"weight {name!r} has shape {shape}, expected "
                                     f"{want if split is not None else tuple(dst.shape)}")
            if split is not None:
                tensor = take(tensor, p.tp_dim, cut)
            elif not isinstance(tensor, torch.Tensor):
                tensor = tensor[:]  # a lazy slice of a file, read whole: a weight every rank holds
            dst.copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = set()
        for pname in params:
            mod = pname.split(".")[-2] if "." in pname else ""
            n_shards = {"qkv_proj": 3, "gate_up_proj": 2}.get(mod)
            expected |= {f"{pname}#{s}" for s in range(n_shards)} if n_shards else {f"{pname}#None"}
        missing = sorted(expected - loaded)
        if missing:  # named as checkpoints name them: k_proj, not qkv_proj's shard 1
            part = {v: k for k, v in self._MERGED.items()}
            shown = []
            for m in missing[:3]:
                pname, shard = m.split("#")
                path, mod, leaf = pname.rsplit(".", 2) if pname.count(".") >= 2 else ("", "", pname)
                shown.append(pname if shard == "None" else f"{path}.{part[(mod, int(shard))]}.{leaf}")
            raise ModelLoadError(f"missing weights for {len(missing)} parameters, e.g. {shown}")
