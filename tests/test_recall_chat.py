"""benchmarks/recall_chat.py's bookkeeping on a tiny random model with a recall memory: every fact planted is asked
at every checkpoint, a reply is scored right exactly when it contains the value (any case), the fact's stream range
is the value's tokens, and `recalled` says whether a block the question read holds them.

The model's own replies are noise, so the question turns are answered from a script (after the real turn has gone
through the engine): one reply holds the value, one does not; and the memory's tally of what the question read is
set to a block that holds the fact, or to one that does not, so the check is held to the stream ranges it reads.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import torch

from fakes import CharTokenizer, tiny_model
from sinkchat.api import Session
from sinkchat.config import CacheConfig, MemoryConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.memory.recall import RecallMemory
from sinkchat.memory.report import Recalled
from sinkchat.model.spec import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import recall_chat as rc  # noqa: E402

torch.set_num_threads(1)
TEXTS = [f"Passage {i}: the river ran past the mill and the miller counted sacks of grain until dusk. " * 2
         for i in range(6)]


def tiny_engine(root: Path | None) -> Engine:
    model = tiny_model("llama", layers=2, max_pos=1024)
    model.config.eos_token_id = 96
    mem = (RecallMemory.for_spec(MemoryConfig("on", 64, 8, 2, 64), ModelSpec.from_model(model), root)
           if root is not None else None)
    return Engine(model, CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=320),
                  SamplingConfig(temperature=0, max_tokens=3, repetition_penalty=1.0), memory=mem)


def block_of(mem: Any, at: int, holding: bool) -> int:
    """A stored block that holds stream index `at` (holding) or one that does not."""
    return next(b for b, w in mem.store.where.items() if (w.first <= at < w.last) == holding)


def scripted_chat(eng: Engine, conv: dict[str, Any]) -> Any:
    """The real turn through the engine; question turns answered from the script, and the memory's tally of what
    the question read set: the code's own block, another block for the name, left as it was for the others."""
    sess, kinds = Session(eng), {q: k for k, q in rc.QUESTIONS.items()}
    checked: list[bool] = []

    def say(text: str) -> str:
        if text.startswith("Here is a passage") and not checked:  # the plant is still in the window: its spans
            for kind, (a, b) in conv["spans"].items():
                ids = [t for t, i in zip(eng.ledger.ids, eng.ledger.abs_index) if a <= i < b]
                assert eng.tokenizer.decode(ids) == conv["facts"][kind]
            checked.append(True)
        reply = sess.chat(text, max_tokens=3)
        kind = kinds.get(text)
        if kind == "code":
            eng.memory.recalled = {block_of(eng.memory, conv["spans"]["code"][0], True): 2}
            eng.memory.reread = set()  # scripted: what the reply recalled is only the above
            return f"Your code is {conv['facts']['code'].lower()}."
        if kind == "name":
            eng.memory.recalled = {block_of(eng.memory, conv["spans"]["name"][0], False): 5}
            eng.memory.reread = set()
            return "I do not remember your name."
        return reply

    return say


def test_facts_are_planted_asked_scored_and_their_recall_checked(tmp_path: Path) -> None:
    eng = tiny_engine(tmp_path / "mem")
    facts = rc.new_facts(random.Random(3))
    conv: dict[str, Any] = {}
    rc.converse(eng, scripted_chat(eng, conv), facts, TEXTS, [700, 1200], out=conv)
    trials = conv["trials"]
    assert [(t["target"], t["fact"]) for t in trials] == [(n, k) for n in (700, 1200) for k in facts]
    assert all(t["at"] >= t["target"] and not t["in_window"] for t in trials)  # asked past the checkpoint, evicted
    for t in trials:
        assert t["value"] == facts[t["fact"]]
        assert t["span"][1] - t["span"][0] == len(t["value"])  # one token per character
    by = {(t["target"], t["fact"]): t for t in trials}
    for n in (700, 1200):
        assert by[n, "code"]["right"] and by[n, "code"]["recalled"] and by[n, "code"]["recalled_layers"] == 2
        assert not by[n, "name"]["right"] and by[n, "name"]["recalled"] is False
        assert by[n, "name"]["recalled_layers"] == 0 and len(by[n, "name"]["recalled_blocks"]) == 1
    assert len(conv["filler"]) >= 3 and conv["tokens"] == eng.ledger.seen
    eng.memory.close()


def test_memory_off_records_no_recall_and_scoring_is_a_case_insensitive_substring(tmp_path: Path) -> None:
    eng = tiny_engine(None)
    facts = {"name": "Ada Byron", "code": "K7Q2ZD", "date": "May 3, 1990", "fruit": "fig"}
    answers = {"name": "You are ada byron.", "code": "K7Q2Z", "date": "May 3, 1990!", "fruit": "figs"}
    kinds = {q: k for k, q in rc.QUESTIONS.items()}

    def say(text: str) -> str:  # the turns go into the cache; the replies come from the script
        list(eng.add_message("user", text))
        return answers[kinds[text]] if text in kinds else "ok"

    conv = rc.converse(eng, say, facts, TEXTS, [400])
    got = {t["fact"]: (t["right"], t["recalled"], t["recalled_blocks"]) for t in conv["trials"]}
    assert got == {"name": (True, None, None), "code": (False, None, None), "date": (True, None, None),
                   "fruit": (True, None, None)}


def test_a_recalled_block_counts_only_when_it_holds_a_token_of_the_fact() -> None:
    blocks = [Recalled(1, 10, 18, 0.0, 3, 30), Recalled(2, 30, 38, 0.0, 7, 30)]
    assert rc.overlapping(blocks, (18, 20)) == []
    assert rc.overlapping(blocks, (8, 10)) == []
    assert [r.bid for r in rc.overlapping(blocks, (17, 19))] == [1]
    assert [r.bid for r in rc.overlapping(blocks, (5, 40))] == [1, 2]
