"""Weight quantizers for 4-bit group-wise and 8-bit group-wise or per-channel weights:
round-to-nearest, AWQ's activation-aware scales and GPTQ's Hessian-guided rounding. Pure tensor
math on one weight matrix at a time; what runs the model and writes the checkpoint is in
``__init__.py``.

The grid is the one compressed-tensors stores (``int``, ``num_bits`` 4 or 8, ``strategy`` group,
or channel: one group of all K input columns): signed codes q in [-2^(b-1), 2^(b-1) - 1] ([-8, 7]
at 4 bits) per group of ``g`` input columns, ``w ~ (q - z) * s``. Symmetric: z = 0,
s = max|w| / 7.5 at 4 bits (the grid's half range, so both ends are used). Asymmetric: the range
[min(w, 0), max(w, 0)] over 2^b - 1 steps, z rounded into the codes' range. An integer z makes the levels
multiples of s, so the group's minimum lies up to half a step off the nearest one; the
``minmax`` observer also tries steps up to 10% wider (both ends stay within half a step of a
level, as with the plain step: nothing more is clipped) and keeps the one whose rounded weights
are nearest the group's. Given each column's importance (AWQ passes its scaled inputs' mean
squares, the diagonal of X^T X / T), "nearest" is weighted by it, which measures the layer's
output error rather than the weights', and ranges shrunk by up to 5% are tried as well: a column
whose inputs are small costs little when its extreme is clipped. With the ``mse`` observer
(llm-compressor's name; ``kvserve quantize``'s default for GPTQ) each group's range is instead
tried shrunk by up to 20%, clipping its extremes, and the nearest rounding is kept. Scales are
rounded to the checkpoint's dtype before the codes are chosen, so codes fit the scales a reader
will use.

References for the methods (the code is ours): AWQ, Lin et al. 2023, arXiv:2306.00978 (per input
channel scales from the activations' and weights' mean magnitudes, their exponent searched on a
grid, folded into the op before the layer); GPTQ, Frantar et al.
2022, arXiv:2210.17323 (columns quantized in order, each one's rounding error spread over the
columns not yet quantized through the inverse Hessian's Cholesky factor).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

OBSERVERS = ("minmax", "mse")
_SHRINK_STEPS, _MAX_SHRINK = 40, 0.2
_WIDEN_STEPS, _MAX_WIDEN = 10, 0.1
_WEIGHTED_SHRINK_STEPS, _MAX_WEIGHTED_SHRINK = 5, 0.05


@dataclass(frozen=True)
class Grid:
    group_size: int  # 0: one group per output channel (its K columns)
    symmetric: bool
    dtype: torch.dtype  # of the stored scales
    observer: str = "minmax"  # how a group's range is chosen: its extremes, or the least squared error
    bits: int = 4

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def columns(self, K: int) -> int:
        """Input columns a group holds in a matrix of K."""
        return self.group_size or K


@dataclass
class Quantized:
    """One matrix: codes [N, K] int8 in the grid's range, scales and zeros [N, K / g] (zeros int8, all 0
    when symmetric), ``g_idx`` [K] (column -> group) when the groups are not the contiguous runs
    of columns."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        N, K = self.codes.shape
        g_idx = self.g_idx if self.g_idx is not None else torch.arange(K) // (K // self.scales.shape[1])
        s = self.scales.float()[:, g_idx]
        z = self.zeros.float()[:, g_idx]
        return (self.codes.float() - z) * s


