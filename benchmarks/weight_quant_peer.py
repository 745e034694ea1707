"""The peer of ``weight_quant.py``: PyTorch's own weight-only path as gpt-fast uses it, on a plain
Llama model of the same shape. One sequence, a static KV cache, the decode step compiled whole
(``torch.compile(mode="reduce-overhead", fullgraph=True)``: Inductor plus CUDA graphs), the
projections in one of three forms:

    bf16   F.linear
    int8   F.linear(x, w.to(bf16)) * scale, w int8 [N, K], scale [N] (per-channel, symmetric):
           gpt-fast's own form, where Inductor fuses the cast into the product (PyTorch's
           _weight_int8pack_mm ran 15.5 tok/s on an H100 against bf16's 134.3 in one run)
    int4   torch.ops.aten._weight_int4pack_mm(x, tinygemm-packed w, g, [K/g, N, 2] (scale, zero))
           (g = 128, asymmetric: w = (q - 8) * scale + zero), the weight converted by
           _convert_weight_to_int4pack from two codes a byte (even column in the high nibble)

The output head takes the projections' form (gpt-fast quantizes every ``nn.Linear``, its output
layer among them). Each form is checked against its dequantized weight once before timing
(``check_error``), so a layout mistake shows in the table instead of a fast wrong number.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


class PeerLinear(nn.Module):
    def __init__(self, w: torch.Tensor, mode: str, group: int = 128, keep_ref: bool = False):
        super().__init__()
        self.mode, self.group = mode, group
        w = w.to(torch.bfloat16)
        if mode == "bf16":
            self.register_buffer("w", w)
        elif mode == "int8":
            s = w.float().abs().amax(1).clamp(min=1e-8) / 127
            self.register_buffer("w", torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8))
            self.register_buffer("s", s.to(torch.bfloat16))
        else:
            N, K = w.shape
            wg = w.float().view(N, K // group, group)
            lo, hi = wg.amin(-1), wg.amax(-1)
            s = ((hi - lo) / 15).clamp(min=1e-8)
            q = torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
            zero = lo + 8 * s
            packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
            self.register_buffer("w", torch.ops.aten._convert_weight_to_int4pack(packed, 8))
            self.register_buffer("sz", torch.stack((s, zero), -1).transpose(0, 1).contiguous().to(torch.bfloat16))
            if keep_ref:
                self.deq = (q.view(N, K // group, group).float() * s[..., None] + lo[..., None]).view(N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.mode == "bf16":
            y = F.linear(x, self.w)
        elif self.mode == "int8":
            y = F.linear(x, self.w.to(x.dtype)) * self.s
        else:
            y = torch.ops.aten._weight_int4pack_mm(x, self.w, self.group, self.sz)
        return y.view(*shape[:-1], -1)

    def dequantized(self) -> torch.Tensor:
        if self.mode == "bf16":
            return self.w.float()
        if self.mode == "int8":
            return self.w.float() * self.s.float()[:, None]
        return self.deq


def rms(x, w, eps=1e-5):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class PeerLlama(nn.Module):
    """Llama over one sequence with a static cache of ``max_len`` positions."""

    def __init__(self, cfg: dict, mode: str, max_len: int, device="cuda", seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        self.nh, self.kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = h // self.nh
        self.embed = (torch.randn(v, h, device=device) * 0.02).to(torch.bfloat16)
        # the output head in the layers' form, as gpt-fast's quantize.py replaces every Linear
        self.lm_head = PeerLinear(torch.randn(v, h, device=device) * 0.02, mode)
        self.layers = nn.ModuleList()
        qkv = (self.nh + 2 * self.kvh) * self.hd
        for _ in range(cfg["num_hidden_layers"]):
            lay = nn.Module()
            lay.wqkv = PeerLinear(torch.randn(qkv, h, device=device) * 0.02, mode)
            lay.wo = PeerLinear(torch.randn(h, h, device=device) * 0.02, mode)
            lay.w13 = PeerLinear(torch.randn(2 * inter, h, device=device) * 0.02, mode)
            lay.w2 = PeerLinear(torch.randn(h, inter, device=device) * 0.02, mode)
            lay.n1 = torch.ones(h, device=device, dtype=torch.bfloat16)
            lay.n2 = torch.ones(h, device=device, dtype=torch.bfloat16)
            lay.register_buffer("k", torch.zeros(1, self.kvh, max_len, self.hd, device=device, dtype=torch.bfloat16))
            lay.register_buffer("v", torch.zeros(1, self.kvh, max_len, self.hd, device=device, dtype=torch.bfloat16))
            self.layers.append(lay)
        self.norm = torch.ones(h, device=device, dtype=torch.bfloat16)
        inv = 1.0 / (cfg.get("rope_theta", 500000.0) ** (torch.arange(0, self.hd, 2, device=device).float() / self.hd))
        f = torch.arange(max_len, device=device).float()[:, None] * inv[None, :]
        emb = torch.cat((f, f), -1)
        self.cos, self.sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        self.max_len = max_len

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids, pos: [T] -> logits of the last token."""
        T = ids.shape[0]
        x = self.embed[ids][None]  # [1, T, h]
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        mask = (torch.arange(self.max_len, device=ids.device)[None, :] <= pos[:, None])[None, None]
        for lay in self.layers:
            y = rms(x, lay.n1)
            q, k, v = lay.wqkv(y).split([self.nh * self.hd, self.kvh * self.hd, self.kvh * self.hd], -1)
            q = rope(q.view(1, T, self.nh, self.hd).transpose(1, 2), cos, sin)
            k = rope(k.view(1, T, self.kvh, self.hd).transpose(1, 2), cos, sin)
            lay.k.index_copy_(2, pos, k)
            lay.v.index_copy_(2, pos, v.view(1, T, self.kvh, self.hd).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, lay.k, lay.v, attn_mask=mask, enable_gqa=True)
            x = x + lay.wo(o.transpose(1, 2).reshape(1, T, -1))
            g, u = lay.w13(rms(x, lay.n2)).chunk(2, -1)
            x = x + lay.w2(F.silu(g) * u)
        return self.lm_head(rms(x[:, -1], self.norm))


