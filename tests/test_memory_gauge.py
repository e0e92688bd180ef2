"""The sink gauge's third figure (issue 30, item 1): the share of the newest query's attention on the recalled
memory blocks, beside the share on the stream's first slots and on its newest ones.

Every path that computes the gauge is held to an fp64 softmax computed here from the cache's keys and the step's
own queries (the C step's [L, 3] shares; transformers' forward through the gauge's hooks); with the memory off the
third figure is exactly 0 and the first two are what they were, bit for bit; the three shares never sum above 1
once the stream holds 2n slots. Then where users read it: the status line and toolbar (`sink 0.42 · mem 0.11`),
/stats, the soak's records and report, serve's `x_sinkchat`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from test_memory import IDS, _packed, engine, memory, needs_native
from sinkchat.core.engine import Engine
from sinkchat.core.events import GaugeEvent
from sinkchat.decode import select
from sinkchat.model.spec import ModelSpec

torch.set_num_threads(1)


def shares64(spec: Any, layer: int, q: torch.Tensor, keys: torch.Tensor, pos: int, used: int, n: int
             ) -> tuple[float, float, float]:
    """(first n stream slots, newest n stream slots, recalled slots), mean over heads, of pre-RoPE query q [H*D]
    at RoPE position `pos` against keys [H_kv, used + stream, D] ([recalled | stream]): rotated and softmaxed in
    fp64 here, summed over each range (the newest never reach into the recalled slots)."""
    H, Hkv, D = spec.n_heads, spec.n_kv, spec.head_dim
    q = q.reshape(H, D).double()
    ang = pos * spec.inv_freq(layer).double()  # [D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])  # [D]
    q = q * cos + torch.cat([-q[:, D // 2 :], q[:, : D // 2]], dim=-1) * sin  # rotate-half RoPE
    scores = torch.einsum("hgd,hld->hgl", q.view(Hkv, H // Hkv, D), keys.double()) * spec.layers[layer].scaling
    p = torch.softmax(scores, dim=-1).reshape(H, -1)  # [H, used + stream]
    total = p.shape[-1]
    return (float(p[:, used : used + n].sum(-1).mean()), float(p[:, max(used, total - n) :].sum(-1).mean()),
            float(p[:, :used].sum(-1).mean()))


def fp64_shares(eng: Engine, i: int, n: int) -> tuple[float, float, float]:
    """`shares64` of global layer i for the last token fed: its captured query against what it attended in the
    layer's buffer (the `used` recalled slots, then the stream)."""
    g = eng.gauge
    layer = eng.cache.layers[g.layers[i]]
    L, used = eng.cache.length, layer.used
    keys = layer.keys[0, :, layer.base - used : layer.base + L]  # [H_kv, used + L, D]
    return shares64(eng.spec, g.layers[i], g.queries[i], keys, L - 1, used, n)


def one_token(eng: Engine, tok: int) -> torch.Tensor | None:
    """Feed `tok` alone with the gauge armed; the fast step's shares [L, 3] (None: transformers' forward ran)."""
    eng.gauge.armed = True
    try:
        list(eng.feed_ids([tok]))
    finally:
        eng.gauge.armed = False
    return None if eng.gauge.shares is None else eng.gauge.shares[1].clone()


def both_events(eng: Engine) -> tuple[GaugeEvent, GaugeEvent]:
    """The gauge of the last token as the step measured it, and as the hooks' recomputation gives it."""
    saved = list(eng.gauge.queries)
    from_step = eng.measure_gauge()
    eng.gauge.queries = saved
    eng.gauge.discard_shares()
    return from_step, eng.measure_gauge()


