"""The shared memory of ``CudaIpcConnector`` (kvserve/kvtier/ipc.py): one region that the
producer allocates (its KV pool) and the consumer maps, described by a JSON handle sent at
connect time.

Only this module depends on the device; everything above it (holds, acknowledgements, the
engine's hand-over) is the same for both:

    CUDA   device memory shared with CUDA IPC: torch's ``reduce_tensor`` on the producer, its
           ``rebuild_cuda_tensor`` on the consumer (one GPU, or two GPUs of one host)
    CPU    a file in /dev/shm (else the temp directory) that both processes map; the producer
           removes its name once the consumer opened it, so nothing outlives the two processes

The handle is plain JSON, never a pickle: the consumer rebuilds the CUDA tensor from values it
checks and classes it picks itself, so a peer cannot make it run code.
"""
from __future__ import annotations

import os
import tempfile

import torch

from kvserve.errors import ConfigError

PREFIX = "kvserve-kv-"


def _dirs() -> list[str]:
    return [d for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]


def _name(obj) -> str:
    return str(obj) if isinstance(obj, torch.dtype) else f"{obj.__module__}.{obj.__qualname__}"


# The only classes and dtypes a CUDA handle may name (torch's rebuild arguments carry them).
_KNOWN = {_name(o): o for o in (torch.Tensor, torch.nn.Parameter, torch.storage.TypedStorage,
                                torch.UntypedStorage, torch.uint8)}


def _encode(a):
    if isinstance(a, bytes):
        return {"bytes": a.hex()}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, (tuple, list)):  # (torch.Size is a tuple)
        return {"tuple": [_encode(x) for x in a]}
    if isinstance(a, (type, torch.dtype)) and _name(a) in _KNOWN:
        return {"name": _name(a)}
    raise TypeError(f"cannot describe {type(a).__name__} in a KV buffer handle")


def _decode(a):
    if isinstance(a, dict):
        if set(a) == {"bytes"} and isinstance(a["bytes"], str):
            return bytes.fromhex(a["bytes"])
        if set(a) == {"tuple"} and isinstance(a["tuple"], list):
            return tuple(_decode(x) for x in a["tuple"])
        if set(a) == {"name"} and a["name"] in _KNOWN:
            return _KNOWN[a["name"]]
        raise ValueError(f"bad KV buffer handle field {str(a)[:100]}")
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise ValueError(f"bad KV buffer handle field {str(a)[:100]}")


class SharedBuffer:
    """``tensor``: the whole buffer, uint8, in this process. ``handle``: what the peer opens."""

    def __init__(self, tensor: torch.Tensor, handle: dict, path: str | None = None):
        self.tensor, self.handle, self.path = tensor, handle, path
        self.nbytes = tensor.numel()

    @classmethod
    def create(cls, device: torch.device, nbytes: int, field: str = "kv_cache_memory",
               what: str = "the shared KV pool of a CudaIpcConnector producer") -> SharedBuffer:
        """The producer's buffer, on ``device`` (a CUDA device: device memory; else host memory).
        ``field`` and ``what``: the option that sized it and what it holds, for the errors."""
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor
            try:
                t = torch.empty(nbytes, dtype=torch.uint8, device=device)
                rebuild, args = reduce_tensor(t)
            except RuntimeError as e:  # (out of memory included)
                raise ConfigError(field, f"cannot share {nbytes} bytes of {device} with CUDA IPC ({what}): "
                                  f"{e}"[:500]) from None
            return cls(t, {"kind": "cuda", "nbytes": nbytes, "rebuild": rebuild.__name__,
                           "args": [_encode(a) for a in args], "gpu": _gpu_uuid(t.device.index)})
        # A tmpfs file must fit the free space: writing past it would kill the process (SIGBUS).
        room = [d for d in _dirs() if _free(d) >= nbytes]
        if not room:
            raise ConfigError(field, f"{nbytes} bytes do not fit the free space of {' or '.join(_dirs())} ({what})")
        fd, path = tempfile.mkstemp(prefix=PREFIX, dir=room[0])  # (mode 0600: this user's processes only)
        try:  # (every page reserved now: a tmpfs that fills later cannot fault a write into it)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise ConfigError(field, f"cannot reserve {nbytes} bytes in {room[0]} ({what}): {e.strerror}") from None
        os.close(fd)
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return cls(t, {"kind": "file", "path": path, "nbytes": nbytes}, path)

    @classmethod
    def open(cls, handle: dict) -> SharedBuffer:
        """The consumer's view of the producer's buffer. Raises ValueError, OSError or
        RuntimeError when it cannot be opened here."""
        kind, nbytes = handle.get("kind"), handle.get("nbytes")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"bad KV buffer size {nbytes!r}")
        if kind == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor
            if handle.get("rebuild") != rebuild_cuda_tensor.__name__ or not isinstance(handle.get("args"), list):
                raise ValueError("the producer's torch shares CUDA memory differently (run the same torch)")
            if not torch.cuda.is_available():
                raise RuntimeError("the producer's KV buffer is CUDA memory and this process has no CUDA")
            args = [_decode(a) for a in handle["args"]]
            if len(args) != 15 or not isinstance(args[6], int):
                raise ValueError("the producer's torch shares CUDA memory differently (run the same torch)")
            if handle.get("gpu"):  # the producer's device index may name another GPU here
                here = [i for i in range(torch.cuda.device_count()) if _gpu_uuid(i) == handle["gpu"]]
                if not here:
                    raise RuntimeError(f"the producer's GPU {handle['gpu']} is not visible to this process "
                                       "(CUDA_VISIBLE_DEVICES)")
                args[6] = here[0]
            t = rebuild_cuda_tensor(*args)
        elif kind == "file":
            path = handle.get("path")
            if (not isinstance(path, str) or not os.path.basename(path).startswith(PREFIX)
                    or os.path.dirname(os.path.realpath(path)) not in {os.path.realpath(d) for d in _dirs()}):
                raise ValueError(f"bad KV buffer path {str(path)[:200]!r}")
            if os.path.getsize(path) != nbytes:
                raise ValueError(f"{path} is not {nbytes} bytes")
            t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        else:
            raise ValueError(f"unknown KV buffer kind {str(kind)[:50]!r}")
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != nbytes:
            raise ValueError(f"the KV buffer opened as {t.dtype} {tuple(t.shape)}, not {nbytes} bytes")
        return cls(t, handle)

    def unlink(self) -> None:
        """Remove the host buffer's name (both mappings stay): called once the consumer opened it
        or failed to."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def _gpu_uuid(index: int) -> str | None:
    """The GPU's UUID (one physical device whatever CUDA_VISIBLE_DEVICES numbers it), if torch
    tells it."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else None


def _free(d: str) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize
