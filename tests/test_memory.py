"""kvserve.memory: facts (CRUD, single-valued updates, persistence), past turns found by meaning
with all-MiniLM-L6-v2, relations followed over several hops, tenants kept apart, rule-based fact
extraction, and the context assembler's budget."""
from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.memory.assembler import PastTurn, assemble, ingest
from kvserve.memory.embed import MiniLM
from kvserve.memory.store import MemoryStore, extract_facts

A, B = "tenant-a", "tenant-b"
DISTRACTORS = [("user", "favourite film", "Alien"), ("Paris", "is capital of", "France"),
               ("user", "work at", "a bakery"), ("user", "drive", "a red bicycle"),
               ("Jupiter", "is", "the largest planet"), ("user", "speak", "Portuguese")]


@pytest.fixture(scope="module")
def embed():
    return MiniLM()


@pytest.fixture()
def store(embed, tmp_path):
    return MemoryStore(embed, str(tmp_path / "memory.db"))


def test_fact_crud_and_persistence(store, embed):
    fid = store.add_fact(A, "user", "dog", "Biscuit", source="resp_1", turn=0)
    store.add_fact(A, "user", "live in", "Lisbon")
    assert [(f.subject, f.predicate, f.object, f.source, f.turn) for f in store.facts(A, predicate="DOG")] == \
        [("user", "dog", "Biscuit", "resp_1", 0)]
    assert store.update_fact(A, fid, "Pretzel") and store.facts(A, predicate="dog")[0].object == "Pretzel"
    store.remember(A, "user", "live in", "Porto")  # single-valued: replaces Lisbon
    assert [f.object for f in store.facts(A, predicate="live in")] == ["Porto"]
    reopened = MemoryStore(embed, store.path)
    assert {f.object for f in reopened.facts(A)} == {"Pretzel", "Porto"}
    assert store.delete_fact(A, fid) and not store.delete_fact(A, fid)
    assert [f.object for f in reopened.facts(A)] == ["Porto"]


def test_retrieval_by_meaning(store):
    for f in DISTRACTORS:
        store.add_fact(A, *f)
    store.add_fact(A, "user", "dog", "Biscuit")
    (top, *_) = store.search_facts(A, "What is the name of my pet?", k=3)
    assert top.item.object == "Biscuit" and "cosine" in top.why
    store.add_case(A, "r1", "User: I am planning a trip to Kyoto in April.\nAssistant: Lovely, cherry blossoms!")
    store.add_case(A, "r2", "User: How do I bake sourdough?\nAssistant: Start with a levain.")
    assert store.add_case(A, "r2", "again") is None and store.has_case(A, "r2")
    assert store.search_cases(A, "When is my Japan holiday?", k=1)[0].item.source == "r1"
    assert [h.item.source for h in store.search_cases(A, "Japan holiday", k=5, exclude={"r1"})] == ["r2"]


def test_relations_over_several_hops(store):
    store.add_fact(A, "Rex", "is owned by", "Sam")
    store.add_fact(A, "Sam", "lives in", "Oslo")
    store.add_fact(A, "Oslo", "is in", "Norway")
    store.add_fact(A, "Mia", "lives in", "Rome")
    two = store.related(A, "rex", max_hops=2)
    assert [(h.item.subject, h.item.object, h.score) for h in two] == [("Rex", "Sam", 1.0), ("Sam", "Oslo", 0.5)]
    assert {h.item.object for h in store.related(A, "Rex", max_hops=3)} == {"Sam", "Oslo", "Norway"}
    assert store.related(A, "Nobody") == []


def test_tenants_are_apart(store):
    store.add_fact(A, "user", "password hint", "blue whale")
    store.add_case(A, "r1", "User: my secret is blue whale")
    store.add_fact(A, "Rex", "is owned by", "Sam")
    assert store.facts(B) == [] and store.search_facts(B, "password hint") == []
    assert store.search_cases(B, "secret") == [] and not store.has_case(B, "r1")
    assert store.related(B, "Rex") == []
    assert not store.delete_fact(B, store.facts(A)[0].id) and len(store.facts(A)) == 2


@pytest.mark.parametrize("text,want", [
    ("My dog is called Biscuit. I live in Lisbon, near the sea.", [("user", "dog", "Biscuit"),
                                                                   ("user", "live in", "Lisbon")]),
    ("I work at Acme Corp", [("user", "work at", "Acme Corp")]),
    ("my favourite colour is teal!", [("user", "favourite colour", "teal")]),
    ("What is my dog called?", []),
])
def test_rule_based_extraction(text, want):
    assert extract_facts(text) == want


def _words(s: str) -> int:
    return len(s.split())


def test_assembler_keeps_to_the_budget_and_finds_the_planted_fact(store):
    turns = [PastTurn("r0", "Hi! My sister is called Ingrid.", "Nice to meet you.")]
    turns += [PastTurn(f"r{i}", f"Tell me fact number {i} about the ocean.", "The ocean is deep. " * 5)
              for i in range(1, 12)]
    assert ingest(store, A, turns) == 12 and ingest(store, A, turns) == 0
    msgs, report = assemble(store, A, "You are helpful.", turns, "What is my sister's name?", 120, _words,
                            last_turns=3, top_k=3)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("You are helpful.")
    assert msgs[-1] == {"role": "user", "content": "What is my sister's name?"}
    assert sum(_words(m["content"]) for m in msgs) <= report["used_tokens"] + 2 <= 120 + 2  # "Memory:" header
    assert "Ingrid" in msgs[0]["content"]
    assert any(r["kind"] == "fact" and "Ingrid" in r["text"] for r in report["retrieved"])
    assert report["recent_turns"] == 3 and [m["content"] for m in msgs[1:7:2]] == [t.user for t in turns[-3:]]
    with pytest.raises(InvalidRequestError) as e:
        assemble(store, A, "word " * 50, turns, "q", 20, _words)
    assert e.value.field == "memory.budget_tokens"
