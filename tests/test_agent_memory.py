"""An agent's earlier tasks stay recallable with the memory on: each task still starts from the checkpoint's cache
(`apps/agent/checkpoint.py`), but the finished task is set aside into the recall memory (an eviction) instead of
dropped, so every token stays in the window, the memory, or a `forgotten` event."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fakes import CharTokenizer, tiny_model
from sinkchat.apps.agent.checkpoint import TaskCheckpoint
from sinkchat.core.events import EvictionEvent, PrefillEvent
from test_memory import IDS, engine, memory


def test_a_finished_task_goes_to_the_memory_and_the_next_one_starts_from_the_checkpoint(tmp_path: Path) -> None:
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m"))
    list(eng.feed_ids(IDS[:12]))  # the system prompt and examples
    cp = TaskCheckpoint()
    assert not cp.restore(eng)  # the first task records the checkpoint
    start = eng.cache.length
    list(eng.feed_ids(IDS[12:35]))  # task 1: 23 tokens, all still in the window
    task1 = list(eng.ledger.abs_index[start:])
    assert eng.ledger.evicted == 0
    assert cp.restore(eng)
    assert eng.cache.length == start and eng.ledger.abs_index == list(range(start))
    assert [e.count for e in cp.events if isinstance(e, EvictionEvent)] == [23]
    held = sorted({int(a) for b in eng.memory.index_ids for a in eng.memory.store.read(b).abs_index}
                  | {a for e in eng.memory.queue for a in e[3]})
    assert held == task1 and eng.ledger.evicted == eng.memory.tokens == 23
    list(eng.feed_ids(IDS[35:45]))  # task 2: new stream indices after task 1's, and task 1 recallable
    assert eng.ledger.abs_index[start:] == list(range(35, 45))
    assert eng.memory.chosen[0] and eng.memory.held == eng.memory.queued == 7
    assert eng.cache.layers[0].used == 8 * len(eng.memory.chosen[0])  # blocks only: task 1's tail is not the
    # window's continuation, so it is not attended as one (it waits to be recalled in a block)
    assert cp.restore(eng) and eng.ledger.evicted == eng.memory.tokens + eng.memory.forgotten == 33


def test_without_the_memory_a_finished_task_is_rolled_back_as_before(tmp_path: Path) -> None:
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, None)
    list(eng.feed_ids(IDS[:12]))
    cp = TaskCheckpoint()
    cp.restore(eng)
    list(eng.feed_ids(IDS[12:35]))
    assert cp.restore(eng) and not cp.events
    assert eng.cache.length == 12 and eng.ledger.evicted == 0 and eng.ledger.seen == 12


@pytest.mark.parametrize("with_memory", [True, False])
def test_a_task_that_overflows_the_window_does_not_move_the_checkpoint(tmp_path: Path, with_memory: bool) -> None:
    """The agent takes its checkpoint before anything is fed. Before: a task longer than the window (any eviction
    since the checkpoint) made the next `restore` take a new checkpoint where the cache then stood, after that
    task; the next task was fed on top of it, overflowed in turn, and no task started fresh again (a 2h15
    `--memory on` soak: the window full of earlier tasks' calls, which the model copied until its steps ran out).
    Evictions that leave the checkpoint's slots alone leave the checkpoint."""
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m") if with_memory else None)
    cp = TaskCheckpoint()
    assert not cp.restore(eng) and cp.length == 0  # the first task records it: nothing fed yet
    list(eng.feed_ids(IDS[:60]))  # task 1: 60 tokens through the 40-slot cache
    assert eng.ledger.evicted > 0
    for first in (60, 100):  # task 2 and task 3 both start from the checkpoint
        assert cp.restore(eng) and eng.cache.length == 0 and cp.taken == 1
        list(eng.feed_ids(IDS[first % 150 : first % 150 + 40]))
    assert cp.restore(eng) and eng.cache.length == 0
    list(eng.feed_ids(IDS[:4]))
    pinned = TaskCheckpoint()  # a checkpoint within the sinks, which the sink policy never evicts, holds too
    assert not pinned.restore(eng) and pinned.length == 4
    evicted = eng.ledger.evicted
    list(eng.feed_ids(IDS[4:60]))
    assert eng.ledger.evicted > evicted and pinned.restore(eng) and eng.cache.length == 4 and pinned.taken == 1


def test_a_checkpoint_whose_slots_were_evicted_is_taken_again(tmp_path: Path) -> None:
    """Only when the slots before the checkpoint are gone (the examples evicted by a long task) does the task go on
    from where the cache stands, with a new checkpoint there."""
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, None)
    list(eng.feed_ids(IDS[:12]))
    cp = TaskCheckpoint()
    cp.restore(eng)
    list(eng.feed_ids(IDS[12:60]))  # evicts slots from 4 on: the checkpoint's own
    assert not cp.restore(eng) and cp.taken == 2 and cp.length == eng.cache.length
    assert cp.restore(eng) and cp.taken == 2  # nothing evicted since: the new checkpoint holds


