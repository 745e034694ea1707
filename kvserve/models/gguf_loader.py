"""GGUF files (llama.cpp): architecture from the metadata; the decoder's projections kept in their
block format where a kernel reads it (``pack_projections``), every other tensor dequantized with
``gguf``."""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.models.arch import ModelArch

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# Gemma 3's four norms per layer: llama.cpp names the one before the MLP "ffn_norm".
_GEMMA3_NAMES = {**_LAYER_NAMES, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# GGUF tensor (after "blk.N.") -> (our merged projection, its part); llama.cpp keeps q/k/v and
# gate/up apart, our layers hold them as one matrix each (their rows stacked in this order).
_PROJECTIONS = {"attn_q.weight": ("self_attn.qkv_proj", 0), "attn_k.weight": ("self_attn.qkv_proj", 1),
                "attn_v.weight": ("self_attn.qkv_proj", 2), "attn_output.weight": ("self_attn.o_proj", 0),
                "ffn_gate.weight": ("mlp.gate_up_proj", 0), "ffn_up.weight": ("mlp.gate_up_proj", 1),
                "ffn_down.weight": ("mlp.down_proj", 0)}
_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "gemma3": "Gemma3ForCausalLM"}


# Parsed headers by (real path, size, mtime): an engine reads its model's header several times
# while it starts (the source, the weights, the default KV scales; again on a level-2 wake), and
# parsing it (tens of thousands of vocabulary strings through numpy memmaps) costs seconds of
# CPU. Readers are only read from; a file rewritten in place has another size or mtime and is
# parsed again; a failed parse is not kept. The two most recent files stay (a target and a draft).
_READERS: dict[tuple, object] = {}
_READERS_KEPT = 2


@functools.cache
def _reader_class():
    from gguf.gguf_reader import GGUFReader

    class Reader(GGUFReader):
        """``gguf.GGUFReader`` over the file's bytes as a plain ndarray rather than the
        ``np.memmap`` it opens: memmap's slicing runs Python code (``__getitem__``,
        ``__array_finalize__``) on each of the million-odd small reads that parse a large
        vocabulary, and again on every row group of a tensor's dequantization. The plain
        view's base is the memmap, which keeps the mapping open; read-only as before. A large
        vocabulary's header parses in under half the time (BENCHMARKS.md, GGUF headers)."""

        @property
        def data(self):
            return self._bytes

        @data.setter
        def data(self, value):
            self._bytes = value.view(np.ndarray)
    return Reader


