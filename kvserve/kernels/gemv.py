"""Skinny matrix products for small-batch decode: ``y = x @ W.T (+ bias)`` with few rows of x.

At batch 1 a decode step is the weights streamed once through the SMs; cuBLAS's GEMM kernels,
shaped for tiles of 64+ rows, read them at about 70% of the copy bandwidth on the H200. Here each
program owns ``BLOCK_N`` output features and streams their rows of W over K, so the whole grid is
one wave of independent, wide, unmasked loads:

    W [N, K] row-major           program p
    rows p*BN .. p*BN+BN-1  ->   acc[BN, BK] += W[rows, k:k+BK] * x[k:k+BK]   (for k over K)
                                 y[rows] = sum(acc, axis=1)

One row of x (``M == 1``) accumulates elementwise and reduces once at the end; a few rows
(``M <= 16``) go through one ``tl.dot`` per tile with x padded to 16 rows (the tensor cores have
time to spare: the product is memory-bound either way); 17 to 32 rows, with x padded to 32, put
the tile of W on the product's M side (``W_ON_M``: y^T = W x^T, Hopper's tensor-core product
takes 64+ rows there).

``silu_mul=True`` fuses the MLP's activation: W is the merged ``[gate | up]`` matrix [2I, K] and
the program reads the gate row n and the up row n + I together, so y = silu(g) * u is written
directly ([M, I]) and the [M, 2I] intermediate never exists. Rounding follows the unfused path:
g and u are rounded to the activation dtype, silu(g) is rounded, then multiplied.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.common import dot_precision, pdl_kw, wait_inputs
from kvserve.kernels.silu_mul import silu_mul_rounded

MAX_ROWS = 32  # rows of x this kernel takes; more go to cuBLAS


@triton.jit
def _load_w(w_ptrs, u_ptrs, k0, rk, K, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of W at column k0 (and of the up rows with the fused SiLU)."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0)
        wu = tl.load(u_ptrs + k0) if SILU_MUL else w
    else:
        k_ok = ((k0 + rk) < K)[None, :]
        w = tl.load(w_ptrs + k0, mask=k_ok, other=0.0)
        wu = tl.load(u_ptrs + k0, mask=k_ok, other=0.0) if SILU_MUL else w
    return w, wu


@triton.jit
def _dot_tile(x, w, acc, W_ON_M: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x w^T ([rows, BLOCK_N]), or with ``W_ON_M`` its transpose acc + w x^T."""
    if W_ON_M:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, up_offset,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = 1,
                 W_ON_M: tl.constexpr = False):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    # Out-of-range rows read row N-1 (valid memory, results dropped): the loads stay unmasked.
    rn_safe = tl.minimum(rn, N - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = W + rn_safe[:, None] * stride_wn + rk[None, :]
    u_ptrs = w_ptrs + up_offset * stride_wn
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        # The first weight tiles (``PREFETCH`` of them: 1 or 2) stream in before waiting on the
        # previous kernel (weights are never written while the engine runs); each iteration then
        # asks for the tile ``PREFETCH`` ahead before using this one, so ``PREFETCH + 1`` are in
        # flight (past the end the mask is all false).
        tl.static_assert(PREFETCH == 1 or PREFETCH == 2, "PREFETCH: 1 or 2 tiles ahead")
        w, wu = _load_w(w_ptrs, u_ptrs, 0, rk, K, SILU_MUL, EVEN_K)
        if PREFETCH == 2:
            w1, wu1 = _load_w(w_ptrs, u_ptrs, BLOCK_K, rk, K, SILU_MUL, False)
        wait_inputs(USE_PDL)
        for k0 in range(0, K, BLOCK_K):
            w_next, wu_next = _load_w(w_ptrs, u_ptrs, k0 + PREFETCH * BLOCK_K, rk, K, SILU_MUL, False)
            if EVEN_K:
                x = tl.load(X + k0 + rk).to(tl.float32)
            else:
                x = tl.load(X + k0 + rk, mask=(k0 + rk) < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            if SILU_MUL:
                acc_u += wu.to(tl.float32) * x[None, :]
            if PREFETCH == 2:
                w, wu, w1, wu1 = w1, wu1, w_next, wu_next
            else:
                w, wu = w_next, wu_next
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        if SILU_MUL:
            y_u = tl.sum(acc_u, axis=1)[None, :]
    else:
        wait_inputs(USE_PDL)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M] if W_ON_M else [BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M] if W_ON_M else [BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs + k0)
                if SILU_MUL:
                    wu = tl.load(u_ptrs + k0)
            else:
                k_ok = (k0 + rk) < K
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
                if SILU_MUL:
                    wu = tl.load(u_ptrs + k0, mask=k_ok[None, :], other=0.0)
            acc = _dot_tile(x, w, acc, W_ON_M, PRECISION)
            if SILU_MUL:
                acc_u = _dot_tile(x, wu, acc_u, W_ON_M, PRECISION)
        y = tl.trans(acc) if W_ON_M else acc
        y_u = tl.trans(acc_u) if W_ON_M else acc_u
    if HAS_BIAS:
        y += tl.load(B + rn_safe).to(tl.float32)[None, :]
    if SILU_MUL:
        y = silu_mul_rounded(y.to(Y.dtype.element_ty), y_u.to(Y.dtype.element_ty), Y.dtype.element_ty)
    rows = tl.arange(0, BLOCK_M)
    out = Y + rows[:, None] * stride_ym + rn[None, :]
    tl.store(out, y.to(Y.dtype.element_ty), mask=(rows < M)[:, None] & n_ok[None, :])


def default_config(M: int, N: int, K: int, silu_mul: bool = False, elem_bytes: int = 2) -> dict:
    """Tile per shape, tuned at the Llama-3-8B shapes on the H200. Several rows: from the sweep
    (``benchmarks/gemv_tune.py``). One row: 4 output rows per program (2 gate + 2 up rows with
    the fused SiLU), 1 KiB row segments per load, two tiles asked for ahead: chosen in the
    engine's batch-1 decode (graphs, PDL), where the prefetch overlaps the previous kernel (timed
    alone, which sees no kernel to overlap, the variants rank the other way). Up to 16 rows:
    16-row dot tiles, 3 stages of (x, W[, W_up]) tiles in shared memory (float32 takes shorter
    tiles to fit). 17 to 32 rows: 128 rows of W (and 128 of W_up) on the product's M side by 128
    columns, 3 stages."""
    if M == 1:
        return {"BLOCK_N": 2 if silu_mul else 4, "BLOCK_K": 512 * 2 // elem_bytes, "PREFETCH": 2,
                "num_warps": 4, "num_stages": 1}
    if M > 16:
        return {"BLOCK_N": 128, "BLOCK_K": 128 * 2 // elem_bytes, "num_warps": 4, "num_stages": 3, "W_ON_M": True}
    block_k = 128 if N > 65536 else 256
    return {"BLOCK_N": 64, "BLOCK_K": block_k * 2 // elem_bytes // (2 if silu_mul and elem_bytes > 2 else 1),
            "num_warps": 4, "num_stages": 3}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         silu_mul: bool = False, config: dict | None = None, pdl: bool = True) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] row-major -> [M, N]; with ``silu_mul``, weight is
    [gate | up] ([2I, K]) and the result silu(x W_gate.T) * (x W_up.T), [M, I]. ``config``: the
    tile (None: ``default_config``); ``pdl``: programmatic dependent launch where the GPU has it."""
    assert x.dim() == 2 and weight.dim() == 2, "gemv takes x [M, K] and weight [N, K]"
    M, K = x.shape
    assert 1 <= M <= MAX_ROWS, f"gemv takes 1..{MAX_ROWS} rows, got {M}"
    assert weight.shape[1] == K and weight.stride(1) == 1 and x.stride(1) == 1, \
        f"gemv: weight {tuple(weight.shape)} must be row-major with K={K} columns"
    assert not (silu_mul and bias is not None), "the fused SiLU-and-mul has no bias"
    N = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if silu_mul:
        assert weight.shape[0] == 2 * N
    if bias is not None:
        assert bias.shape == (N,) and bias.is_contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cfg = dict(config or default_config(M, N, K, silu_mul, weight.element_size()))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    block_k = min(block_k, triton.next_power_of_2(K))
    block_m = 1 if M == 1 else max(16, triton.next_power_of_2(M))
    grid = (triton.cdiv(N, block_n),)
    _gemv_kernel[grid](x, weight, bias if bias is not None else weight, y, M, N, K,
                       x.stride(0), weight.stride(0), y.stride(0), N,
                       HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_K=K % block_k == 0,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       PRECISION=dot_precision(weight.dtype), **pdl_kw(x, pdl), **cfg)
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             silu_mul: bool = False) -> torch.Tensor:
    """Plain PyTorch, rounding where the unfused model rounds."""
    y = torch.nn.functional.linear(x, weight, bias)
    if silu_mul:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y
