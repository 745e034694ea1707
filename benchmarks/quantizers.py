"""Quantizers against each other on the CPU: the default model (SmolLM2-135M) quantized to int4
(``--bits 8``: int8, ``--group-size 0`` one scale per output channel) by ``kvserve quantize``
(RTN, AWQ, GPTQ, GPTQ with act-order; symmetric groups of 64, the largest size that divides its
576-wide projections; ``--methods`` adds the asymmetric variants, and ``--observer`` chooses how
each group's range is picked) and by round-to-nearest at load (``--quantization int4``,
asymmetric; int8: per channel, symmetric), each loaded by kvserve in float32 and scored by
perplexity over a held-out text (Python's reference documentation, ``pydoc_data.topics``, which
the calibration text leaves out) against the float32 model, in one run. Also the time each
quantizer took and the checkpoint size.

    PYTHONPATH=$PWD python benchmarks/quantizers.py --out benchmarks/results/quantizers_cpu

``--model`` takes another unquantized (or dequantized-at-load GGUF) Llama-family model, e.g.
Qwen2.5-Coder-0.5B (benchmarks/fetch_qwen_pair.py), whose 896-wide projections take groups of 128.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM  # noqa: E402
from kvserve.bench.quality import heldout_ids, perplexity  # noqa: E402
from kvserve.models.loader import default_model_path  # noqa: E402
from kvserve.quantize import quantize  # noqa: E402

METHODS = {"rtn": {"method": "rtn"}, "awq": {"method": "awq"}, "gptq": {"method": "gptq"},
           "gptq act-order": {"method": "gptq", "act_order": True}}
METHODS.update({f"{k} asymmetric": {**v, "symmetric": False} for k, v in list(METHODS.items())})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the default model)")
    ap.add_argument("--out", default="benchmarks/results/quantizers_cpu")
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    ap.add_argument("--offset", type=int, default=0,
                    help="held-out tokens skipped before those scored (a second slice, to check a change on "
                         "text it was not chosen on)")
    ap.add_argument("--calibration-tokens", type=int, default=16384)
    ap.add_argument("--bits", type=int, default=4, help="4 or 8")
    ap.add_argument("--group-size", type=int, default=64, help="32, 64 or 128; 8 bits also 0 (per channel)")
    ap.add_argument("--observer", default=None, help="how kvserve quantize picks each group's range: minmax, mse "
                    "(default: kvserve quantize's, mse for GPTQ and minmax for RTN and AWQ)")
    ap.add_argument("--methods", default="rtn,awq,gptq,gptq act-order",
                    help=f"comma-separated, of: {', '.join(METHODS)}")
    a = ap.parse_args()
    if a.offset < 0 or a.tokens < 2:
        ap.error(f"--offset must be >= 0 and --tokens >= 2; got {a.offset} and {a.tokens}")
    model = a.model or default_model_path()
    res = {"model": os.path.basename(model), "bits": a.bits, "group_size": a.group_size,
           "calibration_tokens": a.calibration_tokens,
           "observer": a.observer, "rows": {}}
    max_len = max(4096, a.tokens + 1)  # (the scored text is one prompt, plus the token it asks for)
    ref = LLM(model, dtype="float32", quantization="none", show_progress=False, max_model_len=max_len)
    ids = heldout_ids(ref.get_tokenizer(), a.offset + a.tokens)[a.offset:]
    res["heldout_tokens"], res["heldout_offset"] = len(ids), a.offset
    res["rows"]["fp32"] = {"perplexity": perplexity(ref, ids)}
    del ref
    gc.collect()
    if a.bits == 4:
        llm = LLM(model, dtype="float32", quantization="int4", quantization_group_size=a.group_size,
                  show_progress=False, max_model_len=max_len)
        res["rows"]["int4 at load (RTN, asymmetric)"] = {"perplexity": perplexity(llm, ids)}
    else:
        llm = LLM(model, dtype="float32", quantization="int8", show_progress=False, max_model_len=max_len)
        res["rows"]["int8 at load (RTN, per channel)"] = {"perplexity": perplexity(llm, ids)}
    del llm
    gc.collect()
    work = tempfile.mkdtemp(prefix="kvserve-quantizers-")
    try:
        for name in a.methods.split(","):
            out = os.path.join(work, name.replace(" ", "-"))
            t0 = time.perf_counter()
            config = quantize(model, out, bits=a.bits, group_size=a.group_size, num_tokens=a.calibration_tokens,
                              observer=a.observer, **METHODS[name])
            seconds = time.perf_counter() - t0
            llm = LLM(out, dtype="float32", show_progress=False, max_model_len=max_len)  # (as the fp32 row)
            res["rows"][f"kvserve quantize {name}"] = {
                "perplexity": perplexity(llm, ids), "quantize_s": seconds,
                "observer": config["config_groups"]["group_0"]["weights"]["observer"],
                "checkpoint_bytes": sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))}
            del llm
            gc.collect()
            print(name, res["rows"][f"kvserve quantize {name}"], flush=True)
            save(a.out, res)  # (each row as it comes: a long run stopped keeps what it measured)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = res["rows"]["fp32"]["perplexity"]
    groups = f"groups of {a.group_size}" if a.group_size else "per channel"
    print(f"\nperplexity over {len(ids)} held-out tokens ({res['model']}, int{a.bits}, {groups})")
    for name, r in res["rows"].items():
        extra = f"  quantized in {r['quantize_s']:.0f} s" if "quantize_s" in r else ""
        print(f"  {name:36s} {r['perplexity']:8.3f} ({r['perplexity'] / base - 1:+.1%}){extra}")
    save(a.out, res)


def save(out: str, res: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "quantizers.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
