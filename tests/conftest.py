"""Shared fixtures (the default model's path, its tokenizer, Hugging Face's reference model) and
the test tiers.

Tiers (``pytest -m``, registered in pyproject.toml): every test is one of

    unit     pure bookkeeping, no model: the files in ``UNIT_FILES``
    kernels  a Triton kernel against its reference: everything under tests/kernels/
    e2e      builds a whole engine or starts a server: everything else

unless it carries one of these marks itself. ``gpu`` is added to tests that need CUDA (test_cuda.py,
and any test whose skip reason names CUDA). ``slow`` marks the slowest tests (the default model's
real weights in fp32, engines in Triton's interpreter, servers on the real model): written on
the test, or listed in ``SLOW_TESTS`` for files that do not mark their own. The inner loop is
``bash scripts/test.sh -m "not slow"``; CI runs everything.
"""
from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path

# One intra-op thread, here and in every process the tests start (servers, tensor-parallel ranks,
# disaggregated instances inherit the environment): the tests' shapes are tiny, so a second thread
# buys nothing, and where the cores are shared a thread that waits for its preempted sibling spins
# for the whole time slice, which makes a small matmul many times slower. Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The CPU's float32 reference mode, here and in the processes the tests start: the parity checks
# compare with transformers' float32 forward, and a CPU with native bfloat16 would otherwise run
# dtype "auto" in bfloat16. Tests of that choice set the variable themselves.
os.environ.setdefault("KVSERVE_CPU_DTYPE", "float32")
# The CPU's compiled model is the default where it applies; compiling costs seconds an engine,
# so here (and in the processes the tests start) it is off unless a test asks for it.
os.environ.setdefault("KVSERVE_CPU_COMPILE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
# Without a GPU, Triton kernels run in its interpreter (tests/kernels call them on CPU tensors).
# Set before anything imports triton: the decorator reads it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import dataclasses

    from triton.runtime import interpreter as _interpreter

    # The interpreter checks each 32-bit integer add, sub and mul for overflow by redoing it in
    # int64 and comparing, then drops the verdict (device_assert does nothing without debug):
    # a quarter of an interpreted engine's time. Off, every kernel computes exactly the same.
    _interpreter.interpreter_builder.options = dataclasses.replace(_interpreter.interpreter_builder.options,
                                                                   sanitize_overflow=False)

    # A launch patches the language modules its kernel sees (triton.language, .core) with the
    # interpreter's semantics and restores them when it ends; every call of a @triton.jit helper
    # inside it (tl.zeros and tl.max among them) patches the modules that helper sees all over
    # again, a walk over each one's members, though the launch or an earlier helper has patched
    # them the same way (a helper's patches are never undone): a third of a kernel test's time.
    # A helper whose modules the running launch has all patched skips that; every kernel
    # computes exactly the same. Installed once (test modules import this file again).
    if not getattr(_interpreter.GridExecutor.__call__, "tracks_patched_langs", False):
        _launch_langs: list[set[int]] = []  # ids of the modules each launch in progress has patched
        _langs_of: dict[object, frozenset[int]] = {}

        def _langs(fn) -> frozenset[int]:
            if fn not in _langs_of:
                lang = (_interpreter.tl, _interpreter.tl.core)
                _langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in lang))
            return _langs_of[fn]

        _grid_call = _interpreter.GridExecutor.__call__

        def _launch(self, *args, **kwargs):
            _launch_langs.append(set(_langs(self.fn)))
            try:
                return _grid_call(self, *args, **kwargs)
            finally:
                _launch_langs.pop()

        def _device_call(self, *args, **kwargs):  # InterpretedFunction.__call__ but for the patch
            langs = _langs(self.fn)
            if not (_launch_langs and langs and langs <= _launch_langs[-1]):
                _interpreter._patch_lang(self.fn)
                if _launch_langs:
                    _launch_langs[-1] |= langs
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise _interpreter.InterpreterError(repr(e)) from e

        # The numpy dtype of a Triton type: the interpreter builds its table of every scalar
        # type anew at each ask (once or more per operation); here, once per scalar type.
        _np_dtype_of: dict[object, object] = {}
        _np_dtype = _interpreter._get_np_dtype

        def _get_np_dtype(tt_dtype):
            scalar = tt_dtype.element_ty if isinstance(tt_dtype, _interpreter.tl.block_type) else tt_dtype
            if isinstance(scalar, _interpreter.tl.pointer_type):
                return _np_dtype(scalar)
            if scalar not in _np_dtype_of:
                _np_dtype_of[scalar] = _np_dtype(scalar)
            return _np_dtype_of[scalar]

        _launch.tracks_patched_langs = True
        _interpreter.GridExecutor.__call__ = _launch
        _interpreter.InterpretedFunction.__call__ = _device_call
        _interpreter._get_np_dtype = _get_np_dtype

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "kernels", "e2e")
UNIT_FILES = {"test_block_pool.py", "test_sampler.py", "test_sampling_rows.py", "test_scheduler_properties.py",
              "test_stop_strings.py", "kvtier/test_chunk.py", "kvtier/test_tier_lru_properties.py"}
