"""Start-up forwards over the shapes of eager steps, so that Triton compiles their kernels then
and not in the time of the first requests that meet them.

Triton compiles a kernel once per specialization: its constexprs and the integer arguments that
are 1 or multiples of 16. Start-up meets only some of an engine's: the profiling forward is one
step's shape and the CUDA graphs hold decode steps. So the first batch of prompts, the first
prompt with a cached prefix, the first verify step run eagerly and a draft model's catch-up
steps each compiled kernels in a request's time: on an H100, an 8B engine's first batches took
1.5 to 3.1 s longer than the same batches later, two or three compiles each
(``benchmarks/first_requests.py``).

The shapes below reach the specializations that steps depend on: the prefill kernel's two tile
sizes (a step's longest query up to 64 tokens, or past it), with and without cached context;
the skinny GEMM's row tiers (1, 2 to 16, 17 to 32 rows), each with a row count that is a
multiple of 16 and one that is not, in the projections and the LM head; decode steps run
eagerly, with block tables one, two and sixteen blocks wide (the decode kernel specializes on the
width; where graphs hold the decode steps this costs a few eager steps at start-up). The prefill
kernel does not specialize on the width, which changes from step to step.

The forwards write KV into scratch blocks that no request holds (the target's highest block
numbers before any request exists; the draft model's from its own pool, given back). Nothing
reads a block before a request's own tokens are written into it, and no scratch block enters
the prefix cache.
"""
from __future__ import annotations

import logging

import torch

from kvserve.engine.faults import is_device_fault
from kvserve.layers.attention import ForwardContext, forward_context

log = logging.getLogger(__name__)

# Steps as (computed, new) per sequence: a lone prompt (into a compressed cache, SDPA's attention
# with its keys rotated in place by the RoPE + KV write: a specialization of its own), batches of
# short prompts of 5, 16, 21 and 32 rows, and one whose longest query passes 64 tokens (65: the
# shortest that does), its second sequence with cached context. Then decode steps run eagerly, as
# they run where no graph holds them (a sliding-window model's KV groups, enforce_eager, a batch
# past the graphs): block tables one, two and sixteen blocks wide, since the decode kernel
# specializes on the width.
SHAPES = (((0, 40),), ((0, 2), (0, 3)), ((0, 7), (0, 9)), ((0, 9), (0, 12)), ((0, 15), (0, 17)), ((0, 65), (16, 30)))
DECODE_SHAPES = (((3, 1),), ((3, 1), (20, 1)), ((250, 1), (3, 1)))
LOGIT_ROWS = (1, 2, 16, 17, 32)


def _seq_blocks(c: int, n: int, block_size: int) -> int:
    return -(-(c + n) // block_size)


def _blocks(shape, block_size: int) -> int:
    return sum(_seq_blocks(c, n, block_size) for c, n in shape)


def blocks_needed(block_size: int) -> int:
    """Scratch blocks for every shape; with fewer, the shapes that do not fit are left out."""
    return max(_blocks(shape, block_size) for shape in SHAPES + DECODE_SHAPES)


def _tables(shape, block_size: int, scratch: list[int]) -> list[tuple[int, int, list[int]]]:
    seqs, free = [], list(scratch)
    for c, n in shape:
        k = _seq_blocks(c, n, block_size)
        seqs.append((c, n, free[:k]))
        free = free[k:]
    return seqs


def warm_eager(runner, scratch: list[int], model=None, groups: int = 1) -> None:
    """Run each shape through ``runner._forward``, eagerly (``model``: a draft's (model, KV
    layers); None: the runner's own) on the block numbers ``scratch``, then the LM head over
    ``LOGIT_ROWS`` rows. Shapes longer than the engine's context, or needing more blocks than
    ``scratch`` holds, are left out. ``groups``: the target's KV groups (sliding-window models),
    each given the same scratch tables. A failure other than the device's is logged and start-up
    goes on: the steps would compile their kernels when they come, as they did without this."""
    try:
        _warm(runner, scratch, model, groups)
    except Exception as e:  # noqa: BLE001 - an optimisation; the device's own faults still end start-up
        if is_device_fault(e):
            raise
        log.warning("the eager steps' kernels were not compiled at start-up (%r); the first steps of "
                    "each shape compile them", e)


@torch.inference_mode()
def _warm(runner, scratch: list[int], model, groups: int) -> None:
    net, layers = (runner.model, runner.kv_cache.layers) if model is None else model
    bs = runner.block_size
    hidden = None
    for shape in SHAPES + DECODE_SHAPES:
        if max(c + n for c, n in shape) > runner.max_model_len or _blocks(shape, bs) > len(scratch):
            continue  # no step of this engine is so long, or too few scratch blocks
        seqs = _tables(shape, bs, scratch)
        ids = [(7 * i + 3) % runner.arch.vocab_size for i in range(sum(n for _, n in shape))]
        group_seqs = [seqs] * (groups - 1) if groups > 1 else None
        # Without graphs: a decode shape runs eagerly, as where no graph holds it.
        out, _ = runner._forward(ids, seqs, model=(net, layers, None), group_seqs=group_seqs)
        if shape in SHAPES:
            hidden = out
    for m in LOGIT_ROWS if hidden is not None else ():
        if model is None:
            runner._logits(hidden[:m])
        else:
            with forward_context(ForwardContext(None, [], runner.backend)):
                net.compute_logits(hidden[:m])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
