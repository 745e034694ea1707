"""Cold start and sleep: process start -> first token from a kvserve snapshot, from a Hugging Face
safetensors directory through kvserve, and through transformers (the peer, same run); sleep and
wake at levels 1 and 2, the device memory held while asleep, and the first request's TTFT after
a wake against a warm engine.

    PYTHONPATH=$PWD python benchmarks/cold_start.py --out $OUT                       # H200, Llama-3-8B shape
    PYTHONPATH=$PWD python benchmarks/cold_start.py --model default --out /tmp/cs   # CPU, SmolLM2-135M

Steps, each measured in a fresh subprocess (the parent never touches the GPU):
  prepare   an HF-style directory (config.json, sharded *.safetensors, index) of random bf16
            weights of the preset's shape under --work (default /tmp/kvserve_cold_start); for
            ``--model default`` the shipped GGUF converted by transformers (real weights, float32)
  snapshot  ``kvserve snapshot`` of that directory (the engine's fused layout, its dtype)
  start     process start -> first token (a 128-token prompt, 1 new token): transformers
            ``from_pretrained`` + ``generate``; kvserve from the HF directory; kvserve from the
            snapshot with each ``--cuda-graph-capture`` mode (startup: every graph before the
            first request; lazy and background, the default: none) and eager (on the CPU, which
            has no graphs, one run). Each start also times 32 more tokens at batch 1 and 8 (lazy
            modes run a size's first step eagerly and capture it after) and reports the engine's
            start-up phases (``LLMEngine.startup_seconds``: weights, kv_profile, sdpa_warmup, ...),
            printed under the table. Before each cold run the model's files are dropped from
            the page cache (fsync + posix_fadvise DONTNEED per file; with --drop-all-caches
            also /proc/sys/vm/drop_caches); the JSON says whether a re-read
            after the drop ran at disk speed (it worked) or page-cache speed (it did not).
  sleep     one engine from the snapshot with sleep mode: warm TTFT; sleep/wake at level 1 and 2
            (times, device memory used while asleep by torch.cuda.mem_get_info and nvidia-smi);
            TTFT of the first request after each wake; the same greedy tokens after each wake;
            device memory after 20 more cycles, levels 1 and 2 in turn (eager; 2 with graphs, recaptured at each wake:
            all at once with startup, at first use with lazy).
Python's bytecode: every child runs with a bytecode cache under --work (PYTHONPYCACHEPREFIX,
PYTHONDONTWRITEBYTECODE cleared), filled by an untimed import of what they import (``FILL``)
before the first timed start, so a start pays what it would on an installed machine, whose
packages hold their compiled modules. An image that ships torch without bytecode and forbids
writing it compiles torch's Python source in every process; the JSON's ``bytecode`` entry times
``import torch`` with the cache and in the environment as given (bytecode writing off).
Prints a table last and writes cold_start.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PROMPT_LEN = 128
SHARD_BYTES = 5 << 30  # HF's usual shard size


def _prompt(seed: int, vocab: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(PROMPT_LEN)]


def _emit(d: dict) -> None:
    print("RESULT " + json.dumps(d), flush=True)


# -- children -------------------------------------------------------------------------------
def child_prepare(a) -> None:
    """Write the HF directory of random weights (GPU: drawn on the device, fast) or convert the GGUF."""
    import torch
    from safetensors.torch import save_file
    out = a.hf_dir
    os.makedirs(out, exist_ok=True)
    if a.model == "default":
        from transformers import AutoModelForCausalLM

        from kvserve.models.loader import default_model_path
        from kvserve.tokenizer import load_tokenizer
        gguf = default_model_path()
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32)
        # transformers will not save a model it loaded from GGUF: its tensors and config by hand.
        tied = m.config.tie_word_embeddings
        save_file({k: v.contiguous() for k, v in m.state_dict().items() if not (tied and k == "lm_head.weight")},
                  os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        cfg = m.config.to_dict()
        cfg.pop("quantization_config", None)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        load_tokenizer("gguf", gguf).save_pretrained(out)
        _emit({"prepared": out})
        return
    from kvserve.models.presets import DUMMY_PRESETS
    cfg = dict(DUMMY_PRESETS[a.model.removeprefix("dummy:")])
    cfg.update(model_type="llama", torch_dtype="bfloat16", hidden_act="silu")
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    shapes = {"model.embed_tokens.weight": (v, h)}
    for layer in range(n):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            t = torch.empty(shapes[name], dtype=torch.bfloat16, device=dev)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()
            weight_map[name] = fname
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(2 * torch.Size(s).numel() for s in shapes.values())},
                   "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    _emit({"prepared": out})


CAPTURE_MODES = ("startup", "lazy", "background")


def _engine_kwargs(a, engine: str) -> dict:
    """``engine``: eager (no CUDA graphs) or a --cuda-graph-capture mode."""
    kw = {"show_progress": False, "max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs,
          "enforce_eager": engine == "eager"}
    if engine in CAPTURE_MODES:
        kw["cuda_graph_capture"] = engine
    if a.kv_cache_memory:
        kw["kv_cache_memory"] = a.kv_cache_memory
    return kw


def child_snapshot(a) -> None:
    from kvserve import LLM
    from kvserve.models import snapshot
    t0 = time.perf_counter()
    llm = LLM(a.hf_dir, **_engine_kwargs(a, "eager"))
    t1 = time.perf_counter()
    m = snapshot.write(llm.engine, a.snap_dir)
    _emit({"load_s": t1 - t0, "write_s": time.perf_counter() - t1,
           "bytes": sum(f["bytes"] for f in m["files"].values()), "files": len(m["files"])})


def child_start(a) -> None:
    """Import, load, first token; timestamps in wall-clock seconds (the parent took its own at launch)."""
    t_main = time.time()
    import torch
    prompt = _prompt(0, a.vocab)
    if a.engine == "transformers":
        from transformers import AutoModelForCausalLM

        from kvserve.engine.device import auto_dtype
        t_import = time.time()
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = auto_dtype(torch.device(dev))  # what kvserve's "auto" runs on this device
        try:
            m = AutoModelForCausalLM.from_pretrained(a.path, dtype=dtype, device_map=dev)
        except (ImportError, ValueError):  # no accelerate: load on the host, then move
            m = AutoModelForCausalLM.from_pretrained(a.path, dtype=dtype).to(dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        t_ready = time.time()
        with torch.no_grad():
            out = m.generate(torch.tensor([prompt], device=dev), max_new_tokens=1, do_sample=False)
        token = int(out[0, -1])
    else:
        from kvserve import LLM, SamplingParams
        t_import = time.time()
        llm = LLM(a.path, **_engine_kwargs(a, a.engine))
        t_ready = time.time()
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        token = out[0].outputs[0].token_ids[0]
        t_first = time.time()
        # The steps after the first token: with lazy capture the first of each batch size is eager.
        more = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        decode = {}
        for batch in (1, 8):
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": _prompt(10 + i, a.vocab)} for i in range(batch)], more, use_tqdm=False)
            decode[f"batch{batch}_32_tokens_s"] = time.perf_counter() - t
        cap = llm.engine.runner.graph_capture
        decode["graphs_captured"] = len(cap.captured) if cap is not None else 0
        _emit({"t_main": t_main, "t_import": t_import, "t_ready": t_ready, "t_first": t_first, "token": token,
               "after": decode, "startup_seconds": llm.engine.startup_seconds})
        return
    _emit({"t_main": t_main, "t_import": t_import, "t_ready": t_ready, "t_first": time.time(), "token": token})


def _device_used() -> dict:
    import torch
    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    d = {"mem_get_info_used_gib": (total - free) / 2**30, "torch_reserved_gib": torch.cuda.memory_reserved() / 2**30}
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30).stdout
        mine = [int(line.split(",")[1]) for line in q.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
        g = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30).stdout.split()
        d["nvidia_smi_process_gib"] = mine[0] / 1024 if mine else None
        d["nvidia_smi_device_gib"] = int(g[0]) / 1024 if g else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return d


def child_sleep(a) -> None:
    import torch

    from kvserve import LLM, SamplingParams
    llm = LLM(a.path, enable_sleep_mode=True, **_engine_kwargs(a, a.engine))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seed = [100]

    def ttft() -> float:
        seed[0] += 1  # a new prompt each time: no prefix-cache hit
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": _prompt(seed[0], a.vocab)}, one, use_tqdm=False)
        return time.perf_counter() - t

    def tokens() -> list[int]:
        return llm.generate({"prompt_token_ids": _prompt(1, a.vocab)}, greedy, use_tqdm=False)[0].outputs[0].token_ids

    ref = tokens()
    warm = statistics.median(ttft() for _ in range(5))
    res = {"warm_ttft_s": warm, "awake": _device_used(), "levels": {}}
    for level in (1, 2):
        t = time.perf_counter()
        llm.sleep(level)
        t_sleep = time.perf_counter() - t
        asleep = _device_used()
        t = time.perf_counter()
        llm.wake_up()
        t_wake = time.perf_counter() - t
        first = ttft()
        res["levels"][level] = {"sleep_s": t_sleep, "wake_s": t_wake, "asleep": asleep,
                                "first_ttft_after_wake_s": first, "same_tokens": tokens() == ref}
    for i in range(a.cycles):  # levels 1 and 2 in turn
        llm.sleep(1 + i % 2)
        llm.wake_up()
    res["cycles"] = 2 + a.cycles
    res["after_cycles"] = _device_used()
    res["same_tokens_after_cycles"] = tokens() == ref
    _emit(res)


# -- the parent -----------------------------------------------------------------------------
def drop_page_cache(directory: str, whole_machine: bool = False) -> dict:
    """Drop the directory's files from the page cache (and with ``whole_machine`` every file's,
    through /proc/sys/vm/drop_caches where writable: only on a machine of one's own)."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    proc = False
    if whole_machine:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            proc = True
        except OSError:
            pass
    return {"fadvise_files": len(files), "proc_drop_caches": proc}


