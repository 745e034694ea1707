"""The model's forward compiled for the CPU's one-token steps (``KernelConfig.cpu_compile``).

A CPU decode step is a few hundred small PyTorch ops between the weight products (norms,
residual adds, RoPE, casts, the activation), each costing microseconds of dispatch whatever its
size. torch.compile (inductor) fuses them into a few C++ loops around the products. The paged
attention stays one opaque op after RoPE (``layers/attention.attend``): it reads the step's
context when it runs. Steps of ``MAX_ROWS`` token take the compiled graph: one sequence
decoding, the CPU's common case (one user chatting); a step of several tokens is bound more by
its products, and a second graph (with the rows symbolic) would double the compile time for a
few percent. The graph is compiled at start-up, on a scratch cache, so no request waits for the
compiler (inductor keeps what it built on disk: later starts of the same model, the first
compiled in their process, take a fraction of the first's time). It takes models whose
projections are quantized (QuantLinear: a GGUF's packed blocks, int4, int8); float ones run
faster packed for oneDNN, which a graph cannot hold. Where compiling fails (no C++ compiler, an
op inductor does not take), or the model does not come out as one graph, the engine says why
and runs eagerly; so does a float model where the compiled model was asked for.

It is the default wherever it applies: on a 2-core CPU it decodes the default model a third
faster than the eager model, which is worth a start-up that takes seconds longer (tens of
seconds the first time, before inductor's cache holds the kernels), as vLLM's compiled start-up
is. ``enforce_eager``, ``KernelConfig(cpu_compile=False)`` or ``KVSERVE_CPU_COMPILE=0`` keep a
start-up short.
"""
from __future__ import annotations

import logging
import types

import torch

from kvserve import envs
from kvserve.engine.kv_cache import KVCache
from kvserve.errors import ConfigError
from kvserve.layers.attention import ForwardContext, compiled_layers, forward_context
from kvserve.layers.linear import Linear

log = logging.getLogger(__name__)

MAX_ROWS = 1


class CompiledDecode:
    """``model.forward`` compiled for steps of ``MAX_ROWS`` token, eager for larger ones."""

    def __init__(self, model: torch.nn.Module):
        self.eager = model.forward
        number = compiled_layers(model)
        # The forward as a code object of this model's own: Dynamo keeps compiled code per code
        # object, so no other model's graph (other weights, other layer keys) can answer for this
        # one, and the guards on the model's modules can go: checking every submodule and
        # parameter on each call cost about a millisecond a step (without them the default model
        # decodes 5-6% faster on a 2-core CPU). The modules do not change while the engine serves
        # (sleep mode, which frees the weights, rules the compiled model out).
        fwd = type(model).forward
        code = fwd.__code__.replace(co_name=f"{fwd.__name__}_compiled_{number}")
        own = types.FunctionType(code, fwd.__globals__, code.co_name, fwd.__defaults__, fwd.__closure__)
        own.__kwdefaults__ = fwd.__kwdefaults__
        self.compiled = torch.compile(own.__get__(model), dynamic=None,
                                      options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.calls = 0  # steps that took the compiled graph

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] > MAX_ROWS:
            return self.eager(input_ids, positions)
        self.calls += 1
        return self.compiled(input_ids, positions)