@needs_native
def test_the_c_steps_recalled_share_is_the_fp64_softmax_over_the_region(tmp_path: Path) -> None:
    """With blocks recalled, every column of the C step's gauge equals the fp64 softmax's sum over its range, in
    every layer at every token (fp32 cache: within 1e-4, the existing native gauge tests' tolerance); the hooks'
    recomputation (transformers' path) gives the same figures; the event's `memory` is their mean over layers."""
    model = _packed()
    eng = engine(model, memory(model, tmp_path / "m"), step=select(model, "native"), kv="float32")
    list(eng.feed_ids(IDS[:100]))
    n, seen = eng.gauge_n, []
    for tok in IDS[100:110]:
        c = one_token(eng, tok)  # [L, 3]
        assert c is not None and c.shape == (2, 3)
        used = eng.cache.layers[0].used
        assert used > 0 and eng.cache.length >= 2 * n
        ref = torch.tensor([fp64_shares(eng, i, n) for i in range(2)], dtype=torch.float64)  # [L, 3]
        torch.testing.assert_close(c.double(), ref, rtol=0, atol=1e-4)
        assert float((c.sum(1) - 1).max()) <= 1e-5  # disjoint ranges: never above 1
        from_step, from_hooks = both_events(eng)
        assert from_step.memory == pytest.approx(float(ref[:, 2].mean()), abs=1e-4)
        assert from_step.memory_per_layer == pytest.approx(from_hooks.memory_per_layer, abs=1e-4)
        assert from_step.share + from_step.recent + from_step.memory <= 1 + 1e-5
        seen.append(from_step.memory)
    assert min(seen) > 0.005 and len({round(v, 4) for v in seen}) > 1  # a real share, and it moves


@needs_native
@pytest.mark.parametrize("pos", [0, 1, 2, 5, 30])
def test_the_c_step_counts_each_slot_once_at_any_stream_length(pos: int) -> None:
    """The step called on buffers of random keys with 5 of 7 region slots recalled, at stream lengths below,
    at and past the gauge's 4 slots: each column is the fp64 softmax's sum over its own range, and the recalled
    slots are never counted again as the first or the newest (each of those plus the recalled share <= 1)."""
    model = _packed()
    step, spec = select(model, "native"), ModelSpec.from_model(model)
    torch.manual_seed(pos)
    base, used, cap, Hkv, D = 7, 5, 40, spec.n_kv, spec.head_dim
    keys = [torch.randn(1, Hkv, base + cap, D) * 2 for _ in range(spec.n_layers)]  # [1, H_kv, base + cap, D]
    values = [torch.randn(1, Hkv, base + cap, D) for _ in range(spec.n_layers)]
    _, queries, c = step(IDS[pos], pos, keys, values, 4, base=base, used=used)  # [L, H*D], [L, 3]
    for layer in range(spec.n_layers):
        attended = keys[layer][0, :, base - used : base + pos + 1]  # [H_kv, used + pos + 1, D], the token's own last
        ref = shares64(spec, layer, queries[layer], attended, pos, used, 4)
        assert c[layer].tolist() == pytest.approx(ref, abs=1e-5)
        assert c[layer, 0] + c[layer, 2] <= 1 + 1e-6 and c[layer, 1] + c[layer, 2] <= 1 + 1e-6
        assert c[layer, 2] > 0.01  # random keys: the recalled slots get a real share


def test_transformers_forward_measures_the_recalled_share_too(tmp_path: Path) -> None:
    """No fast step: the gauge's hooks recompute the three shares; each is the fp64 softmax's, the memory's mean
    over layers as the event says."""
    model = _packed()
    eng = engine(model, memory(model, tmp_path / "m"), kv="float32")
    assert eng.step is None
    list(eng.feed_ids(IDS[:100]))
    for tok in IDS[100:104]:
        assert one_token(eng, tok) is None
        ref = [fp64_shares(eng, i, eng.gauge_n) for i in range(2)]
        ev = eng.measure_gauge()
        assert eng.cache.layers[0].used > 0 and isinstance(ev, GaugeEvent)
        assert ev.per_layer == pytest.approx([r[0] for r in ref], abs=1e-5)
        assert ev.memory_per_layer == pytest.approx([r[2] for r in ref], abs=1e-5)
        assert ev.recent == pytest.approx(sum(r[1] for r in ref) / 2, abs=1e-5)
        assert ev.memory == pytest.approx(sum(r[2] for r in ref) / 2, abs=1e-5) and ev.memory > 0.005