def agent_engine(tmp_path: Path, with_memory: bool, capacity: int = 256, few_shot: bool = False) -> tuple[Any, Any]:
    """A real Engine (1-layer random model, the ChatML-like fake template) and a JSON-protocol agent on it."""
    from sinkchat.apps.agent.agent import Agent, build_default_tools
    from sinkchat.apps.agent.tools.workspace import Workspace
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine

    model = tiny_model("llama", layers=1, score_std=3.0, max_pos=4096)
    mem = memory(model, tmp_path / "m") if with_memory else None
    eng = Engine(model, CharTokenizer(), CacheConfig("sink", 4, capacity, 0),
                 SamplingConfig(temperature=0, max_tokens=8), memory=mem)
    ws = Workspace(tmp_path / "ws", create=True)
    agent = Agent(eng, build_default_tools(ws), ws, system_prompt="You are terse.", constrain=False,
                  few_shot=few_shot, protocol="json")
    return eng, agent


@pytest.mark.parametrize("with_memory", [True, False])
def test_tasks_start_after_the_system_prompt_which_is_fed_once(tmp_path: Path, with_memory: bool) -> None:
    """The agent feeds its system prompt alone and takes the task checkpoint after it (`Engine.feed_system`).
    Before, the checkpoint was at slot 0: every task fed the prompt again, and with the memory on each set-aside
    moved the sinks and the prompt into the memory (a copy a task) and the stream's start out of the window, so
    the sink gauge had nothing to measure."""
    eng, agent = agent_engine(tmp_path, with_memory)
    system = eng.encode(eng.conv.system_block())
    for task in ("one", "two", "three"):
        events = list(agent.run("task " + task, 2))
        first = next(e for e in events if isinstance(e, PrefillEvent))
        assert agent.checkpoint.length == eng.ledger.pinned == len(system) > 4
        assert first.cache_len - first.tokens == (0 if task == "one" else len(system))  # never fed again
        assert eng.ledger.ids[: len(system)] == system and eng.ledger.holds_stream_start()
    assert agent.checkpoint.taken == 1
    if with_memory:
        mem = eng.memory
        held = {int(a) for b in mem.index_ids for a in mem.store.read(b).abs_index} | {a for e in mem.queue
                                                                                     for a in e[3]}
        assert held and min(held) >= len(system)  # only the tasks' own tokens were set aside
        assert eng.ledger.evicted == mem.tokens + mem.forgotten