GPU_FILES = {"test_cuda.py"}
# "file::test" (relative to tests/): every parameter set of that test; "file::test[id]": that one;
# "file::": the whole file.
SLOW_TESTS = (
    # the default model's real weights in fp32
    "test_engine.py::test_n_greedy_shares_prompt_and_copies_on_write",
    "test_engine.py::test_seeded_sampling_independent_of_batch",
    "test_engine.py::test_parallel_samples_reproducible",
    "test_engine.py::test_logprobs_match_transformers",
    "test_engine.py::test_stop_token_ids_min_tokens_ignore_eos",
    "test_embeddings.py::test_pooled_hidden_states_match_transformers",
    "test_engine.py::test_streamed_text_never_shows_part_of_a_stop_string",
    "test_kv_cache_dtype.py::test_perplexity_per_kv_dtype",
    "test_kv_cache_dtype.py::test_8bit_greedy_agreement",
    "test_kv_cache_dtype.py::test_calibrated_scales",
    "test_kv_cache_dtype.py::test_disk_tier_is_keyed_by_kv_format",
    "test_kv_cache_dtype.py::test_bad_calibration_files",
    "server/test_server_openai.py::",
    "server/test_model_names_and_cached_tokens.py::test_default_name_is_the_model_file_name",
    "server/test_model_names_and_cached_tokens.py::test_cached_tokens_on_a_repeated_long_prompt",
    "server/test_model_names_and_cached_tokens.py::test_chat_cache_salt_shares_only_with_the_same_salt",
    # whole engines in Triton's interpreter
    "test_kv_cache_dtype_triton.py::",
    "test_kv_eviction.py::test_triton_backend_matches_torch_backend",
    # many steps, processes or requests
    "test_async_scheduling.py::test_async_scheduling_changes_no_output[1-64MiB]",
    "test_async_scheduling.py::test_async_scheduling_changes_no_output[2-64KiB]",
    "server/test_server_tiny.py::test_queue_overflow_is_429_then_serves",
    "server/test_server_tiny.py::test_sigterm_with_requests_in_flight_exits_0",
    "server/test_loading.py::test_server_process_answers_while_loading",
    "server/test_loading.py::test_load_failure_exits_2",
    "server/test_bench.py::",
    "server/test_fuzz.py::",
    # more cases of a feature that keeps a case in the fast loop: the gloo connector's failures
    # (test_transfer_timeout_means_local_prefill stays), write-through at exit ([script-ends] and
    # [cpu-tier] stay)
    "test_disagg.py::test_producer_dying_mid_transfer_means_local_prefill",
    "test_disagg.py::test_mismatched_kv_cache_dtype_is_refused",
    "kvtier/test_write_through.py::test_a_process_that_just_ends_leaves_its_prefixes[llm-dropped]",
    "kvtier/test_write_through.py::test_a_process_that_just_ends_leaves_its_prefixes[dies-after-writes]",
    "kvtier/test_write_through.py::test_full_write_queue_drops_without_blocking_and_shutdown_writes_the_rest"
    "[no-cpu-tier]",
    # (CudaIpcConnector's hand-over and its unit tests stay; its engine-level failure cases and
    # long prompts are here)
    "test_disagg_ipc.py::test_ipc_prompts_beyond_kv_buffer_size_pass_one_after_another",
    "test_disagg_ipc.py::test_ipc_producer_killed_means_local_prefill",
    "test_disagg_ipc.py::test_ipc_transfer_timeout_means_local_prefill",
    "test_disagg_ipc.py::test_ipc_mismatched_kv_cache_dtype_is_refused",
    "test_tensor_parallel.py::test_compressed_kv_per_rank",
    "test_tensor_parallel.py::test_fewer_kv_heads_than_ranks_then_a_killed_worker",
    "server/test_shutdown.py::test_requests_open_past_the_shutdown_timeout_end_in_openai_shape",
    "server/test_sleep_server.py::test_idle_sleep_then_a_request_wakes_it",
    "test_kv_cache_dtype.py::test_kivi_forks_and_preemption_keep_residual_rows",
    "test_kv_cache_dtype.py::test_bad_kv_options_name_the_option[kw1-kv_group_size-words1]",
    "test_graph_capture.py::test_engine_captures_each_size_once_after_its_first_step[lazy-True]",
    "test_graph_capture.py::test_engine_captures_each_size_once_after_its_first_step[background-False]",
    "test_graph_capture.py::test_engine_captures_each_size_once_after_its_first_step[background-True]",
    "test_structured_async.py::test_async_gives_the_synchronous_tokens[preempting]",
    "test_decode_rows.py::test_speculative_greedy_identical_through_rows[mixed-batches]",
    "test_decode_rows.py::test_speculative_greedy_identical_through_rows[preemption]",
    "kvtier/test_tier_security.py::test_generated_secret_is_private_outside_the_tier_and_shared_by_the_host",
    "kvtier/test_tier_security.py::test_another_secret_cannot_read_the_chunks",
    "kvtier/test_tier_security.py::test_encrypted_chunks_load_after_a_restart",
    "test_speculative.py::test_preempted_speculative_requests_resume_identically[layer_skip]",
    "test_speculative.py::test_preempted_speculative_requests_resume_identically[ngram]",
    "test_speculative.py::test_async_scheduling_looks_ahead_past_plain_steps_only[ngram]",
    "test_speculative.py::test_one_batch_of_greedy_requests_with_and_without_extras",
    "test_engine_release.py::test_a_failed_start_leaves_the_next_engine_working",
    "server/test_disagg_proxy.py::",
    # the largest kernel cases in the interpreter
    "kernels/test_decode_attention.py::test_decode_fused_rope_kv_write",
    "kernels/test_decode_attention.py::test_decode_fused_rope_rounding_not_contracted",
    "kernels/test_decode_attention.py::test_split_merge_in_rounds",
    "kernels/test_decode_attention.py::test_split_merge_counters_reset",
    "kernels/test_prefill_attention.py::test_prefill_page_against_tile",
    "kernels/test_kivi_decode.py::test_kivi4_decode_compiles_for_sm90_without_shared_memory",
    "kernels/test_gemv.py::test_one_row_prefetch_depth",
    "kernels/test_gemv.py::test_one_row[True-False-130-1536-torch.float16]",
    "kernels/test_gemv.py::test_one_row[True-False-130-1536-torch.bfloat16]",
    "kernels/test_prefill_attention.py::test_prefill_matches_reference[8-1-64-16-torch.float16]",
    "kernels/test_prefill_attention.py::test_prefill_matches_reference[6-2-16-4-torch.float16]",
    "kernels/test_decode_attention.py::test_decode_matches_reference[9-3-16-4-5-torch.float16]",
    "kernels/test_streaming_attention.py::test_prefill_streaming_matches_kept_keys[16-32-8]",
    "kernels/test_streaming_attention.py::test_prefill_streaming_matches_kept_keys[32-16-8]",
    "kernels/test_window_attention.py::test_prefill_window_matches_reference[16-32-40]",
    "kernels/test_window_attention.py::test_prefill_window_matches_reference[16-16-16]",
    "kernels/test_kv_quant.py::test_prefill_attention_compressed_half[int2-dtype0]",
    "kernels/test_kv_quant.py::test_prefill_attention_compressed[64-fp8-static]",
    "kernels/test_kv_quant.py::test_prefill_attention_compressed[64-int8-static]",
    "kernels/test_streaming_attention.py::test_prefill_streaming_matches_kept_keys[16-16-8]",
    "kernels/test_streaming_attention.py::test_prefill_streaming_matches_kept_keys[16-16-4]",
    "kernels/test_window_attention.py::test_prefill_window_matches_reference[16-16-40]",
)