def open_reader(path: str):
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e.strerror})") from None
    reader = _READERS.pop(key, None)
    if reader is None:
        try:
            reader = _reader_class()(path)
        except Exception as e:  # the reader raises ValueError, IndexError, struct.error... on bad files
            raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    _READERS[key] = reader  # most recent last
    while len(_READERS) > _READERS_KEPT:
        del _READERS[next(iter(_READERS))]
    return reader


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_arch(r, path: str) -> ModelArch:
    arch = _field(r, "general.architecture")
    if arch not in _FAMILIES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(_FAMILIES)}")

    def req(key):
        v = _field(r, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    heads = req("attention.head_count")
    hidden = req("embedding_length")
    names = {t.name for t in r.tensors}
    tokens = r.fields.get("tokenizer.ggml.tokens")
    vocab = _field(r, f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise ModelLoadError(f"{path}: GGUF metadata has no vocabulary size")
    scaling = None
    if _field(r, f"{arch}.rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": _field(r, f"{arch}.rope.scaling.type"),
                   "factor": _field(r, f"{arch}.rope.scaling.factor")}
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": [_FAMILIES[arch]], "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": req("feed_forward_length"), "num_hidden_layers": req("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": _field(r, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(r, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(r, f"{arch}.rope.freq_base", 10000.0)), "rope_scaling": scaling,
        "max_position_embeddings": req("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    if arch == "gemma3":
        # What llama.cpp's Gemma 3 assumes beyond the metadata: every sixth layer global, the
        # local layers' RoPE base 10k, q scaled by the head size (by hidden / heads in the
        # 62-layer 27B), and no layer pattern or scalar stored in the file.
        cfg["sliding_window"] = req("attention.sliding_window")
        cfg["sliding_window_pattern"] = 6
        cfg["rope_local_base_freq"] = 10_000.0
        cfg["query_pre_attn_scalar"] = hidden // heads if cfg["num_hidden_layers"] == 62 else cfg["head_dim"]
        # The instruction-tuned models end a turn with <end_of_turn>, which the metadata's one
        # eos id does not name: llama.cpp stops on it too, found by its text.
        eot = _token_id(tokens, b"<end_of_turn>")
        if eot is not None:
            cfg["eos_token_id"] = [i for i in (cfg["eos_token_id"], eot) if i is not None]
    return ModelArch.from_hf_config(cfg, path)


def _token_id(tokens, text: bytes) -> int | None:
    """The id of the token spelled ``text`` in a ``tokenizer.ggml.tokens`` field (None: absent)."""
    if tokens is None:
        return None
    for i, part in enumerate(tokens.data):
        if bytes(tokens.parts[part]) == text:
            return i
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves in attn_q / attn_k rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def pack_projections(model: torch.nn.Module, r, path: str, arch: ModelArch,
                     int4_only: bool = False) -> frozenset[str]:
    """Replace each decoder projection whose GGUF parts are all of block formats with a kernel
    (``layers/gguf_blocks.py``) by a ``QuantLinear`` holding those blocks, repacked on the
    model's device (parts of different types, llama.cpp's mixes such as Q4_K q/k with a Q6_K v,
    into one layout that holds them all); returns the GGUF tensors taken. A projection with a
    part of another type keeps its float weight; so does one with an 8-bit part if
    ``int4_only`` (the CPU's group-wise int8 path dequantizes tiles at every product)."""
    from kvserve.layers.gguf_blocks import FORMATS
    from kvserve.layers.quant_linear import QuantLinear
    parts: dict[str, dict[int, object]] = {}
    for t in r.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest in _PROJECTIONS:
                module, part = _PROJECTIONS[rest]
                parts.setdefault(f"layers.{layer}.{module}", {})[part] = t
    taken: set[str] = set()
    for module, ts in parts.items():
        types = {t.tensor_type.name for t in ts.values()}
        n_parts = 3 if module.endswith("qkv_proj") else 2 if module.endswith("gate_up_proj") else 1
        if not types <= set(FORMATS) or sorted(ts) != list(range(n_parts)):
            continue
        if int4_only and any(FORMATS[t][2] != "int4" for t in types):
            continue
        old = model.get_submodule(module)
        rows = []
        for _, t in sorted(ts.items()):
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8)).to(old.weight.device)
            if arch.family == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                # rows are whole blocks: llama.cpp's RoPE permutation is undone on the packed rows
                raw = _unpermute(raw, arch.num_heads if t.name.endswith("attn_q.weight") else arch.num_kv_heads)
            rows.append(raw)
        K = int(ts[0].shape[0])
        n_rows = sum(r.shape[0] for r in rows)
        if (n_rows, K) != (old.out_features, old.in_features):
            raise ModelLoadError(f"{path}: {module} is [{n_rows}, {K}] in the file, expected "
                                 f"[{old.out_features}, {old.in_features}]")
        try:
            qtypes = [t.tensor_type.name for _, t in sorted(ts.items())]
            new = QuantLinear.from_gguf_parts(list(zip(qtypes, rows)), K, old.bias)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {module}: {e}") from None
        parent, _, attr = module.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
        taken |= {t.name for t in ts.values()}
    return frozenset(taken)


def iter_weights(r, path: str, arch: ModelArch, skip: frozenset[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) of every tensor but those in ``skip``, with Hugging
    Face's values: llama.cpp stores Gemma's norm weights as ``1 + w`` (its RMSNorm multiplies by
    the weight alone)."""
    import gguf
    layer_names = _GEMMA3_NAMES if arch.family == "gemma3" else _LAYER_NAMES
    for t in r.tensors:
        if t.name in skip:
            continue
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in layer_names:
                raise ModelLoadError(f"{path}: unexpected tensor {t.name!r}")
            name = f"model.layers.{layer}.{layer_names[rest]}"
        elif t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        elif t.name.startswith("rope_"):
            continue  # precomputed rope factors: recomputed from the metadata
        else:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r}")
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {t.name!r} ({type(e).__name__}: {e})") from None
        shape = tuple(int(x) for x in reversed(t.shape))
        if data.size != int(np.prod(shape)):
            raise ModelLoadError(f"{path}: tensor {t.name!r} is truncated ({data.size} values, expected {shape})")
        w = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
        if arch.family == "llama" and rest_is(t.name, "attn_q.weight"):
            w = _unpermute(w, arch.num_heads)
        elif arch.family == "llama" and rest_is(t.name, "attn_k.weight"):
            w = _unpermute(w, arch.num_kv_heads)
        elif arch.family == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0
        yield name, w


def rest_is(name: str, suffix: str) -> bool:
    return name.startswith("blk.") and name.endswith("." + suffix)