def group_params(w: torch.Tensor, grid: Grid, widen: bool = True,
                 importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, G, g] (or [N, g]) -> (scale, zero) per group, scale rounded to the stored dtype.
    ``widen`` False: the minmax observer's plain step, without the wider ones (AWQ's search, which
    rounds each candidate scaling, compares them on that cheaper grid). ``importance`` [G, g]
    (or [g]), with the asymmetric minmax observer and ``widen``: each column's cost per squared
    error (non-negative); the candidates, ranges shrunk by up to 5% among them, are compared on it."""
    if grid.symmetric:
        lo, hi = None, w.abs().amax(dim=-1)
    else:
        lo, hi = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
    scale, zero = _range_params(lo, hi, grid)
    if grid.observer == "minmax" and lo is not None and widen:
        wider = (1 + _MAX_WIDEN * i / _WIDEN_STEPS for i in range(1, _WIDEN_STEPS + 1))
        candidates = [_range_params(lo, hi, grid, f) for f in wider]
        if importance is not None:
            shrunk = (1 - _MAX_WEIGHTED_SHRINK * i / _WEIGHTED_SHRINK_STEPS
                      for i in range(1, _WEIGHTED_SHRINK_STEPS + 1))
            candidates += [_range_params(lo * p, hi * p, grid) for p in shrunk]
        scale, zero = _nearest(w, scale, zero, candidates, grid, importance)
    if grid.observer == "mse":
        shrunk = (1 - _MAX_SHRINK * i / _SHRINK_STEPS for i in range(1, _SHRINK_STEPS + 1))
        scale, zero = _nearest(w, scale, zero, (_range_params(None if lo is None else lo * p, hi * p, grid)
                                                for p in shrunk), grid)
    return scale, zero


def _nearest(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, candidates, grid: Grid,
             importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, of (scale, zero) and each candidate pair, the one whose rounding is nearest w,
    its squared errors times ``importance`` where given (the first of equals)."""
    best = _error(w, scale, zero, grid, importance)
    for s, z in candidates:
        err = _error(w, s, z, grid, importance)
        better = err < best
        best = torch.where(better, err, best)
        scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    return scale, zero


