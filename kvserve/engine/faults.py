"""Which failures end one request and which end the engine.

- One request's: building its sampling rows (seed generator, penalties, banned tokens), sampling
  them on their own, its prompt log-probs, detokenizing its tokens. The request is aborted (its
  KV blocks go back to the pool), its caller gets ``RequestFailedError``, the engine serves on.
- The engine's: a device fault (a CUDA error, device memory exhausted) anywhere, and anything
  else a step raises that no single request explains (the batched forward, the scheduler's
  bookkeeping). The device or the engine's state can no longer be trusted: ``AsyncEngine``
  fails every open request and stops, the server answers 503 on /health and exits non-zero.
"""
from __future__ import annotations

import torch


class RequestFailedError(RuntimeError):
    """One request failed inside the engine and was aborted; the engine serves on."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"request {request_id!r} failed in the engine: {cause!r}")
        self.request_id = request_id
        self.__cause__ = cause


_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", ())


def is_device_fault(e: BaseException) -> bool:
    """A fault of the device itself: it ends the engine even where a request raised it."""
    if isinstance(e, (torch.OutOfMemoryError, _ACCELERATOR_ERROR)):
        return True
    text = str(e)
    return "CUDA error" in text or "device-side assert" in text or "CUBLAS_STATUS" in text
