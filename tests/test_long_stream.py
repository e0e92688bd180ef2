"""benchmarks/long_stream.py: its verdict judges the passes it measured, and a stream really is continuous.

The full run (~4M tokens a policy) is hours; here the verdict logic is checked on made-up passes, and one tiny
stream on a fake engine checks that every token after the first is scored exactly once across pass boundaries."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import long_stream as ls  # noqa: E402


def _stream(name: str, ppls: list[float]) -> ls.Stream:
    return ls.Stream(name, [ls.Pass(i + 1, nll_sum=math.log(p) * 1000, targets=1000) for i, p in enumerate(ppls)])


def test_the_verdict_passes_a_flat_stream_and_fails_a_drifting_one():
    flat = {"sink": _stream("sink", [20.0, 18.0, 18.05, 17.98, 18.1])}
    assert ls.verdict(flat, 0.01)[0] == "PASS"  # pass 1 (cold start) is not judged
    drift = {"sink": _stream("sink", [20.0, 18.0, 18.05, 18.3])}  # +1.7% at pass 4
    v, why = ls.verdict(drift, 0.01)
    assert v == "FAIL" and "pass 4" in why
    assert ls.verdict({"sink": _stream("sink", [20.0, 18.0])}, 0.01)[0] == "INCONCLUSIVE"
    assert ls.verdict({"window": _stream("window", [30.0, 40.0, 40.0])}, 0.01)[0] == "INCONCLUSIVE"


class _Engine:
    """Takes ids in blocks of 3 and returns uniform logits: every target's NLL is log(V), so a pass's ppl is V
    whatever it scored, and `targets` counts exactly what was scored."""

    max_chunk = 3
    V = 7

    def feed_ids(self, block: list[int], all_logits: bool = False):
        yield torch.zeros(len(block), self.V)


def test_a_pass_scores_every_token_once_across_pass_boundaries():
    eng, ids = _Engine(), [1, 2, 3, 4, 5, 6, 0, 1]
    first, second = ls.Pass(1), ls.Pass(2)
    prev = ls.feed_pass(eng, ids, None, first)
    ls.feed_pass(eng, ids, prev, second)
    assert first.targets == len(ids) - 1  # nothing before the first token
    assert second.targets == len(ids)  # its first token scored by the previous pass's last logits
    assert math.isclose(second.ppl, _Engine.V) and math.isclose(first.ppl, _Engine.V)


def _run(tmp_path: Path, out: str, *extra: str) -> dict:
    import json

    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text("The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. " * 6)
    argv = ["long_stream.py", "--text", str(text), "--cache", "48", "--chunk", "16", "--threads", "1",
            "--policies", "sink,window", "--out", str(tmp_path / out), *extra]
    old, sys.argv = sys.argv, argv
    try:
        rc = ls.main()
    finally:
        sys.argv = old
    data = json.loads((tmp_path / out / "long_stream.json").read_text())
    return {"rc": rc, "passes": data["policies"]["sink"], "window": data["policies"].get("window", [])}


def test_a_resumed_run_continues_the_stream_exactly(tmp_path):
    """An interrupted multi-hour run goes on from its per-pass snapshots: stopping both policies after pass 2 and
    resuming to pass 4 gives every pass the same NLL sum, bit for bit, as one uninterrupted run (the cache, the
    ledger and the logits that score the next pass's first token all restored), and evictions keep counting from
    each policy's own start (the window's starts after the sink policy's evictions: its offset is restored too).
    A resume that does not match the saved run is refused in one line."""
    whole = _run(tmp_path, "whole", "--passes", "4")
    _run(tmp_path, "split", "--passes", "2")
    resumed = _run(tmp_path, "split", "--passes", "4", "--resume")
    assert whole["rc"] == resumed["rc"] and len(whole["passes"]) == len(resumed["passes"]) == 4
    assert len(whole["window"]) == len(resumed["window"]) == 4
    for a, b in zip(whole["passes"] + whole["window"], resumed["passes"] + resumed["window"]):
        assert (a["index"], a["nll_sum"], a["targets"], a["evicted"]) == (b["index"], b["nll_sum"], b["targets"],
                                                                          b["evicted"])
    assert whole["passes"][3]["evicted"] > whole["passes"][1]["evicted"] > 0
    assert 0 < whole["window"][0]["evicted"] < whole["passes"][3]["evicted"]  # its own count, not the sum
    import pytest

    with pytest.raises(SystemExit, match="saved by another run"):
        _run(tmp_path, "split", "--passes", "5", "--resume", "--chunk", "8")
