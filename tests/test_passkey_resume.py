"""benchmarks/passkey.py --resume: a killed 128k run (hours) goes on where it stopped, trusting only whole records of
the same setup."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import passkey  # noqa: E402

SETUP = {"cache": 1024, "task": "passkey", "reread": None}


def _trial(depth: float, key, right: bool) -> dict:
    return {"target": 65536, "mode": "on", "depth": depth, "key": key, "right": right, "needle_layers": 30}


def _lines(log: Path) -> list:
    return [json.loads(x) for x in log.read_text().splitlines()]


def test_resume_keeps_whole_records_and_drops_a_torn_line(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    a, b = _trial(0.025, 60494, True), _trial(0.075, 65125, False)
    log.write_text(json.dumps({"setup": SETUP}) + "\n" + json.dumps(a) + "\n" + json.dumps(b) + "\n"
                   + '{"target": 65536, "mo')  # killed mid-write
    done = passkey.done_trials(log, True, SETUP)
    assert set(done) == {passkey.trial_key(65536, "on", 0.025, 60494), passkey.trial_key(65536, "on", 0.075, 65125)}
    assert done[passkey.trial_key(65536, "on", 0.075, 65125)]["right"] is False
    assert _lines(log) == [{"setup": SETUP}, a, b]  # the torn line is gone, not appended to


def test_a_kv_key_matches_after_its_round_trip_through_json(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    key = ("8f1c-key", "21aa-value")  # a Retrieve.KV key: a tuple in the run, a list in the file
    log.write_text(json.dumps(_trial(0.5, key, True)) + "\n")
    assert passkey.trial_key(65536, "on", 0.5, key) in passkey.done_trials(log, True, SETUP)


def test_another_setup_is_refused_not_mixed_in(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    log.write_text(json.dumps({"setup": SETUP}) + "\n" + json.dumps(_trial(0.5, 1, True)) + "\n")
    with pytest.raises(SystemExit, match="another setup.*'reread': \\(None, 1\\)"):
        passkey.done_trials(log, True, {**SETUP, "reread": 1})
    assert len(_lines(log)) == 2  # left as it was


def test_a_run_without_resume_starts_over(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    log.write_text(json.dumps(_trial(0.025, 1, True)) + "\n")
    assert passkey.done_trials(log, False, SETUP) == {}
    assert _lines(log) == [{"setup": SETUP}]  # an old run's trials are not mixed into a new one's
