"""The runner's model weights: built and loaded from the source (kept packed where a kernel
reads the checkpoint's format), quantized where configured, and rebuilt on a level-2 wake."""
from __future__ import annotations

import torch

from kvserve.config import CHECKPOINT_METHODS
from kvserve.engine import startup
from kvserve.engine.device import default_dtype
from kvserve.engine.startup import timed
from kvserve.errors import ConfigError
from kvserve.layers.linear import pack_cpu_weights
from kvserve.layers.quant_linear import quantize_model
from kvserve.models import loader, snapshot
from kvserve.progress import progress


class ModelWeights:
    """Mixed into ModelRunner: ``src``, ``config``, ``dtype``, ``device``, ``max_model_len``,
    ``tp`` and ``packed_weights`` are the runner's."""

    def _check_quantization(self) -> None:
        """The quantization option against what the checkpoint already is (AWQ, GPTQ and
        compressed-tensors load packed;
        int8, int4 and fp8 quantize only unquantized weights), each refusal naming the option."""
        config, src = self.config, self.src
        quant = config.quantization
        checkpoint = src.quant_method.lower() if src.quant_method else None
        if quant is not None and quant.method in CHECKPOINT_METHODS and checkpoint != quant.method:
            what = ("quantized as " + checkpoint if checkpoint else
                    "a GGUF file, whose blocks load with quantization gguf (or none, dequantized)"
                    if src.kind == "gguf" else "not quantized")
            raise ConfigError("quantization", f"{quant.method} loads {quant.method} checkpoints; {src.name} is "
                              f"{what} (no quantizer runs at load: int8, int4 and fp8 quantize unquantized "
                              f"weights)")
        if quant is not None and quant.method == "gguf" and (src.kind != "gguf" or self.tp is not None):
            raise ConfigError("quantization", f"gguf keeps a GGUF file's blocks packed on one rank; {src.name} is "
                              f"{'not a GGUF file' if src.kind != 'gguf' else 'split across ranks'}")
        if checkpoint is not None and self.tp is not None:
            raise ConfigError("tensor_parallel_size", f"{src.name} is a {checkpoint} checkpoint, whose packed "
                              f"weights load on one rank; use tensor_parallel_size 1")
        if quant is not None and quant.method == "none" and checkpoint is not None:
            raise ConfigError("quantization", f"none: {src.name} is a {checkpoint} checkpoint, whose weights load "
                              f"packed; leave quantization unset")
        if quant is not None and quant.method not in ("none", *CHECKPOINT_METHODS) and checkpoint is not None:
            raise ConfigError("quantization", f"{src.name} is already quantized (quantization_config: "
                              f"{src.quant_method}); only unquantized weights are quantized at load")

    def _build_and_load(self) -> torch.nn.Module:
        """The model with its weights from the source, quantized where configured; on CUDA the
        process's one-time device start-up runs beside it (``startup.warm_device``)."""
        warm = None
        if self.device.type == "cuda":
            key = (startup.in_background(self.startup_seconds, "triton_key", startup.triton_compiler_key)
                   if self.backend_name == "triton" else None)
            index = self.device.index  # the thread names the device by index (a new thread's is 0)
            device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
            warm = startup.in_background(self.startup_seconds, "device_warmup", startup.warm_device, device,
                                         self.dtype, self.arch, self.backend_name, key)
        try:
            model = self._build_and_load_model()
        except BaseException:
            if warm is not None:
                warm.exception()  # its thread has finished before the error leaves
            raise
        if warm is not None:
            warm.result()
        return model

    def _build_and_load_model(self) -> torch.nn.Module:
        with default_dtype(self.dtype), torch.device(self.device), timed(self.startup_seconds, "build"):
            model = (loader.build_model(self.src.arch, max_positions=self.max_model_len) if self.tp is None
                     else loader.build_model(self.src.arch, self.max_model_len, self.tp))
        # Checkpoint tensors kept packed (a GGUF's blocks, an AWQ/GPTQ checkpoint's int4): the
        # model's weight loading skips them. Under tensor parallelism a GGUF is dequantized at load.
        src, quant = self.src, self.config.quantization
        checkpoint = src.quant_method.lower() if src.quant_method else None
        if src.kind == "gguf" and self.tp is None and (quant is None and self._gguf_packed_by_default()
                                                       or quant is not None and quant.method == "gguf"):
            from kvserve.models import gguf_loader
            self.packed_weights = gguf_loader.pack_projections(model, src.handle, src.path, src.arch,
                                                               int4_only=quant is None and self.device.type == "cpu")
        elif src.kind == "hf" and checkpoint is not None and (quant is None or quant.method == checkpoint):
            from kvserve.models import awq_gptq
            packed = {k: t for k, t in loader.iter_weights(src) if k.endswith(awq_gptq.TENSORS)}
            self.packed_weights = awq_gptq.pack_projections(model, packed, src.quant_config or {}, src.name)
        with timed(self.startup_seconds, "weights"):
            self.load_weights(model)
            model.eval()
            if quant is not None and quant.method not in ("none", "gguf", *CHECKPOINT_METHODS):
                quantize_model(model, quant)
        return model

    def pack_for_cpu(self, model: torch.nn.Module) -> None:
        """Pack ``model``'s projections and output head for oneDNN (``layers/linear.py``) on the
        CPU unless configured off; not with sleep mode, which moves the weights by parameter name."""
        config = self.config
        if self.device.type == "cpu" and config.kernel.cpu_packed_weights and not config.enable_sleep_mode:
            pack_cpu_weights(model)

    def _gguf_packed_by_default(self) -> bool:
        """Whether a GGUF's blocks stay packed without ``quantization="gguf"``: where a kernel
        reads them faster than the dequantized weights, on CUDA and on a CPU running bfloat16
        (its 4-bit ones: PyTorch's int4 CPU kernel, a third of bfloat16's bytes). Not in float32
        on the CPU, the reference mode, where that kernel takes several times oneDNN's float32
        product."""
        return self.device.type == "cuda" or self.device.type == "cpu" and self.dtype == torch.bfloat16

    def reload_weights(self, into: dict[str, torch.Tensor]) -> None:
        """Waking from sleep level 2: the model built and loaded again as at start-up (so a GGUF
        or HF source is converted, and quantized, the same way), its parameters and buffers
        copied into ``into`` (the sleeping model's, by name), then freed. Peak device memory is
        the weights twice, with no KV pool allocated yet."""
        fresh = self._build_and_load()
        have = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
        if set(have) != set(into):
            raise RuntimeError(f"the rebuilt model's tensors differ from the sleeping model's: "
                               f"{sorted(set(have) ^ set(into))[:3]}")
        with torch.no_grad():
            for name, t in into.items():
                t.copy_(have[name])
        del fresh, have

    def load_weights(self, model: torch.nn.Module | None = None) -> None:
        """Fill ``model``'s parameters (None: the runner's) from the source."""
        model = self.model if model is None else model
        src, config = self.src, self.config
        if src.kind == "dummy":
            loader.init_dummy_weights(model, config.seed)
        elif src.kind == "snapshot":
            snapshot.load_into(model, src.path, src.handle, self.device, config.show_progress)
        else:
            weights = loader.iter_weights(src, self.packed_weights, lazy=self.tp is not None)
            if config.show_progress:
                weights = progress(True, "Loading weights", "tensor", weights, total=loader.count_weights(src))
            with torch.no_grad():
                model.load_weights(weights)

    @property
    def source_fingerprint(self) -> str:
        return loader.fingerprint(self.src, self.config.seed)