def _tier(rel: str) -> str:
    if rel.startswith("kernels/"):
        return "kernels"
    return "unit" if rel in UNIT_FILES else "e2e"


def _needs_cuda(item: pytest.Item, rel: str) -> bool:
    return rel in GPU_FILES or any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def _slow_entry(test_id: str) -> str | None:
    """The ``SLOW_TESTS`` entry that names ``test_id`` ("file::test[params]"), if any."""
    name = test_id.partition("[")[0]
    for entry in SLOW_TESTS:
        if entry.endswith("::"):
            hit = test_id.startswith(entry)  # the whole file
        elif "[" in entry:
            hit = test_id == entry  # one parameter set
        else:
            hit = name == entry  # every parameter set
        if hit:
            return entry
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config, items):
    used: set[str] = set()
    collected: set[str] = set()
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(TESTS):
            continue
        rel = path.relative_to(TESTS).as_posix()
        collected.add(rel)
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(_tier(rel))
        if _needs_cuda(item, rel):
            item.add_marker("gpu")
        entry = _slow_entry(rel + "::" + item.nodeid.partition("::")[2])
        if entry is not None:
            item.add_marker("slow")
            used.add(entry)
    # The longest files first. scripts/test.sh hands whole files to xdist's workers in this order
    # (--dist loadfile --no-loadscope-reorder), so the short ones fill in beside the long ones,
    # instead of one long file running alone at the end while the other workers idle. The whole
    # suite: the files holding the most slow tests; the fast loop (-m "not slow"): those holding
    # the most other tests (the kernels' many small cases add up). Stable: a file's tests keep
    # their order.
    fast_loop = "not slow" in (config.option.markexpr or "")
    weight = Counter(item.path for item in items if bool(item.get_closest_marker("slow")) != fast_loop)
    items.sort(key=lambda item: -weight[item.path])
    # A listed test that was renamed would quietly join the fast loop: say so whenever its whole
    # file was collected.
    if not any("::" in a for a in config.args):
        stale = [e for e in SLOW_TESTS if e.split("::")[0] in collected and e not in used]
        if stale:
            warnings.warn(pytest.PytestWarning(f"tests/conftest.py SLOW_TESTS names no test: {stale}"), stacklevel=1)


