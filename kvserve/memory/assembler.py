"""The context assembler: a turn's prompt under a token budget, from memory instead of history.

    system   pinned instructions                         always; the stable prefix the KV cache keeps
             + "Memory:" facts and past turns retrieved  by similarity to the input, facts also by
                                                         relation (multi-hop from the entities named)
    turns    the last `last_turns` turns, verbatim       newest kept first
    user     this turn's input                           always

Filled in that order of priority: instructions and input must fit (else the budget is refused),
then recent turns, newest first, then retrieved facts, then retrieved turns, each while the total
stays within the budget. The report says what was kept, what was retrieved and why, and what the
budget left out, so a client can see why the model knew (or did not know) something. The budget
counts the tokens of the texts themselves; the chat template adds its few tokens per message.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.errors import InvalidRequestError
from kvserve.memory.store import Fact, MemoryStore, extract_facts

_WORD = re.compile(r"[A-Z][a-z]+")


@dataclass(frozen=True)
class PastTurn:
    source: str  # the response id (or any id) the turn is stored under
    user: str
    assistant: str

    @property
    def text(self) -> str:
        return f"User: {self.user}\nAssistant: {self.assistant}"


def ingest(store: MemoryStore, tenant: str | None, turns: list[PastTurn]) -> int:
    """Index turns not indexed yet (as cases, and their stated facts); returns how many were new."""
    new = [(i, t) for i, t in enumerate(turns) if not store.has_case(tenant, t.source)]
    vectors = store.embed([t.text for _, t in new]) if new else []  # one batch, not one call per turn
    for (i, t), vec in zip(new, vectors):
        store.add_case(tenant, t.source, t.text, i, vector=vec)
        for s, p, o in extract_facts(t.user):
            store.remember(tenant, s, p, o, t.source, i)
    return len(new)


def assemble(store: MemoryStore, tenant: str | None, instructions: str | None, turns: list[PastTurn], query: str,
             budget_tokens: int, count: Callable[[str], int], last_turns: int = 4,
             top_k: int = 4) -> tuple[list[dict], dict]:
    """(chat messages, report) for one turn; `turns` are the conversation so far, oldest first,
    and already ingested. `count` is the served tokenizer's token count of a text."""
    pinned = instructions or ""
    fixed = count(pinned) + count(query)
    if fixed > budget_tokens:
        raise InvalidRequestError("memory.budget_tokens", f"must cover the instructions and the input "
                                  f"({fixed} tokens), got {budget_tokens}")
    used, left_out = fixed, 0
    recent: list[PastTurn] = []
    for t in reversed(turns[len(turns) - last_turns:] if last_turns else []):
        n = count(t.user) + count(t.assistant)
        if used + n > budget_tokens:
            left_out += 1
            continue
        recent.insert(0, t)
        used += n
    retrieved, lines = [], []

    def take(kind: str, text: str, hit) -> None:
        nonlocal used, left_out
        n = count(text + "\n")
        if used + n > budget_tokens:
            left_out += 1
            return
        used += n
        lines.append(text)
        retrieved.append({"kind": kind, "text": text, "score": round(hit.score, 4), "why": hit.why,
                          "source": getattr(hit.item, "source", None)})

    seen: set[int] = set()
    facts = store.search_facts(tenant, query, top_k)
    for name in dict.fromkeys(_WORD.findall(query)):  # entities named in the input: follow their relations
        facts += store.related(tenant, name, max_hops=2, limit=top_k)
    for hit in facts:
        if isinstance(hit.item, Fact) and hit.item.id not in seen:
            seen.add(hit.item.id)
            take("fact", f"- {hit.item.text}", hit)
    kept = {t.source for t in recent}
    for hit in store.search_cases(tenant, query, top_k, exclude=kept):
        take("turn", f"- earlier: {hit.item.text}", hit)
    system = pinned + (("\n\n" if pinned else "") + "Memory:\n" + "\n".join(lines) if lines else "")
    messages = ([{"role": "system", "content": system}] if system else [])
    for t in recent:
        messages += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant}]
    messages.append({"role": "user", "content": query})
    report = {"budget_tokens": budget_tokens, "used_tokens": used, "recent_turns": len(recent),
              "retrieved": retrieved, "left_out": left_out}
    return messages, report