def read_speed(path: str, nbytes: int = 1 << 30) -> float:
    """GB/s reading the first ``nbytes`` of ``path``."""
    t, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while n < nbytes and (chunk := f.read(64 << 20)):
            n += len(chunk)
    return n / (time.perf_counter() - t) / 1e9


def _child_env(bytecode_dir: str | None) -> dict:
    """The children's environment: kvserve importable, Python's compiled modules cached in
    ``bytecode_dir`` (None: the environment as given, with bytecode writing forbidden, so a
    package installed without its compiled modules is compiled from source in every process)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPYCACHEPREFIX", None)
    if bytecode_dir is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = bytecode_dir
    return env


# What the children import, compiled into their cache before the first timed start (each
# where it is installed): torch, Triton and the kernels, the engine, transformers' Llama.
FILL = ("torch", "triton", "triton.language", "kvserve.llm", "kvserve.engine.llm_engine", "kvserve.kernels.rmsnorm",
        "kvserve.layers.triton_attention", "kvserve.engine.cuda_graphs", "transformers",
        "transformers.models.llama.modeling_llama")


def time_import(env: dict, modules: tuple[str, ...] = ("torch",)) -> float:
    code = ("import importlib, time\nt = time.perf_counter()\n"
            f"for m in {modules!r}:\n    try:\n        importlib.import_module(m)\n"
            "    except ImportError:\n        pass\nprint(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def bytecode(a) -> dict:
    """Fill the children's bytecode cache (untimed), then time ``import torch`` with the cache
    and in the environment as given without it."""
    cached = _child_env(a.bytecode_dir)
    time_import(cached, FILL)
    return {"prefix": a.bytecode_dir, "parent_dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
            "import_torch_cached_s": min(time_import(cached) for _ in range(2)),
            "import_torch_uncached_s": min(time_import(_child_env(None)) for _ in range(2))}


def run_child(mode: str, a, **extra) -> dict:
    args = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", a.model, "--work", a.work,
            "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs)]
    if a.kv_cache_memory:
        args += ["--kv-cache-memory", a.kv_cache_memory]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    t0 = time.time()
    p = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=_child_env(a.bytecode_dir))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise RuntimeError(f"{mode} {extra} failed with exit code {p.returncode}")
    d = json.loads(lines[-1].removeprefix("RESULT "))
    d["t_launch"] = t0
    d["wall_s"] = time.time() - t0
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy:llama-3-8b", help="dummy:<preset> (random bf16 HF directory) or "
                    "default (the shipped SmolLM2 GGUF converted by transformers)")
    ap.add_argument("--work", default="/tmp/kvserve_cold_start", help="where the HF directory and snapshot go")
    ap.add_argument("--out", default="benchmarks/results/cold_start")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="also the largest CUDA graph batch (8 captured sizes)")
    ap.add_argument("--kv-cache-memory", default=None, help="default: profiled on CUDA, 2 GiB on the CPU")
    ap.add_argument("--repeats", type=int, default=1, help="starts per configuration, cold and warm (the table "
                    "shows the fastest, the JSON every one)")
    ap.add_argument("--keep", action="store_true", help="keep the HF directory and snapshot for a rerun")
    ap.add_argument("--drop-all-caches", action="store_true", help="also write /proc/sys/vm/drop_caches before "
                    "each cold run (the whole machine's page cache: Python and torch start cold too)")
    ap.add_argument("--configs", default="transformers,hf,snapshot,lazy,startup,eager",
                    help="which starts to time (lazy, startup and eager: from the snapshot, on a GPU only)")
    ap.add_argument("--sleep-engines", default="eager,startup,lazy",
                    help="sleep/wake runs, one engine each (the CPU runs eager only)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cycles", type=int, default=20, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.hf_dir = os.path.join(a.work, "hf")
    a.snap_dir = os.path.join(a.work, "snapshot")
    a.bytecode_dir = os.path.join(a.work, "bytecode")
    if a.child:
        {"prepare": child_prepare, "snapshot": child_snapshot, "start": child_start,
         "sleep": child_sleep}[a.child](a)
        return

    res = {"model": a.model, "max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs,
           "prompt_tokens": PROMPT_LEN}
    os.makedirs(a.out, exist_ok=True)

    def save() -> None:  # after every stage: a run cut short still leaves what it measured
        with open(os.path.join(a.out, "cold_start.json"), "w") as f:
            json.dump(res, f, indent=1)
    if not (a.keep and os.path.isdir(a.snap_dir)):
        shutil.rmtree(a.work, ignore_errors=True)
        t = time.time()
        run_child("prepare", a)
        res["prepare_s"] = time.time() - t
        res["snapshot"] = run_child("snapshot", a)
        save()
    res["bytecode"] = bytecode(a)
    with open(os.path.join(a.hf_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    shard = max((os.path.join(a.snap_dir, f) for f in os.listdir(a.snap_dir) if f.endswith(".safetensors")),
                key=os.path.getsize)
    read_speed(shard)
    res["page_cache"] = {"warm_read_gbps": read_speed(shard), **drop_page_cache(a.snap_dir, a.drop_all_caches)}
    res["page_cache"]["read_after_drop_gbps"] = read_speed(shard)
    res["page_cache"]["worked"] = res["page_cache"]["read_after_drop_gbps"] < 0.5 * res["page_cache"]["warm_read_gbps"]

    gpu = shutil.which("nvidia-smi") is not None  # the parent stays off the device: no torch import
    known = [("transformers", "transformers", "transformers", a.hf_dir),
             ("hf", "kvserve HF dir", "background", a.hf_dir),
             ("snapshot", "kvserve snapshot", "background", a.snap_dir)]
    if gpu:  # on the CPU there are no graphs: every mode would be the same run
        known += [("lazy", "kvserve snapshot, lazy", "lazy", a.snap_dir),
                  ("startup", "kvserve snapshot, startup", "startup", a.snap_dir),
                  ("eager", "kvserve snapshot, eager", "eager", a.snap_dir)]
    wanted = set(a.configs.split(","))
    configs = [c for c in known if c[0] in wanted]
    starts = {}
    for cache in ("cold", "warm"):
        for _, name, engine, path in configs:
            runs = []
            for _ in range(a.repeats):
                if cache == "cold":
                    drop_page_cache(path, a.drop_all_caches)
                d = run_child("start", a, engine=engine, path=path, vocab=vocab)
                runs.append({"to_first_token_s": d["t_first"] - d["t_launch"], "import_s": d["t_import"] - d["t_main"],
                             "load_s": d["t_ready"] - d["t_import"], "first_token_s": d["t_first"] - d["t_ready"],
                             "interpreter_s": d["t_main"] - d["t_launch"], "token": d["token"],
                             "startup_seconds": d.get("startup_seconds"), **d.get("after", {})})
            starts[f"{name} ({cache})"] = runs
            res["start"] = starts
            save()
    res["sleep"] = {}
    for engine in [e for e in a.sleep_engines.split(",") if e] if gpu else ["eager"]:
        res["sleep"][engine] = run_child("sleep", a, engine=engine, path=a.snap_dir, vocab=vocab,
                                         cycles=20 if engine == "eager" else 2)
        save()
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)
    _table(res)


def _table(res: dict) -> None:
    pc = res["page_cache"]
    print(f"\npage cache drop: {'worked' if pc['worked'] else 'did NOT work'} (re-read "
          f"{pc['read_after_drop_gbps']:.1f} GB/s after the drop, {pc['warm_read_gbps']:.1f} GB/s warm; "
          f"/proc/sys/vm/drop_caches {'written' if pc['proc_drop_caches'] else 'not written'})")
    bc = res["bytecode"]
    print(f"import torch: {bc['import_torch_cached_s']:.2f} s from the children's bytecode cache, "
          f"{bc['import_torch_uncached_s']:.2f} s without it (bytecode writing off)")
    if "snapshot" in res:
        s = res["snapshot"]
        print(f"snapshot: {s['bytes'] / 2**30:.1f} GiB in {s['files']} files, written in {s['write_s']:.1f} s")
    print(f"\n{'process start -> first token':36} {'best s':>7} {'import':>7} {'load':>7} {'weights':>8} "
          f"{'1st tok':>8} {'32 tok b1':>10} {'32 tok b8':>10} {'graphs':>7}")
    for name, runs in res["start"].items():
        b = min(runs, key=lambda r: r["to_first_token_s"])
        after = (f" {b['batch1_32_tokens_s']:10.3f} {b['batch8_32_tokens_s']:10.3f} {b['graphs_captured']:7d}"
                 if "graphs_captured" in b else "")
        phases = b.get("startup_seconds") or {}  # kvserve's own start-up phases (LLMEngine.startup_seconds)
        weights = f"{phases['weights']:8.2f}" if "weights" in phases else f"{'-':>8}"
        print(f"{name:36} {b['to_first_token_s']:7.2f} {b['import_s']:7.2f} {b['load_s']:7.2f} {weights} "
              f"{b['first_token_s']:8.2f}{after}")
    for name, runs in res["start"].items():
        phases = min(runs, key=lambda r: r["to_first_token_s"]).get("startup_seconds")
        if phases:
            print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    print(f"\n{'sleep / wake':28} {'sleep s':>8} {'wake s':>7} {'asleep GiB':>11} {'TTFT after':>11} {'warm TTFT':>10}")
    for engine, s in res["sleep"].items():
        for level, r in s["levels"].items():
            used = r["asleep"].get("nvidia_smi_process_gib") or r["asleep"].get("mem_get_info_used_gib")
            shown = f"{used:.2f}" if used is not None else "-"
            print(f"{engine + ', level ' + str(level):28} {r['sleep_s']:8.3f} {r['wake_s']:7.3f} {shown:>11} "
                  f"{r['first_ttft_after_wake_s'] * 1e3:9.1f}ms {s['warm_ttft_s'] * 1e3:8.1f}ms"
                  f"{'' if r['same_tokens'] else '  TOKENS DIFFER'}")


if __name__ == "__main__":
    main()
