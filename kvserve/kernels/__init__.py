"""Triton kernels for the CUDA fast path. One kernel per file: the kernel, its launcher and a
plain-PyTorch reference that the tests (``tests/kernels``) compare it with.

The CPU never runs these in production; CI runs them under ``TRITON_INTERPRET=1`` on small
shapes. ``available(t)`` says whether a tensor's device takes the Triton path.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(t: torch.Tensor) -> bool:
    """The engine takes the Triton path for CUDA tensors. (Tests call the kernels on CPU
    tensors under the interpreter directly; the CPU engine never does.)"""
    return t.is_cuda and has_triton()


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands get exact products (``ieee``), not Triton's default tf32: the fp32 path
    exists to be exact."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
# kernel before it in the stream is finishing. Every such kernel calls ``pdl.wait_inputs`` before
# it reads anything an earlier kernel writes, or writes anything one reads (only read-only
# weights may be touched earlier), so overlapping is safe with any neighbour. The benchmarks
# set PDL False to measure without it.
PDL = True


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def launch_pdl(t: torch.Tensor) -> bool:
    return PDL and t.is_cuda and not interpreting() and _capability(t.device.index or 0) >= 9


def pdl_kw(t: torch.Tensor) -> dict:
    """Launch options of a kernel that takes ``USE_PDL``: ``launch_pdl`` only where it applies
    (the interpreter's launcher has no such option)."""
    return {"USE_PDL": True, "launch_pdl": True} if launch_pdl(t) else {"USE_PDL": False}