def _range_params(lo: torch.Tensor | None, hi: torch.Tensor, grid: Grid,
                  widen: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) spanning [lo, hi] (``lo`` None: symmetric, [-hi, hi]); ``widen``: the
    asymmetric step that many times (max - min) / (2^b - 1), its zero rounded for it."""
    steps = grid.qmax - grid.qmin
    scale = hi / (steps / 2) if lo is None else (hi - lo) / steps * widen
    scale = scale.to(grid.dtype).float().clamp(min=torch.finfo(grid.dtype).tiny)
    zero = torch.zeros_like(scale) if lo is None else torch.round(grid.qmin - lo / scale).clamp(grid.qmin, grid.qmax)
    return scale, zero


def _error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, grid: Grid,
           importance: torch.Tensor | None = None) -> torch.Tensor:
    err = ((_codes(w, scale, zero, grid) - zero[..., None]) * scale[..., None] - w).pow(2)
    return (err if importance is None else err * importance).sum(dim=-1)


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, grid: Grid) -> torch.Tensor:
    return torch.round(w / scale[..., None] + zero[..., None]).clamp(grid.qmin, grid.qmax)


def rtn(w: torch.Tensor, grid: Grid, widen: bool = True,
        importance: torch.Tensor | None = None) -> Quantized:
    """Round to nearest, per group of contiguous columns (``widen``; ``importance``
    [K], each column's cost per squared error: as ``group_params``)."""
    N, K = w.shape
    g = grid.columns(K)
    wg = w.float().view(N, K // g, g)
    scale, zero = group_params(wg, grid, widen, None if importance is None else importance.float().view(K // g, g))
    q = _codes(wg, scale, zero, grid).view(N, K)
    return Quantized(q.to(torch.int8), scale.to(grid.dtype), zero.to(torch.int8))


def fake_quant(w: torch.Tensor, grid: Grid, widen: bool = True) -> torch.Tensor:
    return rtn(w, grid, widen).dequantize()


def awq_scales(w: torch.Tensor, x: torch.Tensor, grid: Grid, steps: int = 20,
               tie: torch.Tensor | None = None) -> torch.Tensor:
    """AWQ: per input channel s = mean|x|^a / mean|w~|^(1 - a) (w~: each weight over its group's
    largest magnitude; AutoAWQ's "duo" scales), normalised so that max(s) * min(s) = 1, with a in
    [0, 1) chosen on a grid of ``steps`` values to minimise ||x W^T - x (Q(W diag s) diag 1/s)^T||.
    ``x`` [T, K] are the layer's inputs on calibration text. ``tie`` [K]: channels with the same
    index share one scale (from their mean statistics), where the op the scale folds into has
    fewer channels than the layer (o_proj's heads over their shared KV head's v_proj rows).
    s = 1 (plain RTN) is tried too, so the result is never worse than RTN on these inputs. Q is
    the grid without the minmax observer's wider steps (a tenth of the cost; the weights are then
    rounded with them, and the ranges chosen on the scaled inputs' mean squares: ``rtn``'s
    ``importance``)."""
    w, x = w.float(), x.float()
    N, K = w.shape
    g = grid.columns(K)
    act = x.abs().mean(dim=0).clamp(min=1e-8)
    wg = w.abs().view(N, K // g, g)
    spread = (wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-12)).view(N, K).mean(dim=0).clamp(min=1e-4)
    if tie is not None:
        n = int(tie.max()) + 1
        count = torch.zeros(n).index_add_(0, tie, torch.ones(K))
        act = (torch.zeros(n).index_add_(0, tie, act) / count)[tie]
        spread = (torch.zeros(n).index_add_(0, tie, spread) / count)[tie]
    ref = x @ w.t()
    ones = torch.ones_like(act)
    best, best_s = (x @ fake_quant(w, grid, False).t() - ref).pow(2).mean().item(), ones
    for i in range(steps):
        a = i / steps
        s = (act.pow(a) / spread.pow(1 - a)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = (x @ (fake_quant(w * s, grid, False) / s).t() - ref).pow(2).mean().item()
        if err < best:
            best, best_s = err, s
    return best_s


def gptq(w: torch.Tensor, hessian: torch.Tensor, grid: Grid, act_order: bool = False, damp: float = 0.01,
         block: int = 128) -> Quantized:
    """GPTQ on w [N, K] with H = X^T X [K, K] of its calibration inputs. A group's scale and zero
    are taken from the (already updated) weights when its first column is reached. With
    ``act_order`` the columns are quantized in order of decreasing H diagonal while the groups
    stay runs of the original columns (compressed-tensors' ``actorder: weight``: no index to
    store, nothing to permute at run time); their parameters are then taken from the weights
    before any update, as the groups are visited out of order."""
    W = w.float().clone()
    N, K = W.shape
    g = grid.columns(K)
    H = hessian.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else None
    scales = torch.zeros(N, K // g)
    zeros = torch.zeros(N, K // g)
    group = torch.arange(K) // g  # of each column in the order they are quantized
    if perm is not None:
        scales, zeros = group_params(W.view(N, K // g, g), grid)
        W, H, group = W[:, perm], H[perm][:, perm], group[perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, Q1, E1, Hi = W[:, i1:i2].clone(), torch.zeros(N, i2 - i1), torch.zeros(N, i2 - i1), hinv[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = i1 + j
            if perm is None and col % g == 0:  # the group's parameters from its columns as they stand now
                grp = torch.cat([W1[:, j:], W[:, i2:]], dim=1)[:, :g]
                scales[:, col // g], zeros[:, col // g] = group_params(grp, grid)
            s, z = scales[:, group[col]], zeros[:, group[col]]
            q = torch.round(W1[:, j] / s + z).clamp(grid.qmin, grid.qmax)
            Q1[:, j] = q
            err = (W1[:, j] - (q - z) * s) / Hi[j, j]
            W1[:, j:] -= err[:, None] * Hi[j, j:][None, :]
            E1[:, j] = err
        Q[:, i1:i2] = Q1
        W[:, i2:] -= E1 @ hinv[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return Quantized(Q.to(torch.int8), scales.to(grid.dtype), zeros.to(torch.int8))
