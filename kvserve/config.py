"""Engine configuration: frozen dataclasses, validated when built."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from kvserve.errors import ConfigError
from kvserve.kv_transfer_config import KVTransferConfig
from kvserve.speculative_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig  # noqa: F401 - re-exported

QUALITY_FLOORS = ("lossless", "int8", "int4", "eviction")  # kv_quality_floor, least lossy first

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(value: int | float | str, option: str = "size") -> int:
    """Bytes from ``4GiB``, ``512MB``, ``1e9`` or a number; a bare number below 1024 is GiB."""
    if isinstance(value, (int, float)):
        num, unit = float(value), ""
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ConfigError(option, f"cannot parse size {value!r}; use bytes or a unit, e.g. 4GiB, 512MiB")
        num, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "" and num < 1024:
        unit = "gib"  # "--kv-cache-memory 4" means 4 GiB, not 4 bytes
    nbytes = int(num * _UNITS[unit])
    if nbytes <= 0:
        raise ConfigError(option, f"must be > 0, got {value!r}")
    return nbytes


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block. None: 16, or 64 for the KIVI formats (int4/int2), whose key scales
    # are per channel per block.
    block_size: int | None = None
    # KV-cache storage (kvserve/kv_format.py): auto (the model dtype), fp8, int8, int4, int2.
    kv_cache_dtype: str = "auto"
    kv_group_size: int = 0  # channels sharing a scale; 0: the format's default
    # Calibrated fp8/int8 scales (kvserve calibrate-kv): None: the file beside the model if there
    # is one; "off": per-token scales; else a path.
    kv_scales: str | None = None
    # Bytes for the KV pool. None: on CUDA a fraction of the free memory after a profiling
    # forward, on the CPU a fixed default.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    # Pinned prefixes (engine/prefix_pins.py): at most this share of the pool held by pins (the
    # least recently used go first when over), each released after this long unused.
    max_pinned_fraction: float = 0.25
    pin_ttl_seconds: float = 3600.0
    preemption_mode: str = "recompute"  # or "swap": copy the victim's KV to CPU memory
    # Sliding-window layers (kvserve/engine/kv_groups.py): "free" gives their blocks wholly out of
    # every future query's window back to the pool; "keep" keeps every layer's KV of every token.
    window_kv: str = "free"
    # "streaming": a request with a ``kv_budget`` keeps its first block (attention sinks) and its
    # most recent blocks and gives the blocks between back to the pool (StreamingLLM); "snapkv",
    # "h2o": it keeps its recent blocks and the blocks attention scores highest
    # (``kv_eviction.py``); "none".
    kv_eviction: str = "none"
    # "auto": the engine picks the KV format and window freeing from the model and the pool
    # (``engine/kv_policy.py``); "manual": as set here.
    kv_policy: str = "manual"
    # The lossiest lever ``kv_policy`` "auto" may use: "lossless" (the model dtype; window freeing
    # and tiers are exact), "int8", "int4", or "eviction" (then also a KV budget for a request
    # that would not fit its share of the pool).
    kv_quality_floor: str = "int4"
    swap_space: int = 4 * 2**30  # bytes of CPU memory for swapped-out KV
    # Fraction of the pool kept free when admitting new requests, so running ones can grow.
    watermark: float = 0.01
    cpu_default_kv_memory: int = 2 * 2**30
    # Tiers under the GPU (kvserve/kvtier): each on or off by itself.
    cpu_kv_memory: int = 0  # bytes of (pinned) CPU memory for KV blocks leaving the GPU; 0 = off
    disk_kv_dir: str | None = None  # a directory for KV chunks; survives restarts
    disk_kv_size: int = 16 * 2**30
    redis_url: str | None = None  # redis://host:port/db, shared by several kvserve processes
    idle_offload_seconds: float = 30.0  # a session idle this long leaves the GPU
    max_sessions: int = 4096  # sessions tracked at once; past it the least recently used is forgotten
    session_ttl_seconds: float = 3600.0  # a session unused this long is forgotten
    # Authenticates the disk/Redis chunks (kvserve/kvtier/secret.py); None: KVSERVE_KV_TIER_SECRET,
    # else one generated once in kvserve's state directory. Kept out of the repr.
    kv_tier_secret: str | None = field(default=None, repr=False)
    kv_tier_encrypt: bool = False  # AES-256-GCM on the disk/Redis chunks

    @property
    def tiers_enabled(self) -> bool:
        return bool(self.cpu_kv_memory or self.disk_kv_dir or self.redis_url)

    def __post_init__(self):
        from kvserve.kv_format import KV_DTYPES, default_block_size
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {', '.join(KV_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.kv_group_size < 0:
            raise ConfigError("kv_group_size", f"must be >= 0 (0: the format's default), got {self.kv_group_size}")
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.kv_cache_dtype))
        if self.window_kv not in ("free", "keep"):
            raise ConfigError("window_kv", f"must be 'free' or 'keep', got {self.window_kv!r}")
        if self.kv_eviction not in ("none", "streaming", "snapkv", "h2o"):
            raise ConfigError("kv_eviction", f"must be one of none, streaming, snapkv, h2o; got {self.kv_eviction!r}")
        if self.kv_policy not in ("manual", "auto"):
            raise ConfigError("kv_policy", f"must be 'manual' or 'auto', got {self.kv_policy!r}")
        if self.kv_quality_floor not in QUALITY_FLOORS:
            raise ConfigError("kv_quality_floor", f"must be one of {', '.join(QUALITY_FLOORS)}; "
                              f"got {self.kv_quality_floor!r}")
        if self.kv_quality_floor != "int4" and self.kv_policy != "auto":
            raise ConfigError("kv_quality_floor", f"bounds what kv_policy 'auto' chooses; kv_policy is "
                              f"{self.kv_policy!r} (got kv_quality_floor {self.kv_quality_floor!r})")
        if self.kv_eviction != "none":
            for name, off, why in (("kv_cache_dtype", self.kv_cache_dtype == "auto", "the model dtype ('auto')"),
                                   ("preemption_mode", self.preemption_mode == "recompute", "'recompute'"),
                                   ("cpu_kv_memory", not self.tiers_enabled, "no KV tiers")):
                if not off:
                    raise ConfigError(name, f"kv_eviction {self.kv_eviction!r} needs {why}; "
                                      f"got {getattr(self, name)!r}")
        if self.kv_cache_dtype in ("int4", "int2") and self.preemption_mode == "swap":
            raise ConfigError("preemption_mode", f"'swap' is not supported with kv_cache_dtype "
                              f"{self.kv_cache_dtype} (a sequence's unsealed keys live outside its blocks); "
                              f"use 'recompute'")
        if self.cpu_kv_memory < 0:
            raise ConfigError("cpu_kv_memory", f"must be >= 0 bytes, got {self.cpu_kv_memory}")
        if self.disk_kv_dir is not None and self.disk_kv_size <= 0:
            raise ConfigError("disk_kv_size", f"must be > 0 bytes, got {self.disk_kv_size}")
        if self.redis_url is not None and not re.match(r"^(rediss?|unix)://\S+$", self.redis_url):
            raise ConfigError("redis_url", f"must look like redis://host:port[/db], rediss://… or unix://path; "
                              f"got {self.redis_url!r}")
        if self.kv_tier_secret is not None and (not isinstance(self.kv_tier_secret, str)
                                                or len(self.kv_tier_secret) < 16):
            raise ConfigError("kv_tier_secret", "must be a string of at least 16 characters")
        if not isinstance(self.kv_tier_encrypt, bool):
            raise ConfigError("kv_tier_encrypt", f"must be True or False, got {self.kv_tier_encrypt!r}")
        if not self.idle_offload_seconds > 0:
            raise ConfigError("idle_offload_seconds", f"must be > 0, got {self.idle_offload_seconds}")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions", f"must be >= 1, got {self.max_sessions}")
        if not self.session_ttl_seconds > 0:
            raise ConfigError("session_ttl_seconds", f"must be > 0, got {self.session_ttl_seconds}")
        if not 0.0 <= self.max_pinned_fraction <= 0.9:
            raise ConfigError("max_pinned_fraction", f"must be in [0, 0.9], got {self.max_pinned_fraction}")
        if not 0.0 < self.pin_ttl_seconds < float("inf"):
            raise ConfigError("pin_ttl_seconds", f"must be > 0 and finite, got {self.pin_ttl_seconds}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError("block_size", f"must be a power of two in [1, 256], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory", f"must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError("preemption_mode", f"must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ConfigError("swap_space", f"must be >= 0 bytes, got {self.swap_space}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError("watermark", f"must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # Token budget of one step: prompt chunks and decode tokens together.
    max_num_batched_tokens: int = 2048
    # None: the model's context length.
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    # Room admission keeps for the tokens running requests may still generate, as a fraction of
    # what each may generate (counted up to ``scheduler.RESERVE_TOKENS_CAP`` a request): 0 admits on
    # the prompt's room alone and preempts the newest when the pool runs dry (vLLM's rule); 1
    # admits only what can finish unpreempted (TensorRT-LLM's guaranteed-no-evict; speculative
    # drafts and requests with more than the cap left aside); None: the fraction finished
    # requests generated, learned as they finish, starting from 1. Admission stays first come,
    # first served: a request whose room is not there holds the queue behind it.
    decode_reserve: float | None = None

    def __post_init__(self):
        r = self.decode_reserve
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1):
            raise ConfigError("decode_reserve", f"must be a number in [0, 1] or None (learned); got {r!r}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len", f"must be >= 1, got {self.max_model_len}")


# Rows of x the skinny-GEMM kernel takes at most (kernels/gemv.py: MAX_ROWS)
_GEMV_MAX_ROWS = 32
# Rows of x the quantized skinny kernel takes at most (kernels/wq_gemm.py: MAX_SKINNY_ROWS)
_WQ_SKINNY_MAX_ROWS = 32


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choices of the CUDA path, and one of the CPU's. The defaults are the fastest
    measured (on an H200 for CUDA); the others exist to measure against them (the benchmarks'
    A/B) and to rule a kernel out. The attention backend holds it and passes each choice to the
    launchers as an argument."""
    # Programmatic dependent launch (Hopper and later): a kernel may start while the one before it
    # in the stream finishes, and waits for its inputs inside.
    pdl: bool = True
    # Decode steps: the attention kernel does the step's RoPE + KV write itself (uncompressed
    # caches, and KIVI int4 layers of the Gluon kernel); False: a separate write kernel first.
    fused_rope_decode: bool = True
    # KIVI int4 caches with heads of 128 decode through the Gluon kernel (kernels/kivi_decode.py);
    # False: through the Triton kernel that serves every format.
    kivi_gluon: bool = True
    # Rows of x up to which a product takes the skinny-GEMM kernel instead of cuBLAS (0: never):
    # the linear layers, the fused gate/up + SiLU, the logits.
    gemv_max_rows_linear: int = 1
    gemv_max_rows_gate_up: int = 32
    gemv_max_rows_logits: int = 16
    # The Gluon int4 decode kernel: 64-key tiles each program asks into L2 ahead of its loads
    # (0: none), and programs per SM in its one wave.
    kivi_l2_ahead: int = 2
    kivi_wave: int = 8
    # Steps where every sequence brings a few tokens after cached context (speculative verify
    # steps) run as decode steps of one row per token (``kvserve/engine/decode_rows.py``):
    # "graphs" where a captured CUDA graph holds the rows, else through the prefill path;
    # "always" eagerly too; "never" always through the prefill path.
    decode_rows: str = "graphs"
    # Weight-only quantized products (layers/quant_linear.py): up to ``wq_skinny_max_rows`` rows
    # the skinny kernel, from ``wq_dequant_min_rows`` on dequantize-then-cuBLAS, the tiled GEMM
    # with in-register dequantization between. int4 in groups of 128 or more skips the tiled GEMM,
    # which its unpacking makes the slowest there: the skinny kernel up to
    # ``wq_int4_skinny_max_rows`` rows, then the weight-left GEMM (one H100, offline at 48 requests,
    # before K was split: int4 0.70x bf16 this way, 0.57x through the tiled GEMM; int8 faster with
    # the tiled GEMM between, 0.75x against 0.70x).
    wq_skinny_max_rows: int = 16
    wq_dequant_min_rows: int = 64
    wq_int4_skinny_max_rows: int = 32
    # From ``wq_dequant_min_rows`` up to ``wq_weight_left_max_rows`` rows (0: none) the GEMM that
    # decodes the weight into the tensor cores' left operand (kernels/wq_gemm.py: ``wq_mm_wx``)
    # instead, which reads the packed weight only; dequantize-then-cuBLAS above, where the two
    # meet on an H100 (int8 at 512 rows, int4 at 256; BENCHMARKS.md, the large-batch tax).
    wq_weight_left_max_rows: int = 256
    # From ``wq_s8_min_rows`` (0: never) up to ``wq_s8_max_rows`` rows of x, int8 per-channel
    # products run on the integer tensor cores with x split into two int8 halves
    # (kernels/wq_s8.py) in place of the products above: alone, each product beat the others
    # from 64 to 512 rows, and int8 offline gained 4% at 256 requests and 2% at 1,024 (one
    # H100, BENCHMARKS.md).
    wq_s8_min_rows: int = 64
    wq_s8_max_rows: int = 512
    # One-row products of a quantized [gate | up] weight apply the MLP's SiLU-and-multiply in the
    # one-row kernel (kernels/wq_gemv.py: a launch a layer fewer); False: a kernel of its own
    # after the product.
    wq_fused_silu: bool = True
    # The few-row and weight-left products split K over several programs where their tiles
    # alone leave most multiprocessors idle (kernels/wq_gemm.py: ``split_k``); False: never.
    wq_split_k: bool = True
    # CPU: float32 projections (and bfloat16 ones where the CPU multiplies bfloat16 natively) run
    # in oneDNN on weights packed once at load (layers/linear.py); False: F.linear on the dense weights.
    cpu_packed_weights: bool = True
    # CPU: one-token steps (one sequence decoding) run the model compiled by torch.compile
    # (inductor fuses the norms, residuals, RoPE and activations between the products), compiled
    # at start-up (engine/cpu_compile.py); larger steps stay eager. None (the default): wherever
    # it applies (quantized projections, the torch attention backend, neither sleep mode nor
    # tensor parallelism, not enforce_eager, KVSERVE_CPU_COMPILE not 0), eagerly elsewhere; True:
    # insisted on (settings it cannot work with are refused, a float model says why it runs
    # eagerly); False: never.
    cpu_compile: bool | None = None

    def __post_init__(self):
        if self.decode_rows not in ("graphs", "always", "never"):
            raise ConfigError("decode_rows", f"must be one of graphs, always, never; got {self.decode_rows!r}")
        for name in ("pdl", "fused_rope_decode", "kivi_gluon", "wq_fused_silu", "wq_split_k", "cpu_packed_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be True or False, got {getattr(self, name)!r}")
        if self.cpu_compile is not None and not isinstance(self.cpu_compile, bool):
            raise ConfigError("cpu_compile", f"must be True, False or None, got {self.cpu_compile!r}")
        for name, lo, hi in (("gemv_max_rows_linear", 0, _GEMV_MAX_ROWS), ("gemv_max_rows_gate_up", 0, _GEMV_MAX_ROWS),
                             ("gemv_max_rows_logits", 0, _GEMV_MAX_ROWS), ("kivi_l2_ahead", 0, None),
                             ("kivi_wave", 1, None), ("wq_skinny_max_rows", 0, _WQ_SKINNY_MAX_ROWS),
                             ("wq_int4_skinny_max_rows", 0, _WQ_SKINNY_MAX_ROWS),
                             ("wq_dequant_min_rows", 1, None), ("wq_weight_left_max_rows", 0, None),
                             ("wq_s8_min_rows", 0, None), ("wq_s8_max_rows", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ConfigError(name, f"must be an integer {bound}, got {v!r}")
        if 0 < self.wq_s8_max_rows < self.wq_s8_min_rows:  # (min 0: off, whatever the max)
            raise ConfigError("wq_s8_min_rows", f"must be at most wq_s8_max_rows ({self.wq_s8_max_rows}), got "
                              f"{self.wq_s8_min_rows}: no product would take the integer tensor cores (set "
                              f"wq_s8_min_rows lower, or 0 to turn them off)")

    def gemv_max_rows(self, kind: str) -> int:
        """The row limit of a product of ``kind``: "linear", "gate_up_silu" or "logits"."""
        return {"linear": self.gemv_max_rows_linear, "gate_up_silu": self.gemv_max_rows_gate_up,
                "logits": self.gemv_max_rows_logits}[kind]


CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors")  # a checkpoint's own packed weights
QUANT_METHODS = ("int8", "int4", "fp8", *CHECKPOINT_METHODS, "gguf", "none")
INT4_GROUP_SIZES = (32, 64, 128)
HEAD_FORMATS = ("none", "int8")  # QuantConfig.head


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization of the decoder's linear layers at load, by round-to-nearest
    (formats: kvserve/layers/rtn.py). int8: symmetric, one scale per output channel; int4:
    asymmetric (a scale and a minimum) per ``group_size`` input columns, two codes a byte.
    fp8: W8A8, e4m3 weights per output channel, activations per token (layers/fp8_linear.py).
    awq, gptq, compressed-tensors: such a 4-bit checkpoint's own weights, repacked
    (models/awq_gptq.py; ``kvserve quantize`` writes compressed-tensors).
    gguf: a GGUF's blocks kept packed; none: float weights. Without a QuantConfig a GGUF keeps its
    blocks on CUDA and is dequantized on the CPU, where float GEMMs outrun the packed ones.

    ``head``: the output head's weights under the methods that quantize at load (int8, int4,
    fp8): "none" (the model's dtype) or "int8" (one scale per vocabulary row; a head tied to the
    embedding gets its own int8 copy). A batch-1 step on a GPU reads the head's bytes every token
    as it reads the layers' (the head is Llama-3-8B's largest matrix), so an int8 head cuts them;
    its rounding costs a little perplexity and moves near-tied top-1 tokens (BENCHMARKS.md), and
    on the CPU PyTorch's int8 product is slower than oneDNN's float one: off by default."""
    method: str
    group_size: int | None = None  # int4 only; None: 128
    head: str = "none"

    def __post_init__(self):
        if not isinstance(self.method, str) or self.method not in QUANT_METHODS:
            raise ConfigError("quantization", f"must be one of {', '.join(QUANT_METHODS)} or None; got {self.method!r}")
        if not isinstance(self.head, str) or self.head not in HEAD_FORMATS:
            raise ConfigError("quantization_head", f"must be one of {', '.join(HEAD_FORMATS)}; got {self.head!r}")
        if self.head != "none" and self.method not in ("int8", "int4", "fp8"):
            raise ConfigError("quantization_head", f"applies to the formats quantized at load (int8, int4, fp8); "
                              f"{self.method} keeps the head as the model has it")
        g = self.group_size
        if self.method in ("int8", "fp8", *CHECKPOINT_METHODS, "gguf", "none"):
            if g is not None:
                raise ConfigError("quantization_group_size", f"{self.method} takes no group size; "
                                  "a group size applies to int4 only")
            return
        if g is None:
            object.__setattr__(self, "group_size", 128)
        elif isinstance(g, bool) or not isinstance(g, int) or g not in INT4_GROUP_SIZES:
            raise ConfigError("quantization_group_size",
                              f"must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; got {g!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    tokenizer: str | None = None  # None: from the model (GGUF metadata or HF directory)
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bfloat16, else float32
    device: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)  # CUDA kernel choices
    show_progress: bool = True
    # auto: Triton kernels on CUDA, the PyTorch reference elsewhere.
    attention_backend: str = "auto"
    # CUDA graphs for decode steps of up to this many rows (None: max_num_seqs, or with
    # speculative decoding the tokens of its largest verify step if more, capped at 512);
    # enforce_eager turns them off.
    enforce_eager: bool = False
    cuda_graph_max_batch: int | None = None
    # When the graphs are captured (engine/graph_capture.py): startup (all before serving), lazy
    # (each at its batch size's first use), background (lazy, and the rest in idle gaps). startup:
    # a lazy size's first eager step also pays its kernels' compilation, which startup pays early.
    cuda_graph_capture: str = "startup"
    # Schedule and launch each step before the previous step's tokens reach the host, so the
    # host's bookkeeping overlaps the device (see LLMEngine.step). None: on for CUDA (same tokens
    # as synchronous on an H200), off on the CPU, whose steps compute before they return.
    async_scheduling: bool | None = None
    speculative: SpeculativeConfig | None = None  # speculative decoding, off by default
    # LLM.sleep / wake_up (engine/sleep_mode.py): the GPU memory of an idle engine is given back.
    enable_sleep_mode: bool = False
    quantization: QuantConfig | None = None  # weight-only quantization at load, off by default
    # Ranks (processes, one GPU each on CUDA) each layer is split across (engine/tp_workers.py).
    tensor_parallel_size: int = 1
    # Disaggregated prefill/decode: this instance's side of the KV hand-over; None: off.
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self):
        spec = self.speculative
        if isinstance(self.model, os.PathLike):  # (a pathlib.Path, as a string from here on)
            object.__setattr__(self, "model", os.fspath(self.model))
        if not isinstance(self.kernel, KernelConfig):
            raise ConfigError("kernel", f"must be a KernelConfig, got {type(self.kernel).__name__}")
        if self.quantization is not None and not isinstance(self.quantization, QuantConfig):
            raise ConfigError("quantization", f"must be a QuantConfig or None (LLM takes the method's name), "
                              f"got {self.quantization!r}"[:200])
        self._check_tensor_parallel()
        if spec is not None:
            # Combinations whose output speculation would change or that it cannot roll back.
            if self.cache.kv_cache_dtype != "auto":
                raise ConfigError("kv_cache_dtype", f"{self.cache.kv_cache_dtype!r} is not supported with "
                                  "speculative decoding (rejected drafts cannot be rolled out of its scales); use auto")
            if self.cache.preemption_mode == "swap":
                raise ConfigError("preemption_mode",
                                  "'swap' is not supported with speculative decoding; use 'recompute'")
            if self.cache.tiers_enabled:
                raise ConfigError("cpu_kv_memory/disk_kv_dir/redis_url",
                                  "the KV tiers are not supported with speculative decoding")
        ev = self.cache.kv_eviction
        if ev != "none":
            if spec is not None:
                raise ConfigError("kv_eviction", f"{ev!r} is not supported with speculative decoding")
            if ev != "streaming" and self.attention_backend == "triton":
                raise ConfigError("kv_eviction", f"{ev!r} runs on the torch attention backend (it ranks blocks "
                                  "by attention scores, which the Triton kernels do not compute); use "
                                  "attention_backend torch or auto")
            if ev != "streaming" and self.async_scheduling:
                raise ConfigError("async_scheduling", f"is not supported with kv_eviction {ev!r} (a step's "
                                  "evictions need the previous step's attention scores); leave it unset")
        kt = self.kv_transfer_config
        if kt is not None:
            if kt.kv_connector == "KVTierConnector" and not (self.cache.disk_kv_dir or self.cache.redis_url):
                raise ConfigError("kv_transfer_config.kv_connector", "KVTierConnector hands KV over through the "
                                  "disk or Redis tier: set disk_kv_dir or redis_url on both instances")
            if spec is not None:
                raise ConfigError("kv_transfer_config", "is not supported with speculative decoding")
            if not self.cache.enable_prefix_caching:
                raise ConfigError("kv_transfer_config", "needs prefix caching (blocks are handed over by hash)")
            if kt.kv_connector == "CudaIpcConnector" and kt.is_producer and self.enable_sleep_mode is True:
                raise ConfigError("enable_sleep_mode", "is not supported on a CudaIpcConnector producer: its "
                                  "consumer maps the KV pool, which sleep would free")
        if not isinstance(self.enable_sleep_mode, bool):
            raise ConfigError("enable_sleep_mode", f"must be True or False, got {self.enable_sleep_mode!r}")
        if self.enable_sleep_mode and spec is not None and spec.method != "ngram":
            raise ConfigError("enable_sleep_mode", f"is not supported with speculative method {spec.method!r} "
                              "(the draft's weights or KV would stay on the GPU); use ngram or no speculative "
                              "decoding")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError("attention_backend",
                              f"must be one of auto, torch, triton; got {self.attention_backend!r}")
        if self.cuda_graph_max_batch is not None and not 1 <= self.cuda_graph_max_batch <= 1024:
            raise ConfigError("cuda_graph_max_batch", f"must be in [1, 1024], got {self.cuda_graph_max_batch}")
        if self.cuda_graph_capture not in ("startup", "lazy", "background"):
            raise ConfigError("cuda_graph_capture", f"must be one of startup, lazy, background; "
                              f"got {self.cuda_graph_capture!r:.50}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError("dtype", f"must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")

    def _check_tensor_parallel(self) -> None:
        """The size's range, and the options whose state lives outside the ranks' lockstep
        (a draft model, the tiers' copies, sleep's weights, tokens patched in on the device)."""
        n = self.tensor_parallel_size
        if type(n) is not int or not 1 <= n <= 64:
            raise ConfigError("tensor_parallel_size", f"must be an integer in [1, 64], got {n!r:.100}")
        if n == 1:
            return
        for option, on in (("speculative_config", self.speculative is not None),
                           ("enable_sleep_mode", self.enable_sleep_mode is True),
                           ("async_scheduling", self.async_scheduling is True),
                           ("cpu_kv_memory/disk_kv_dir/redis_url", self.cache.tiers_enabled),
                           ("kv_transfer_config", self.kv_transfer_config is not None),
                           ("quantization", self.quantization is not None and self.quantization.method == "fp8"),
                           # attention scores would be each rank's heads only
                           ("kv_eviction", self.cache.kv_eviction in ("snapkv", "h2o"))):
            if on:
                raise ConfigError(option, f"is not supported with tensor_parallel_size {n}; leave it unset")
        # A graph captured between steps would be captured on rank 0 alone, while the workers'
        # graphs are captured when their KV is allocated: with several ranks, all at start-up.
        object.__setattr__(self, "cuda_graph_capture", "startup")