def check_error(mode: str, device="cuda") -> float:
    """The form's product against its dequantized weight in float32: relative L2 error."""
    g = torch.Generator(device=device).manual_seed(3)
    w = torch.randn(512, 1024, device=device, generator=g) * 0.02
    lin = PeerLinear(w, mode, keep_ref=True)
    x = torch.randn(4, 1024, device=device, generator=g).to(torch.bfloat16)
    ref = x.float() @ lin.dequantized().T
    return ((lin(x).float() - ref).norm() / ref.norm()).item()


def decode_tok_s(cfg: dict, mode: str, prompt_len: int = 512, new_tokens: int = 256) -> dict:
    """Batch-1 greedy decode tok/s after a ``prompt_len`` prefill (eager), the step compiled with
    the Inductor settings gpt-fast's generate.py sets (coordinate-descent tuning of the generated
    kernels: its int8 product is one of them)."""
    import torch._inductor.config as inductor
    inductor.coordinate_descent_tuning = True
    inductor.triton.unique_kernel_names = True
    inductor.fx_graph_cache = True
    model = PeerLlama(cfg, mode, prompt_len + new_tokens + 8)
    err = check_error(mode)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, cfg["vocab_size"], (prompt_len,), device="cuda")
    with torch.inference_mode():
        t0 = time.perf_counter()
        tok = model(ids, torch.arange(prompt_len, device="cuda")).argmax(-1)
        for i in range(3):  # compile and record the graph
            step(tok.view(1), torch.tensor([prompt_len + i], device="cuda")).argmax(-1)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        pos = torch.tensor([prompt_len], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            tok = step(tok.view(1), pos).argmax(-1)
            pos += 1
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    return {"tok_s": new_tokens / secs, "compile_seconds": compile_s, "layer_rel_err": err}