@needs_native
def test_memory_off_the_third_figure_is_zero_and_the_first_two_unchanged(tmp_path: Path) -> None:
    """The plain path's third column is exactly 0 and its event says memory off (None); the region path with
    nothing recalled gives the plain path's first two columns bit for bit, and 0.0 (on, nothing read)."""
    model = _packed()
    on = engine(model, memory(model, tmp_path / "m"), step=select(model, "native"))
    off = engine(model, None, step=select(model, "native"))
    for tok in IDS[:30]:
        a, b = one_token(on, tok), one_token(off, tok)
        assert a is not None and b is not None
        assert torch.equal(b[:, 2], torch.zeros(2)) and torch.equal(a[:, 2], torch.zeros(2))
        assert torch.equal(a[:, :2], b[:, :2])
        ea, eb = on.measure_gauge(), off.measure_gauge()
        assert ea.memory == 0.0 and ea.memory_per_layer == (0.0, 0.0)
        assert eb.memory is None and eb.memory_per_layer == ()
        assert (ea.share, ea.recent, ea.per_layer) == (eb.share, eb.recent, eb.per_layer)
    assert on.memory.blocks == 0 and on.cache.layers[0].base > 0
    for tok in IDS[30:90]:  # memory off through evictions: still exactly 0
        b = one_token(off, tok)
        assert b is not None and torch.equal(b[:, 2], torch.zeros(2)) and b[:, 0].min() > 0
        assert off.measure_gauge().memory is None
    assert off.ledger.evicted > 40


def test_the_torch_steps_gauge_has_the_third_column_at_zero() -> None:
    """decode_one attends no recall region (the Engine hands calls with memory to transformers' forward): its
    gauge is [L, 3], the third column 0, the first two the hooks' measure of the same attention."""
    from fakes import WordTokenizer
    from test_fastdecode import engine as torch_engine, q4_model

    from sinkchat.config import CacheConfig, SamplingConfig

    eng = torch_engine(q4_model(), WordTokenizer(), CacheConfig("sink", 4, 40, 5), SamplingConfig(temperature=0),
                       kv_dtype="float32")
    assert type(eng.step).__name__ == "TorchStep"
    list(eng.feed_ids(IDS[:60]))
    c = one_token(eng, IDS[60])
    assert c is not None and c.shape == (eng.n_layers, 3) and torch.equal(c[:, 2], torch.zeros(eng.n_layers))
    from_step, from_hooks = both_events(eng)
    assert from_step.per_layer == pytest.approx(from_hooks.per_layer, abs=1e-4)
    assert from_step.recent == pytest.approx(from_hooks.recent, abs=1e-4) and from_step.memory is None


# ------------------------------------------------------------------------------------------------ where it is shown
def _stats(**over: Any) -> Any:
    from sinkchat.core.metrics import Stats

    base = dict(policy="sink", n_sink=4, cache_len=40, capacity=64, kv_bytes=1 << 20, model_bytes=1 << 20, rss=1 << 26,
                cuda=None, seen=500, evicted=460, evictions=12, decode_tok_s=30.0, prefill_tok_s=300.0, p50_ms=30.0,
                p99_ms=40.0, gauge=0.42, gauge_recent=0.2, gauge_uniform=0.06, holds_start=True)
    return Stats(**{**base, **over})


def test_the_status_line_toolbar_and_stats_show_the_recalled_share_only_with_the_memory_on() -> None:
    from rich.console import Console

    from sinkchat.apps.render import stats_table, toolbar_text
    from sinkchat.core.metrics import status_line

    on, off = _stats(gauge_memory=0.11), _stats()
    assert "sink ████░░░░░░ 0.42 · mem 0.11" in status_line(on)
    assert "· mem" not in status_line(off) and status_line(off).endswith("sink ████░░░░░░ 0.42")
    assert "0.42 · mem 0.11" in toolbar_text(on, 200) and "· mem" not in toolbar_text(off, 200)
    narrow = status_line(on, 60)  # the gauge field shrinks whole: the figure never goes without the sink's
    assert ("· mem 0.11" in narrow) == ("sink" in narrow)

    def table(s: Any) -> str:
        console = Console(width=160, record=True, file=open("/dev/null", "w"))
        console.print(stats_table(s))
        return console.export_text()

    assert re.search(r"recalled share +█░+ 0\.110 of the newest token's attention on the recalled memory blocks",
                     table(on))
    assert "recalled share" not in table(off)


