"""A memory agent against the naive agent over a scripted 50-turn conversation, on the CPU.

The conversation (written here): eight facts about the user planted in the first turns, small
talk after them, then eight questions about the facts among more small talk in the last turns.
Both agents talk to one `kvserve serve` process through the Responses API (official openai
client, streamed) with the same pinned instructions:

    naive    previous_response_id chains the turns: every prompt carries the whole history
    memory   the same chain plus memory={"budget_tokens": B}: pinned instructions, the last
             turns, and facts and past turns retrieved from the memory store under the budget

Per turn: prompt tokens, cached prompt tokens and TTFT (request sent to the first text delta);
on the recall questions: whether the answer names the planted value. Separately, and without the
LLM, the memory store's retrieval recall@k: for each question, whether the planted fact (as a
fact, or as the turn that stated it) is among the top k retrieved. Prints a table last; writes
JSON under --out.

    PYTHONPATH=$PWD python benchmarks/agent_memory.py --threads 1   # the default model (SmolLM2-135M)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence, using what you know about the user."
FACTS = [  # (statement, question, the value the answer must name)
    ("My sister is called Ingrid.", "What is my sister's name?", "Ingrid"),
    ("I live in Porto.", "Which city do I live in?", "Porto"),
    ("My dog is called Biscuit.", "What is my dog's name?", "Biscuit"),
    ("I work at a lighthouse.", "Where do I work?", "lighthouse"),
    ("My favourite colour is teal.", "What is my favourite colour?", "teal"),
    ("I am allergic to peanuts.", "What am I allergic to?", "peanuts"),
    ("My car is a green Volvo.", "What car do I drive?", "Volvo"),
    ("I play the cello.", "Which instrument do I play?", "cello"),
]
TOPICS = ["volcanoes", "the moon", "honey bees", "rainbows", "glaciers", "the printing press", "octopuses",
          "sourdough bread", "the Roman roads", "lightning", "coral reefs", "chess openings", "tea ceremonies",
          "deserts", "the violin", "paper making", "owls", "tides", "windmills", "comets", "maple syrup",
          "the Silk Road", "penguins", "clocks", "bamboo", "earthquakes", "lighthouses of old", "salt",
          "kites", "the Nile", "mushrooms", "bridges", "whales", "typewriters"]
NUM_TURNS = 50


def script() -> list[tuple[str, str | None]]:
    """(user message, expected value or None) per turn: facts in turns 1-8, questions in the
    odd turns from 35 on, small talk everywhere else."""
    topics, turns = iter(TOPICS), []
    for i in range(NUM_TURNS):
        if i < len(FACTS):
            turns.append((f"A note about me: {FACTS[i][0]} Please just say you noted it.", None))
        elif i >= 34 and (i - 34) % 2 == 0 and (i - 34) // 2 < len(FACTS):
            _, q, want = FACTS[(i - 34) // 2]
            turns.append((q, want))
        else:
            turns.append((f"Tell me one short fact about {next(topics)}.", None))
    return turns


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, db: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--served-model-name", "m",
           "--kv-cache-memory", args.kv_cache_memory, "--responses-db", db]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def run_agent(client, args, memory: bool) -> list[dict]:
    rows, prev = [], None
    for i, (msg, want) in enumerate(script()):
        extra = {"memory": {"budget_tokens": args.budget_tokens, "last_turns": args.last_turns,
                            "top_k": args.top_k}} if memory else {}
        t0, ttft, text, final = time.perf_counter(), None, "", None
        for ev in client.responses.create(model="m", input=msg, instructions=INSTRUCTIONS, previous_response_id=prev,
                                          max_output_tokens=args.max_output_tokens, temperature=0, stream=True,
                                          extra_body=extra):
            if ev.type == "response.output_text.delta":
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += ev.delta
            elif ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        prev = final.id
        u = final.usage
        row = {"turn": i + 1, "prompt_tokens": u.input_tokens, "cached_tokens": u.input_tokens_details.cached_tokens,
               "ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "answer": text}
        if want is not None:
            row["expected"], row["correct"] = want, want.lower() in text.lower()
        if memory:
            row["retrieved"] = [r["text"] for r in (final.model_extra or {}).get("memory", {}).get("retrieved", [])]
        rows.append(row)
        print(f"{'memory' if memory else 'naive '} turn {i + 1:2d}: {u.input_tokens:5d} prompt tokens, "
              f"{row['cached_tokens']:5d} cached, TTFT {row['ttft_s'] * 1000:7.1f} ms"
              + (f", {'right' if row['correct'] else 'wrong'}: {text.strip()[:60]!r}" if want else ""), flush=True)
    return rows


def retrieval_recall(ks: tuple[int, ...]) -> dict:
    """Recall@k of the memory store alone on the scripted conversation (no LLM: answers are
    placeholders), each question asked after the turns before it were ingested."""
    from kvserve.memory.assembler import PastTurn, ingest
    from kvserve.memory.embed import MiniLM
    from kvserve.memory.store import MemoryStore
    store = MemoryStore(MiniLM())
    turns = script()
    hits = {f"facts@{k}": 0 for k in ks} | {f"turns@{k}": 0 for k in ks} | {f"either@{k}": 0 for k in ks}
    asked = 0
    for i, (msg, want) in enumerate(turns):
        if want is None:
            continue
        asked += 1
        ingest(store, None, [PastTurn(f"t{j}", m, "Noted.") for j, (m, _) in enumerate(turns[:i])])
        facts = store.search_facts(None, msg, max(ks))
        cases = store.search_cases(None, msg, max(ks))
        for k in ks:
            f = any(want.lower() in h.item.text.lower() for h in facts[:k])
            c = any(want.lower() in h.item.text.lower() for h in cases[:k])
            hits[f"facts@{k}"] += f
            hits[f"turns@{k}"] += c
            hits[f"either@{k}"] += f or c
    return {name: n / asked for name, n in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M-Instruct")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--budget-tokens", type=int, default=256)
    ap.add_argument("--last-turns", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--max-output-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None,
                    help="the server's CPU threads (OMP_NUM_THREADS); 1 on a machine shared with other work")
    ap.add_argument("--out", default="benchmarks/results/agent_memory")
    args = ap.parse_args()
    import openai
    recall = retrieval_recall((1, 3, 5))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for agent in ("naive", "memory"):  # a fresh server each: no KV or memory carried between them
            proc, url = start_server(args, os.path.join(tmp, f"{agent}.db"))
            try:
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
                results[agent] = run_agent(client, args, agent == "memory")
            finally:
                proc.terminate()
                proc.wait(60)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "agent_memory_cpu.json")
    with open(path, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "machine": platform.platform(),
                   "cpus": os.cpu_count(), "retrieval_recall": recall, "turns": results}, f, indent=1)

    def summary(rows):
        last = rows[-1]
        qs = [r for r in rows if "expected" in r]
        return (rows[9]["prompt_tokens"], rows[29]["prompt_tokens"], last["prompt_tokens"],
                statistics.median(r["ttft_s"] for r in rows[:10]) * 1000,
                statistics.median(r["ttft_s"] for r in rows[-10:]) * 1000,
                sum(r["correct"] for r in qs), len(qs))
    print(f"\nwrote {path}\n")
    print("| agent | prompt tokens t10 | t30 | t50 | TTFT median t1-10 (ms) | t41-50 (ms) | recall |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for agent, rows in results.items():
        a, b, c, t1, t2, ok, n = summary(rows)
        print(f"| {agent} | {a} | {b} | {c} | {t1:.0f} | {t2:.0f} | {ok}/{n} |")
    ratio = results["memory"][-1]["prompt_tokens"] / results["naive"][-1]["prompt_tokens"]
    print(f"\nmemory/naive prompt tokens at turn {NUM_TURNS}: {ratio:.0%}")
    print("retrieval recall@k (store only): " + ", ".join(f"{k} {v:.2f}" for k, v in recall.items()))


if __name__ == "__main__":
    main()