def compile_decode(runner) -> CompiledDecode | None:
    """Compile ``runner``'s model and run its graph once on a scratch cache; None where it is
    not wanted (``KernelConfig.cpu_compile``: False; None, the default, where it does not apply)
    or where compiling fails (with the reason logged and printed)."""
    config = runner.config
    asked = config.kernel.cpu_compile
    default_on = _default_on(config)  # (the variable checked whatever is asked)
    if asked is False:
        return None
    misfit = _misfit(runner)
    if misfit is not None:
        if asked:
            raise ConfigError("kernel.cpu_compile", misfit)
        return None
    if asked is None and (not default_on or _never_one_token(config)):
        return None
    head = getattr(runner.model, "lm_head", None)
    dense = [n for n, m in runner.model.named_modules() if type(m) is Linear and m is not head]
    if dense:
        if asked is None:  # (the default's common case on a float model: nothing to say)
            return None
        return _eager(config, f"the projections ({dense[0]}, ...) are float weights, which run faster packed for "
                              "oneDNN than in a graph; it takes quantized ones (a GGUF's blocks, --quantization "
                              "int4 or int8)")
    # Imported here, where a compile follows: torch._dynamo takes seconds to import, and most
    # CPU engines (float weights, compile off) never compile.
    import torch._dynamo
    from torch._dynamo.utils import counters
    try:  # before tracing: without a compiler inductor fails only after tens of seconds of it
        torch._dynamo.eval_frame.check_if_dynamo_supported()  # (this Python, this build)
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - whatever the checks raise: the eager model serves
        return _eager(config, f"torch.compile cannot run here ({type(e).__name__}: {e})")
    if config.show_progress:
        print("compiling the model for one-sequence steps (torch.compile: seconds, tens of seconds the first "
              "time; --enforce-eager skips it)", flush=True)
    stats = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    try:
        compiled = CompiledDecode(runner.model)
        _warm(runner, compiled, MAX_ROWS)
    except Exception as e:  # noqa: BLE001 - any compiler failure: the eager model serves
        return _eager(config, f"compiling the model failed ({type(e).__name__}: {e})")
    graphs = counters["stats"]["unique_graphs"] - stats[0]
    breaks = sum(counters["graph_break"].values()) - stats[1]
    if graphs != 1 or breaks:  # a split model pays the graphs' entry costs for little fusion
        return _eager(config, f"torch.compile made {graphs} graphs with {breaks} breaks of the model, not one")
    compiled.calls = 0
    return compiled


def _misfit(runner) -> str | None:
    """Why the engine's settings rule the compiled model out, or None."""
    if runner.config.enable_sleep_mode:
        return "cannot be combined with enable_sleep_mode (sleep frees the weights the compiled model reads)"
    if getattr(runner.model, "tp", None) is not None:
        return "cannot be combined with tensor parallelism"
    if runner.backend.name != "torch":
        return f"needs the torch attention backend, not {runner.backend.name!r}"
    return None


def _never_one_token(config) -> bool:
    """Whether no step of this engine is one token, so a compiled graph would never run: a
    draft model's or layer-skip's target verifies several tokens at every decode step, and a
    prefill-only engine (a KV producer) never decodes."""
    spec, kt = config.speculative, config.kv_transfer_config
    return ((spec is not None and spec.method in ("draft_model", "layer_skip"))
            or (kt is not None and kt.is_producer and not kt.is_consumer))


def _default_on(config) -> bool:
    """The default (``cpu_compile`` None) compiles unless the engine runs eagerly by request
    (``enforce_eager``) or ``KVSERVE_CPU_COMPILE`` is 0."""
    env = envs.get(envs.KVSERVE_CPU_COMPILE)
    if env not in (None, "", "0", "1"):
        raise ConfigError(envs.KVSERVE_CPU_COMPILE, f"must be 0 or 1; got {env!r}")
    return not config.enforce_eager and env != "0"


def _eager(config, why: str) -> None:
    msg = f"kernel.cpu_compile: running eagerly: {why}"
    log.warning(msg)
    if config.show_progress:
        print(msg, flush=True)


@torch.inference_mode()
def _warm(runner, compiled: CompiledDecode, rows: int) -> None:
    """A step of ``rows`` one-token sequences: eagerly first (the layers' derived tensors, e.g.
    converted scales, exist before tracing), then compiled."""
    bs = runner.block_size
    scratch = KVCache(runner.arch, rows, bs, runner.dtype, runner.device)
    meta, positions = runner._build_metadata([(0, 1, [i]) for i in range(rows)])
    ids = torch.zeros(rows, dtype=torch.long, device=runner.device)
    with forward_context(ForwardContext(meta, scratch.layers, runner.backend)):
        compiled.eager(ids, positions)
        compiled(ids, positions)