def test_an_interrupted_system_prompt_is_taken_back_and_a_fed_conversation_is_left_alone(tmp_path: Path) -> None:
    eng, _ = agent_engine(tmp_path, False)
    feed = eng.feed_system()
    next(feed)
    assert eng.cache.length > 0
    feed.close()  # Ctrl-C between chunks
    assert eng.cache.length == 0 and eng.conv.fed == "" and eng.ledger.pinned == 0 and eng.message_taken_back
    list(eng.feed_system())
    n = eng.cache.length
    assert n and eng.conv.fed == eng.conv.system_block() and eng.ledger.pinned == n
    list(eng.feed_system())  # something was fed: nothing more
    assert eng.cache.length == n
    list(eng.add_message("user", "hi"))
    assert eng.conv.fed == eng.conv._render(eng.conv.messages, True)  # the next delta extended the system block


def held_indices(mem: Any) -> set[int]:
    """Stream indices of every token the memory holds: its blocks and its queue."""
    return ({int(a) for b in mem.index_ids for a in mem.store.read(b).abs_index}
            | {a for e in mem.queue for a in e[3]})


def test_the_examples_fed_for_each_task_are_let_go_not_kept(tmp_path: Path) -> None:
    """The agent's example turns are fed again for every task; the memory lets them go when they leave the window
    (reported forgotten, "not kept") and keeps the tasks' own tokens. Kept, every task added one more copy, and the
    bundled model copied the calls and answers in them (agent_tasks 43-48 with the memory on: 0/6 right, 3/6 off).
    The 512-token cache cannot hold the character-level examples, so they overflow it while they are fed, too."""
    from sinkchat.core.events import ForgottenEvent

    eng, agent = agent_engine(tmp_path, True, capacity=512, few_shot=True)
    let_go: set[int] = set()
    for task in ("one", "two"):
        for e in agent.run("task " + task, 1):
            if isinstance(e, ForgottenEvent):
                assert e.reason == "not kept"
                let_go |= set(range(e.first, e.last))
    mem = eng.memory
    held = held_indices(mem)
    assert let_go and held and not held & let_go
    assert eng.ledger.evicted == mem.tokens + mem.forgotten and mem.forgotten == len(let_go)
    text = "".join(eng.tokenizer.decode(mem.store.read(b).ids.tolist()) for b in mem.index_ids)
    assert "Task: task one" in text and "Tool result" not in text.split("Task: task one")[0]  # examples gone
    first, last = eng.unkept[-1]  # task two's examples
    assert first < last < eng.ledger.seen  # closed when they were in, not left open over the task after them


def test_an_open_range_is_closed_when_feeding_the_examples_is_cut(tmp_path: Path) -> None:
    eng, agent = agent_engine(tmp_path, True, capacity=512, few_shot=True)
    run = agent.run("task one", 1)
    next(e for e in run if isinstance(e, EvictionEvent) and eng.unkept)  # the examples overflow the cache
    assert eng.unkept[-1][1] > eng.ledger.seen  # open while they are fed
    run.close()  # Ctrl-C while the examples are fed
    assert eng.unkept and all(b <= eng.ledger.seen for _, b in eng.unkept)  # no range left open over what follows


def test_ranges_the_cache_no_longer_holds_are_dropped(tmp_path: Path) -> None:
    """`keep_out` keeps past ranges only while the cache holds a token of them: set aside, a task's examples are
    gone. Before, a range stayed while it ended past the stream index of slot 4, which a set-aside never moves
    (the system prompt there), so one range a task piled up over a soak and every eviction scanned them all."""
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m"))
    list(eng.feed_ids(IDS[:12]))  # the system prompt
    for first in (12, 24, 36):  # three tasks: examples, then set aside
        eng.keep_out(first)
        list(eng.feed_ids(IDS[first : first + 8]))
        eng.keep_out(first, first + 8)
        list(eng.feed_ids(IDS[first + 8 : first + 12]))
        assert eng.unkept == [(first, first + 8)]  # the earlier tasks' ranges dropped
        eng.set_aside(12)
    assert eng.ledger.evicted == eng.memory.tokens + eng.memory.forgotten and eng.memory.forgotten == 24
