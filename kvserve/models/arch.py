"""ModelArch: the shape of a decoder-only model, read from a HF config.json dict or GGUF metadata."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.errors import ModelLoadError

# HF "architectures" / model_type -> our family name. llama.py serves the Llama-shaped families,
# gemma3.py Gemma 3.
SUPPORTED = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "Gemma3ForCausalLM": "gemma3", "gemma3_text": "gemma3",
}


@dataclass(frozen=True)
class ModelArch:
    family: str  # llama | qwen2 | qwen3 | gemma3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    # Gemma 3: each layer's attention window (None: global), the local layers' RoPE base, q
    # scaled by query_pre_attn_scalar ** -0.5, the logits' tanh softcap.
    layer_windows: tuple[int | None, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_windows)} entries for {self.num_layers} layers")
        windows = [w for w in self.layer_windows if w is not None]
        if windows and min(windows) < 1:
            raise ModelLoadError(f"sliding_window must be at least 1, got {min(windows)}")

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer = qkv + self.num_heads * self.head_dim * h + 3 * h * i + 2 * h
        return self.num_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    @property
    def projection_input_widths(self) -> tuple[int, ...]:
        """Each decoder projection's input width: qkv, o, gate/up, down (what a group size of
        quantized weights must divide)."""
        return self.hidden_size, self.num_heads * self.head_dim, self.hidden_size, self.intermediate_size

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> ModelArch:
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        family = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if family is None:
            family = SUPPORTED.get(cfg.get("model_type", ""))
        if family is None:
            raise ModelLoadError(f"{source}: unsupported architecture {archs} (model_type "
                                 f"{cfg.get('model_type')!r}); supported: "
                                 f"{sorted(set(SUPPORTED) - set(SUPPORTED.values()))}")
        try:
            if family == "gemma3":
                cfg = _gemma3_config(cfg)
            heads = cfg["num_attention_heads"]
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
            if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
                scaling = None
            eos = cfg.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            return cls(
                family=family,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=scaling,
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=family in ("qwen3", "gemma3"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos,
                sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
                **cfg.get("_gemma3", {}),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None


def _gemma3_config(cfg: dict) -> dict:
    """A Gemma 3 config in the shape the common reader takes, plus the Gemma-only fields: the layer
    pattern from ``layer_types`` or else ``sliding_window_pattern`` (every sixth layer global), the
    global layers' RoPE from ``rope_parameters["full_attention"]`` (or the flat keys older configs
    carry), the local base from ``rope_parameters["sliding_attention"]`` / ``rope_local_base_freq``."""
    if cfg.get("num_hidden_layers") is None:
        raise KeyError("num_hidden_layers")
    n = _number(cfg, "num_hidden_layers", None, int)
    types = cfg.get("layer_types")
    if types is None:
        pattern = _number(cfg, "sliding_window_pattern", 6, int)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ModelLoadError(f"layer_types must list one type per layer ({n}), got {types!r:.200}")
    unknown = {repr(t) for t in types} - {"'sliding_attention'", "'full_attention'"}
    if unknown:
        raise ModelLoadError(f"unsupported Gemma 3 layer types {sorted(unknown)}; supported: "
                             f"sliding_attention, full_attention")
    window = _number(cfg, "sliding_window", 4096, int)
    if window >= _number(cfg, "max_position_embeddings", 4096, int):
        window = None  # no key ever leaves it: the layers are global
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with bidirectional attention (an embedding model) is not supported")
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or not all(isinstance(v, dict | None) for v in rope.values()):
        raise ModelLoadError(f"rope_parameters must map layer types to RoPE settings, got {rope!r:.200}")
    full = dict(rope.get("full_attention") or {})
    local = dict(rope.get("sliding_attention") or {})
    if not full and cfg.get("rope_scaling"):
        full = dict(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local_theta = _number({"rope_local_base_freq": local.get("rope_theta", cfg.get("rope_local_base_freq"))},
                          "rope_local_base_freq", 10_000.0, float)
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"unsupported Gemma 3 local RoPE type {local.get('rope_type')!r}")
    head_dim = cfg.get("head_dim") or 256
    out = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    out.update(head_dim=head_dim, rope_theta=full.pop("rope_theta"), rope_scaling=full or None,
               tie_word_embeddings=cfg.get("tie_word_embeddings", True), use_sliding_window=False)
    out["_gemma3"] = {
        "layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
        "rope_local_theta": float(local_theta),
        "query_pre_attn_scalar": float(_number(cfg, "query_pre_attn_scalar", head_dim, float)),
        "final_logit_softcap": _number(cfg, "final_logit_softcapping", None, float),
    }
    return out


def _number(cfg: dict, key: str, default, kind: type):
    """``cfg[key]`` (``default`` when absent or null): a positive finite int (``kind`` int) or
    number (float), never a bool."""
    v = cfg.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if kind is int else isinstance(v, int | float) and math.isfinite(v)
    if isinstance(v, bool) or not ok or v <= 0:
        raise ModelLoadError(f"{key} must be a positive {'integer' if kind is int else 'number'}, got {v!r:.100}")
    return v
