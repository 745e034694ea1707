"""Sleep mode: an idle engine gives its device memory back and takes it again on wake (vLLM's names).

    level 1   weights -> one host copy (page-locked on CUDA, kept across cycles so a second
              sleep allocates nothing: ``HostCopy``); KV pool, CUDA graphs and their memory
              pool freed
    level 2   weights dropped; waking rebuilds them from the model's source (snapshot, HF
              directory, GGUF file or the dummy seed) as start-up did, quantization and dtype
              included (``ModelRunner.reload_weights``): no snapshot is needed
    wake_up   "weights" back into one device buffer (one host->device copy at full bandwidth),
              then "kv_cache": the pool of the same plan, zeroed, and the graphs re-armed
              (captured again as ``cuda_graph_capture`` says: ``engine/graph_capture.py``)

"Weights" are every parameter and buffer of the model: a quantized layer's packed weights and
scales are buffers, and they leave the device with the rest.

States (``asleep`` is the set of parts not on the device):
    awake: {}  --sleep-->  {"weights", "kv_cache"}  --wake_up(tags)-->  parts in tags leave the set
A failed wake leaves the part asleep, its memory freed again, so a later wake_up can retry.
While a part sleeps its parameters are empty tensors: a forward by mistake fails loudly.

On the CPU the "device" is host memory: level 1 moves the weights to a side copy and back, so
the state machine, the copies and the reload path all run in the CPU tests.
"""
from __future__ import annotations

import gc
import logging
import threading

import torch

log = logging.getLogger(__name__)

_ALIGN = 256  # bytes: each parameter's view in the flat buffers starts aligned for vector loads

PARTS = ("weights", "kv_cache")


class HostCopy:
    """The weights' host copy (level 1). On CUDA its pages are locked, so that the copies both
    ways run asynchronously at the link's rate: the memory is allocated as ordinary memory, its
    pages touched by torch's threads, then registered with the driver (``cudaHostRegister``,
    portable: every context sees it as page-locked). A pinned allocation of the same size
    (``pin_memory=True``) has the driver fault in and lock every page on one thread, several
    times slower for the gigabytes of a model. The registration ends before the memory is
    freed; where it fails (a locked-memory limit, a driver without it) the pinned allocation is
    the fallback. The driver calls run on a thread of their own: a failed call leaves its error
    in that thread's last-error slot, not in the slot of a thread that launches kernels next."""

    def __init__(self, nbytes: int, device: torch.device):
        self.registered = False
        self.tensor: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8)
        if device.type != "cuda":
            return
        self._index = index = torch.cuda.current_device() if device.index is None else device.index
        self.tensor.zero_()
        ptr = self.tensor.data_ptr()
        self.registered = _driver_call(index, lambda cudart: cudart.cudaHostRegister(ptr, nbytes, 1)) == 0
        if not self.registered:
            self.tensor = None  # before the pinned copy: never both at once
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def __del__(self):
        if self.registered:  # every copy from or to it has been synchronised (sleep and wake)
            self.registered = False
            ptr = self.tensor.data_ptr()
            try:
                err = _driver_call(self._index, lambda cudart: cudart.cudaHostUnregister(ptr))
            except Exception:  # interpreter shutdown: the driver is going, and the pages with it
                return
            if err != 0:
                log.warning("cudaHostUnregister of the sleeping weights' host copy failed (error %d)", err)


def _driver_call(device_index: int, call) -> int:
    """``call(cudart)``'s error code, the call made on a new thread with ``device_index`` current."""
    out = []

    def run():
        torch.cuda.set_device(device_index)
        out.append(int(call(torch.cuda.cudart())))
    t = threading.Thread(target=run, name="kvserve-host-register")
    t.start()
    t.join()
    if not out:
        raise RuntimeError("the driver call's thread failed")
    return out[0]


class SleepMode:
    def __init__(self, runner):
        self.runner = runner
        self.level = 0
        self.asleep: set[str] = set()
        self._host: HostCopy | None = None  # flat copy of every weight (level 1)
        # (tensor, byte offset, bytes, shape, name) of each parameter and buffer
        self._layout: list[tuple[torch.Tensor, int, int, torch.Size, str]] | None = None

    def _params_layout(self) -> tuple[list, int]:
        if self._layout is None:
            layout, off, seen = [], 0, set()
            model = self.runner.model
            for name, p in [*model.named_parameters(), *model.named_buffers()]:  # a tied weight is listed once
                if id(p) in seen:
                    continue
                seen.add(id(p))
                n = p.numel() * p.element_size()
                layout.append((p, off, n, p.shape, name))
                off += -(-n // _ALIGN) * _ALIGN
            self._layout = layout
            self._total = off
        return self._layout, self._total

    def sleep(self, level: int) -> None:
        rt = self.runner
        layout, total = self._params_layout()
        dev = rt.device
        if level == 1:
            if self._host is None:
                self._host = HostCopy(total, dev)
            host = self._host.tensor
            for p, off, n, _, _ in layout:
                host[off:off + n].copy_(p.data.reshape(-1).view(torch.uint8), non_blocking=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        else:
            self._host = None
        self._drop_weights()
        rt.release_kv_cache()
        self.level = level
        self.asleep = set(PARTS)
        self._release()

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Bring back the parts in ``tags`` (weights before the KV pool, whatever the order)."""
        rt = self.runner
        if "weights" in tags and "weights" in self.asleep:
            try:
                self._wake_weights()
            except BaseException:
                self._drop_weights()
                self._release()
                raise
            self.asleep.discard("weights")
            if "kv_cache" not in self.asleep:
                rt.prepare_device()  # the graphs were left for the weights
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            try:
                rt.restore_kv_cache()
            except BaseException:
                rt.release_kv_cache()
                self._release()
                raise
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = 0

    @property
    def weights_awake(self) -> bool:
        return "weights" not in self.asleep

    def _wake_weights(self) -> None:
        rt = self.runner
        layout, total = self._params_layout()
        flat = torch.empty(total, dtype=torch.uint8, device=rt.device)
        for p, off, n, shape, _ in layout:
            p.data = flat[off:off + n].view(p.dtype).view(shape)
        if self._host is not None:
            flat.copy_(self._host.tensor, non_blocking=True)
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
        else:
            rt.reload_weights({name: p for p, _, _, _, name in layout})

    def _drop_weights(self) -> None:
        layout, _ = self._params_layout()
        for p, _, _, _, _ in layout:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for mod in self.runner.model.modules():  # what the CPU paths keep derived from them
            drop = getattr(mod, "drop_derived", None)
            if drop is not None:
                drop()

    def _release(self) -> None:
        gc.collect()  # CUDA graphs and views found only through reference cycles
        dev = self.runner.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            # cuBLAS keeps a workspace per handle and stream in the caching allocator (tens of MiB
            # each), which empty_cache cannot return while they are referenced.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()  # back to the driver, not only to the caching allocator
