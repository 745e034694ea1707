"""Where and in what dtype the model runs, and the device time of its steps."""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA where there is a GPU, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``;
    anything else, or CUDA where there is none, a ConfigError naming ``device``."""
    from kvserve import envs
    from kvserve.errors import ConfigError
    name = envs.get(envs.KVSERVE_DEVICE) or name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name) if isinstance(name, (str, torch.device)) else None
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N; got {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{name!r}: CUDA is not available here (no GPU, or a CPU build of PyTorch)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError("device", f"{name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def auto_dtype(device: torch.device) -> torch.dtype:
    """What ``dtype="auto"`` runs in: bfloat16 on CUDA and on a CPU that multiplies it natively
    (half the bytes of every weight and KV block read per step: about twice float32's decode
    speed, at +0.2% perplexity on the default model), float32 on other CPUs, where bfloat16 is
    emulated at several times float32's cost. ``KVSERVE_CPU_DTYPE`` overrides the CPU's choice."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu":
        return torch.float32
    from kvserve import envs
    from kvserve.errors import ConfigError
    from kvserve.layers.linear import cpu_bf16_native
    name = envs.get(envs.KVSERVE_CPU_DTYPE) or "auto"
    if name == "auto":
        return torch.bfloat16 if cpu_bf16_native() else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ConfigError(envs.KVSERVE_CPU_DTYPE, f"must be auto, float32 or bfloat16; got {name!r}")
    return DTYPES[name]


def choose_attention_backend(requested: str, device_type: str, kv_eviction: str,
                             has_triton: Callable[[], bool]) -> str:
    """The attention backend for ``attention_backend=requested``: "auto" is Triton on CUDA when
    Triton is installed, with no KV eviction or streaming eviction (its kernels skip the evicted
    span), and the PyTorch path otherwise: on the CPU, and for SnapKV and H2O, which rank blocks
    by the attention scores only that path computes. ``has_triton`` is asked only on CUDA."""
    if requested != "auto":
        return requested
    if device_type != "cuda" or kv_eviction not in ("none", "streaming"):
        return "torch"
    return "triton" if has_triton() else "torch"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class GpuTimer:
    """Device time of each step's forward + sampling, from CUDA events (for benchmarks: set
    ``runner.gpu_timer = GpuTimer()``). ``seconds`` over the wall time says how much of a run the
    GPU was busy; the rest is host overhead the GPU waited for."""

    def __init__(self):
        self.seconds = 0.0
        self.steps = 0
        self._ev: list = []  # (start, end) per launched step, oldest first (async scheduling: two)

    def start(self):
        self._ev.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self._ev[-1][0].record()

    def stop(self):
        self._ev[-1][1].record()

    def collect(self):
        if self._ev:
            start, end = self._ev.pop(0)
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3
            self.steps += 1
