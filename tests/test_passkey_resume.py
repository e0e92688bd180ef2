"""benchmarks/passkey.py --resume: a killed 128k run (hours) goes on where it stopped, trusting only whole records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import passkey  # noqa: E402


def _trial(depth: float, key: int, right: bool) -> dict:
    return {"target": 65536, "mode": "on", "depth": depth, "key": key, "right": right, "needle_layers": 30}


def test_resume_keeps_whole_records_and_drops_a_torn_line(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    a, b = _trial(0.025, 60494, True), _trial(0.075, 65125, False)
    log.write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n" + '{"target": 65536, "mo')  # killed mid-write
    done = passkey.done_trials(log, resume=True)
    assert set(done) == {(65536, "on", 0.025, "60494"), (65536, "on", 0.075, "65125")}
    assert done[(65536, "on", 0.075, "65125")]["right"] is False
    assert [json.loads(x) for x in log.read_text().splitlines()] == [a, b]  # the torn line is gone, not appended to


def test_a_run_without_resume_starts_over(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    log.write_text(json.dumps(_trial(0.025, 1, True)) + "\n")
    assert passkey.done_trials(log, resume=False) == {}
    assert not log.exists()  # an old run's trials are not mixed into a new one's
