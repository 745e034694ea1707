"""Tensor parallelism: the ranks' process groups and the layers split across them.

Every rank holds a slice of each weight and runs the same forward on the same tokens:

    qkv_proj      column-parallel: rank r holds its heads' rows of q, k and v, still fused
                  [q_r | k_r | v_r]; with fewer KV heads than ranks, ranks r*kvh//N share KV
                  head r*kvh//N (each holds a copy: the heads it attends with)
    gate_up_proj  column-parallel: [gate_r | up_r], the columns r*I/N .. (r+1)*I/N of each
    o_proj, down  row-parallel: the matching input columns; partial sums all-reduced
    embedding     vocab-parallel: rows r*V'/N .. (r+1)*V'/N (V' = V padded to a multiple of N);
                  a rank looks up the ids in its range, zeros elsewhere, then all-reduce
    LM head       the same rows; each rank's logits are gathered to rank 0 only, which alone
                  samples (an all-gather would send every rank logits it never reads)

A split parameter carries ``tp_dim`` and ``tp_shards``: the ``Shard`` of the full (one-rank)
tensor along that dimension for each fused section, so the loaders cut every source (Hugging
Face names, the fused layout of dummy weights) down to the rank's slice. Collectives run on raw
``ProcessGroup`` objects owned by a ``TPGroup``: no process-wide default group, so an engine's
group lives and dies with it. Control messages go over a gloo group even where the layers'
collectives use NCCL.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.errors import ConfigError
from kvserve.layers.linear import Linear, linear
from kvserve.layers.weight_init import Embedding

TIMEOUT = datetime.timedelta(seconds=300)  # a collective that waits longer: a rank hangs


@dataclass(frozen=True)
class Shard:
    """Rank's part of one section of a dimension: ``full`` long in the one-rank model, this rank
    holds ``local`` from ``start`` (rows past ``full``, vocabulary padding, are zeros)."""
    full: int
    local: int
    start: int


class TPGroup:
    """One rank's view of the tensor-parallel group: ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int, store, device: torch.device):
        """``store``: ``make_store``'s, the same server on every rank. Blocks until every rank
        has joined."""
        import torch.distributed as dist
        self.rank, self.size, self.device, self.store = rank, size, device, store
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, TIMEOUT)
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
        else:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("dev", store), rank, size, TIMEOUT)

    @staticmethod
    def make_store(rank: int, size: int, port: int = 0, host: str = "127.0.0.1"):
        """Rank 0: a store on a free port of this host (read ``.port``); the others: a client of
        rank 0's."""
        import torch.distributed as dist
        return dist.TCPStore(host, port, size, rank == 0, timeout=TIMEOUT, wait_for_workers=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` concatenated along the last dimension; other ranks: None."""
        import torch.distributed as dist
        opts = dist.GatherOptions()
        opts.rootRank = 0
        x = x.contiguous()
        out = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self.pg.gather(out, [x], opts).wait()
        return torch.cat(out[0], dim=-1) if self.rank == 0 else None

    def broadcast(self, x: torch.Tensor, cpu: bool = False) -> torch.Tensor:
        """``x`` from rank 0, in place, on the device group (``cpu``: the gloo group)."""
        import torch.distributed as dist
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        (self.cpu if cpu else self.pg).broadcast([x], opts).wait()
        return x

    def send_object(self, obj) -> None:
        """Rank 0: a picklable object to every other rank (their ``recv_object``)."""
        data = pickle.dumps(obj)
        self.broadcast(torch.tensor([len(data)], dtype=torch.int64), cpu=True)
        self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), cpu=True)

    def recv_object(self):
        n = self.broadcast(torch.zeros(1, dtype=torch.int64), cpu=True)
        buf = self.broadcast(torch.empty(int(n), dtype=torch.uint8), cpu=True)
        return pickle.loads(buf.numpy().tobytes())

    def heads(self, n: int, head_dim: int) -> Shard:
        """The rank's share of ``n`` heads (one head each, replicated, when ``n`` < ranks)."""
        local = max(1, n // self.size)
        return Shard(n * head_dim, local * head_dim, (self.rank * n // self.size) * head_dim)

    def cols(self, n: int, pad: bool = False) -> Shard:
        """An even split of ``n`` (``pad``: rounded up to a multiple of the ranks)."""
        local = -(-n // self.size) if pad else n // self.size
        return Shard(n, local, self.rank * local)


def check_shape(size: int, heads: int, kv_heads: int, intermediate: int, device: torch.device) -> None:
    """Refuse a tensor-parallel size the model's shape or the host does not allow."""
    def bad(message: str):
        raise ConfigError("tensor_parallel_size", f"{size} {message}")
    if heads % size:
        ok = [n for n in range(2, heads + 1) if heads % n == 0 and intermediate % n == 0
              and (kv_heads % n == 0 or n % kv_heads == 0)]
        bad(f"does not divide the model's {heads} attention heads; sizes this model allows: {[1] + ok}")
    if intermediate % size:
        bad(f"does not divide the model's MLP width (intermediate_size {intermediate})")
    if kv_heads % size and size % kv_heads:
        bad(f"and the model's {kv_heads} KV heads must divide one another (with fewer KV heads than "
            f"ranks, each KV head is copied to size / kv_heads ranks)")
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if size > n:
            bad(f"needs {size} GPUs (one per rank); {n} visible")


def _mark(p: nn.Parameter, dim: int, shards: list[Shard]) -> nn.Parameter:
    p.tp_dim, p.tp_shards = dim, tuple(shards)
    return p


def column_linear(in_features: int, shards: list[Shard], bias: bool, tp: TPGroup | None) -> Linear:
    """A fused column-parallel projection: its output is the rank's slice of each section, in
    order (on one rank: a plain ``Linear`` of the full sections)."""
    layer = Linear(in_features, sum(s.local for s in shards), bias=bias)
    if tp is not None:
        _mark(layer.weight, 0, shards)
        if bias:
            _mark(layer.bias, 0, shards)
    return layer


class RowParallelLinear(Linear):
    """The rank's input columns; the partial products are summed over the ranks."""

    def __init__(self, shard: Shard, out_features: int, tp: TPGroup):
        super().__init__(shard.local, out_features, bias=False)
        self.tp = tp
        _mark(self.weight, 1, [shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight))


def row_linear(shard: Shard, out_features: int, tp: TPGroup | None) -> Linear:
    return Linear(shard.full, out_features, bias=False) if tp is None else RowParallelLinear(shard, out_features, tp)


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding; ids outside them contribute zeros to the sum."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.shard = tp.cols(vocab_size, pad=True)
        self.weight = _mark(nn.Parameter(torch.empty(self.shard.local, hidden_size)), 0, [self.shard])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.local)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


def embedding(vocab_size: int, hidden_size: int, tp: TPGroup | None) -> nn.Module:
    return Embedding(vocab_size, hidden_size) if tp is None else VocabParallelEmbedding(vocab_size, hidden_size, tp)


# -- cutting full tensors to the rank's slice -------------------------------------------------
def full_shape(p: nn.Parameter) -> tuple[int, ...]:
    """The one-rank shape of a (possibly split) parameter."""
    shape = list(p.shape)
    if hasattr(p, "tp_shards"):
        shape[p.tp_dim] = sum(s.full for s in p.tp_shards)
    return tuple(shape)


def take(t, dim: int, s: Shard, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The rank's slice ``s`` of a full section ``t`` along ``dim``: a tensor, or a lazy
    safetensors slice (only the slice is read). Rows past the end are zero padding."""
    end = min(s.start + s.local, s.full)
    index = (slice(None),) * dim + (slice(s.start, end),)
    part = t[index]
    if dtype is not None:
        part = part.to(dtype)
    if end - s.start < s.local:
        pad = list(part.shape)
        pad[dim] = s.local - (end - s.start)
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part


def shard_full(p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """A parameter's slice of its full (one-rank, fused) value."""
    if not hasattr(p, "tp_shards"):
        return full
    parts, off = [], 0
    for s in p.tp_shards:
        parts.append(take(full.narrow(p.tp_dim, off, s.full), p.tp_dim, s))
        off += s.full
    return torch.cat(parts, dim=p.tp_dim)