@pytest.fixture(autouse=True, scope="session")
def _private_state_dir(tmp_path_factory):
    """The generated KV tier secret goes to a directory of this run, never the user's own (servers
    and processes the tests start inherit it)."""
    old = os.environ.get("KVSERVE_STATE_DIR")
    os.environ["KVSERVE_STATE_DIR"] = str(tmp_path_factory.mktemp("kvserve-state"))
    yield
    if old is None:
        os.environ.pop("KVSERVE_STATE_DIR", None)
    else:
        os.environ["KVSERVE_STATE_DIR"] = old


@pytest.fixture(scope="session")
def model_path() -> str:
    from kvserve.models.loader import default_model_path
    return default_model_path()


def hf_from_gguf(path: str):
    """transformers' own model for a GGUF file, read by its own GGUF reader and dequantization,
    float32, in eval mode. transformers parses the file's header twice while it loads (the
    config, then the weights) and builds the gguf package's tensor-name map again for every
    module (hundreds of times over the same arguments): here, for this one call, the same parse
    and the same map serve every ask, which leaves the model and its config exactly as they
    were, at a third of the time. The parse is the gguf package's own, over the file's bytes as
    a plain ndarray instead of a memmap, and the one kvserve keeps for the file
    (``gguf_loader.open_reader``: read only, by both; an engine on the file right after parses
    nothing)."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    from kvserve.models.gguf_loader import open_reader
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed = {}

    def parse_once(p, *args, **kwargs):
        if not args and not kwargs:
            return open_reader(str(p))
        key = (os.path.realpath(p), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = reader(p, *args, **kwargs)
        return parsed[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parse_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    return m.eval()


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own Llama on the same GGUF weights, float32: the reference we did not write."""
    return hf_from_gguf(model_path)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from kvserve.tokenizer import load_tokenizer
    return load_tokenizer("gguf", model_path)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """Reference continuation: one prompt at a time, no padding."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0)
    return out[0, len(prompt_ids):].tolist()