def test_a_chat_with_the_memory_on_shows_the_engines_own_figure(tmp_path: Path) -> None:
    """The chat's status line after a reply carries `· mem X` equal to the last gauge event's memory share."""
    from test_memory_ui import LONG, make

    from sinkchat.apps.chat.repl import lines_reader

    loop, _, err = make(tmp_path / "m")
    loop.run(lines_reader([LONG, "tell me more about things"]))
    g = loop.metrics.gauge
    assert isinstance(g, GaugeEvent) and g.memory is not None
    last = [line for line in err.getvalue().splitlines() if line.startswith("sink(")][-1]
    assert f"· mem {g.memory:.2f}" in last
    off, _, err2 = make(tmp_path / "n", memory=False)
    off.run(lines_reader([LONG]))
    assert "· mem" not in err2.getvalue() and off.metrics.gauge is not None


def test_the_soak_records_and_reports_the_recalled_share(tmp_path: Path) -> None:
    from sinkchat.apps.soak.report import figures, plot_data, render_json, render_markdown
    from sinkchat.apps.soak.interval import Interval
    from sinkchat.apps.soak.thresholds import Thresholds
    from sinkchat.core.events import GaugeEvent

    iv = Interval()
    common = dict(per_layer=(0.4,), recent=0.2, uniform=0.1, n=4, holds_start=True)
    for share, mem in ((0.4, 0.1), (0.5, 0.3)):
        iv.fold(GaugeEvent(share=share, memory=mem, memory_per_layer=(mem,), **common))
    iv.fold(GaugeEvent(share=0.6, **common))  # a plain event (memory off) adds nothing to the recalled figure
    assert iv.recalled_gauges == [0.1, 0.3]
    samples = [{"elapsed": 10.0, "gauge": 0.45, "gauge_recalled": 0.2},
               {"elapsed": 20.0, "gauge": 0.4, "gauge_recalled": 0.25}]
    assert figures(samples)["gauge_recalled"] == (0.2, 0.25)
    lines = dict(plot_data(samples)["gauge"][1])
    assert lines["recalled share (memory)"] == [(10.0, 0.2), (20.0, 0.25)]
    md = render_markdown({}, samples, None, [], Thresholds(), [])
    assert "| recalled share (gauge_recalled) | 0.20 | 0.25 |" in md
    doc = json.loads(render_json({}, samples, None, [], Thresholds(), []))
    assert doc["figures"]["gauge_recalled"] == {"first": 0.2, "last": 0.25}
    assert figures([{"elapsed": 1.0, "gauge": 0.4}])["gauge_recalled"] == (None, None)  # memory off: not shown
    assert "recalled share" not in render_markdown({}, [{"elapsed": 1.0, "gauge": 0.4}], None, [], Thresholds(), [])


def test_the_soak_line_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    from collections import deque
    from types import SimpleNamespace

    from sinkchat.apps.soak.display import Display
    from test_soak import GOOD, MIB

    rec = {**GOOD, "elapsed": 90.0, "steps": 3, "tokens": 500, "evicted": 200, "rss": 900 * MIB, "gauge": 0.4,
           "gauge_recalled": 0.13}
    stub = SimpleNamespace(duration=600.0, samples=deque([rec]), progress=lambda: 0.15)
    Display(stub, live=False).update(rec)
    assert "sink 0.40 · mem 0.13" in capsys.readouterr().err
    Display(stub, live=False).update({**rec, "gauge_recalled": None})
    assert "· mem" not in capsys.readouterr().err


def test_serve_reports_the_recalled_share_with_the_memory_on() -> None:
    from types import SimpleNamespace

    from sinkchat.apps.serve.sessions import ServeSession, figures

    cfg = SimpleNamespace(capacity=64, n_sink=4, policy="sink")
    mem = SimpleNamespace(blocks=3, tokens=24, forgotten=0, disk_bytes=4096)
    st = SimpleNamespace(cache_cfg=cfg, cache=SimpleNamespace(length=40), ledger={"evicted": 24, "seen": 64},
                         memory=mem)
    sess = ServeSession("s", st, gauge=0.4, recalled=0.12)  # type: ignore[arg-type]
    assert figures(sess, st)["recalled_share"] == 0.12 and figures(sess, st)["sink_share"] == 0.4  # type: ignore
    st.memory = None
    assert "recalled_share" not in figures(sess, st)  # type: ignore[arg-type]
