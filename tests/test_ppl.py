"""`sinkchat ppl` on a real long text that ships with the OS (the GPL-3 text in Debian's base-files)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

TEXT = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def ppl_run(tmp_path_factory):
    if not TEXT.is_file():
        pytest.skip("GPL-3 text not present")
    out = tmp_path_factory.mktemp("ppl")
    cmd = [sys.executable, "-m", "sinkchat.cli", "ppl", str(TEXT), "--cache", "128",
           "--policy", "sink", "--policy", "window", "--policy", "recompute", "--tokens", "1100", "--bin", "100",
           "--recompute-every", "10", "--json", "--plot", str(out / "ppl.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout), out


def test_window_collapses_after_first_eviction_and_sink_does_not(ppl_run):
    summary, _ = ppl_run
    pols = summary["policies"]
    sink, window = pols["sink"], pols["window"]
    # identical until the first eviction at token ~128 (same tokens, same positions): first bin equal
    assert sink["bins"][0] == pytest.approx(window["bins"][0], rel=1e-3)
    # after it, the naive window is worse in (nearly) every later bin, and clearly worse overall
    later = list(zip(sink["bins"][2:], window["bins"][2:]))
    assert sum(w > 1.1 * s for s, w in later) >= 0.8 * len(later)
    assert window["ppl"] > 1.3 * sink["ppl"]


def test_sink_is_within_a_few_percent_of_recompute(ppl_run):
    summary, _ = ppl_run
    pols = summary["policies"]
    assert summary["recompute_targets"] >= 100  # every 10th of 1,100: the oracle is ~80% of the run
    ratio = pols["sink"]["sampled_ppl"] / pols["recompute"]["sampled_ppl"]
    assert ratio < 1.05, ratio
    assert pols["window"]["sampled_ppl"] / pols["recompute"]["sampled_ppl"] > 1.3
    assert all(math.isfinite(v["ppl"]) for v in pols.values())


def test_plot_written(ppl_run):
    _, out = ppl_run
    png = out / "ppl.png"
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


def test_recompute_windows_start_with_the_bos_the_stream_starts_with():
    """A model trained with a BOS first (Gemma) is scored on windows that start with it, as llama.cpp's
    perplexity does per chunk; every window holds `capacity` tokens and ends right before its target."""
    from types import SimpleNamespace

    import torch

    from sinkchat.apps.evals.ppl import recompute_nll

    seen = []

    def model(input_ids, **kw):
        seen.append(input_ids[0].tolist())
        return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], 50))

    ids = [1] + list(range(10, 40))
    recompute_nll(model, ids, capacity=8, every=4, device="cpu", bos=1)
    assert seen and all(w[0] == 1 and len(w) == min(8, t) for w, t in zip(seen, range(4, len(ids), 4)))
    assert all(w[1:] == ids[t - len(w) + 1 : t] for w, t in zip(seen, range(4, len(ids), 4)))
    seen.clear()
    recompute_nll(model, ids, capacity=8, every=4, device="cpu")  # no BOS: the plain last 8 tokens
    assert seen[-1] == ids[28 - 8 : 28]


def test_the_table_shows_recompute_only_on_its_sample_and_the_last_bin_as_it_is(ppl_run):
    """recompute scores every 10th target: its bins and overall figure cover a sample, so the table leaves them out
    ("—") and shows it on the "sampled" row beside the others' figures on the same targets; the last bin is labelled
    with the targets it really holds (1,099 of 1,100 tokens: 1000-1099, not 1000-1100)."""
    from sinkchat.apps.evals.ppl import format_table

    summary, _ = ppl_run
    lines = format_table(summary, 100).splitlines()
    overall = next(line for line in lines if line.startswith("overall")).split()
    assert overall[-1] == "—" and float(overall[1]) == pytest.approx(summary["policies"]["sink"]["ppl"], abs=0.006)
    assert lines[-4].startswith("1000-1099") and lines[-1].startswith("sampled") and "—" not in lines[-1]
