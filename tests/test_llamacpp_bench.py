"""benchmarks/llamacpp_bench.py's arithmetic (the run itself needs llama.cpp's tools: hours to build, not here):
decode is compared at the same cache fill, and the roofline shares divide by the bytes each side reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import llamacpp_bench as lb  # noqa: E402


def test_decode_is_compared_at_the_same_fill_and_against_the_roofline():
    sc = {"decode@512": 40.0, "decode@2048": 30.0, "prefill@512": 200.0}
    ll = {"tg128@d0": 36.0, "tg128@d512": 32.0, "tg128@d2048": 20.0, "pp512@d0": 100.0, "pp512@d2048": 60.0}
    info = {"weight_bytes": 600e6, "kv_bytes_per_token_bf16": 100e3}
    r = lb.ratios(sc, ll, 36.0, info, 700_000_000)
    assert r["decode_ratio@512"] == pytest.approx(40 / 32)  # depth 512, not the empty cache's 36
    assert r["decode_ratio@2048"] == pytest.approx(30 / 20) and r["prefill_ratio"] == pytest.approx(2.0)  # empty cache
    # 36 GB/s over 600 MB + 512 x 100 kB = 55.3 tok/s for sinkchat; llama.cpp reads its own 700 MB + the same KV
    assert r["sinkchat_roofline_share@512"] == pytest.approx(40 / (36e9 / (600e6 + 512 * 100e3)))
    assert r["llama_roofline_share@2048"] == pytest.approx(20 / (36e9 / (700e6 + 2048 * 100e3)))
    assert 0 < r["llama_roofline_share@512"] < r["sinkchat_roofline_share@512"] < 1
    assert r["sinkchat_mb_per_token@512"] == pytest.approx(651.2)  # 600 MB + 512 x 100 kB
    assert r["llama_mb_per_token@2048"] == pytest.approx(904.8)


def test_llama_bench_rows_are_keyed_by_depth_too():
    """llama-bench runs the prompt test at every `-d` depth as well; the empty-cache one must not be overwritten by
    the last depth's (it was: the prefill ratio set sinkchat's empty-cache prefill against llama.cpp's at 2048)."""
    import json

    rows = [{"n_prompt": 512, "n_gen": 0, "n_depth": d, "avg_ts": pp} for d, pp in ((0, 100.0), (2048, 60.0))]
    rows += [{"n_prompt": 0, "n_gen": 128, "n_depth": d, "avg_ts": tg} for d, tg in ((0, 36.0), (512, 32.0))]
    got = lb.parse_llama_bench("build: x\n" + json.dumps(rows) + "\n")
    assert got == {"pp512@d0": 100.0, "pp512@d2048": 60.0, "tg128@d0": 36.0, "tg128@d512": 32.0}
    rows[0]["samples_ts"] = [97.0, 103.0, 100.0]  # one figure a round, as sinkchat has: the mean, not the best
    assert lb.parse_llama_bench(json.dumps(rows))["pp512@d0"] == 100.0


def test_each_side_keeps_its_best_round_and_the_spread_shows():
    rounds = [{"decode@512": 40.0, "prefill@512": 210.0}, {"decode@512": 44.0, "prefill@512": 190.0}]
    assert lb.best(rounds) == {"decode@512": 44.0, "prefill@512": 210.0}  # per figure, not one round's pair
    assert lb.spread([r["decode@512"] for r in rounds]) == "40-44" and lb.spread([40.0]) == "40"


def test_the_rounds_alternate_the_sides_and_the_table_takes_the_best(monkeypatch, tmp_path):
    """`measure` with the three probes replaced by scripted ones: every round runs each side once, in turn."""
    order: list[str] = []
    bws, lls, scs = iter([40.0, 44.0]), iter([30.0, 33.0]), iter([50.0, 45.0])

    def ll(bin_dir, model, t):
        order.append("llama")
        v = next(lls)
        return {"tg128@d0": v, "tg128@d512": v, "tg128@d2048": v / 2, "pp512@d0": 4 * v}

    def sc(model, t):
        order.append("sinkchat")
        v = next(scs)
        return {"decode@512": v, "decode@2048": v / 2, "prefill@512": 5 * v}

    monkeypatch.setattr(lb, "run_bandwidth", lambda t: order.append("bw") or next(bws))
    monkeypatch.setattr(lb, "llama_bench", ll)
    monkeypatch.setattr(lb, "sinkchat_bench", sc)
    monkeypatch.setattr(lb, "info", lambda m: {"weight_bytes": 400e6, "kv_bytes_per_token_bf16": 1e5})
    monkeypatch.setattr(lb, "llama_weight_bytes", lambda m: 500_000_000)
    (row,) = lb.measure([tmp_path / "m.gguf"], [2], 2, tmp_path)
    assert order == ["bw", "llama", "sinkchat", "bw", "sinkchat", "llama"]  # which side goes first alternates too
    assert row["bandwidth_gbs"] == 44.0 and row["decode_ratio@512"] == pytest.approx(50 / 33)
    assert row["prefill_ratio"] == pytest.approx(250 / 132) and row["spread"]["sinkchat_decode@512"] == "45-50"
