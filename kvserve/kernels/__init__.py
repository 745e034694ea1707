"""Triton kernels for the CUDA fast path. One kernel per file: the kernel, its launcher and a
plain-PyTorch reference that the tests (``tests/kernels``) compare it with; what several kernels
share is in ``common.py``. Launch choices come in as launcher arguments (the engine's
``KernelConfig``, through the attention backend); nothing here is switched at run time.

The CPU never runs these in production; CI runs them under ``TRITON_INTERPRET=1`` on small
shapes. This module imports no Triton: ``available(t)`` says whether a tensor's device takes the
Triton path.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def has_triton() -> bool:
    """Triton is installed. Found, not imported: on CUDA the import (a few tenths of a second)
    happens on the device warm-up's thread while the weights load (``engine/startup.py``); a
    Triton that is found but fails to import sends an "auto" engine to the PyTorch path there."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(t: torch.Tensor) -> bool:
    """The engine takes the Triton path for CUDA tensors. (Tests call the kernels on CPU
    tensors under the interpreter directly; the CPU engine never does.)"""
    return t.is_cuda and has_triton()
