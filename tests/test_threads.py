"""The kernels' worker pool (csrc/pool.c) and what runs on it: the same bits at any thread count.

- Every layout's matmul (q4, q8g, q4k, q8k and the int8 table), both variants, one row (decode) and many (prefill,
  across its passes): 1, 2, 3 and 4 threads give bit-identical outputs, also where the row groups do not divide
  among the threads or are fewer than the threads. The pool's grain is set to 0 here, so even these small shapes
  are split (in the product a job under 64 KB runs on the caller alone).
- The decode step (all four layouts in one model; a tied int8 table and a bf16 cache in another) streamed through a
  sink cache with many evictions: logits, queries, gauge and the cache contents bit-identical at 1, 2 and 3 threads.
- The pool resizes between calls, its workers do take chunks, a work buffer sized for fewer threads still works,
  and many small calls from several Python threads, with resizes and a fork in between, neither hang nor differ.
- `--threads` / SINKCHAT_THREADS: the default is the physical cores, and it sizes both the pool and torch.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from sinkchat.kernels import native
from kernel_helpers import SIMD, k_case, k_matmul, k_pack, on, q4_case, q8g_case, simd  # noqa: F401  (simd: the fixture)
from kernel_helpers import bits as _bits

pytestmark = pytest.mark.skipif(native.unsupported("ref") is not None,
                                reason=f"native kernels: {native.unsupported('ref')}")

COUNTS = (1, 2, 3, 4)
LAYOUTS = ("q4", "q8g", "q4k", "q8k", "table")


VARIANTS = [*SIMD, "ref"]  # every variant, and the avxvnni code's stand-in where it runs it (test_kernels.SIMD)


def _variants() -> list[str]:
    return [v for v in VARIANTS if native.unsupported(v) is None]


@contextlib.contextmanager
def pool(n: int, deal: bool = False, grain: int = 0) -> Iterator[None]:
    """`n` threads in every variant, jobs split however small (grain 0), their chunks claimed (the product's way) or
    dealt (`deal`: chunk k to thread k mod n, so every thread computes its share, at the same time as the others,
    however loaded the machine); restored after."""
    libs = [native.library(v) for v in _variants()]
    saved = [(lib.sc_set_grain(grain), lib.sc_set_deal(int(deal))) for lib in libs]
    prev = native.threads()
    try:
        assert native.set_threads(n) == n
        yield
    finally:
        native.set_threads(prev)
        for lib, (g, d) in zip(libs, saved):
            lib.sc_set_grain(g)
            lib.sc_set_deal(d)



def _matmul(layout: str, n: int, k: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> y through random weights of `layout` (N x K), with a bias where the layout takes one."""

    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(n, generator=g)
    if layout == "q4":
        qw, sw = q4_case(n, k, seed)
        return lambda x: native.q4_matmul(x, qw, sw, bias)
    if layout == "q8g":
        hw, sw = native.pack_q8g(*q8g_case(n, k, seed))
        return lambda x: native.q8g_matmul(x, hw, sw, bias)
    if layout == "table":
        hw = native.pack_q8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
        scale = torch.rand(hw.shape[0] * native.RG, generator=g)
        return lambda x: native.q8_matmul(x, hw, scale)
    w, sw = k_pack(layout, *k_case(layout, n, k, seed))
    return lambda x: k_matmul(layout, x, w, sw, bias)


# (N, K, M): 1 row group (fewer than the threads), 3 (not a multiple of 2 or 4), 13, 25; one row, a few, and past
# the prefill passes (q4 / q4k: 256 rows, q8g / q8k: 128). The last one (SIMD: 5-9 ms a call) is long enough for
# the threads to overlap even where the other core is busy: with each thread's prefill accumulators made one shared
# piece on purpose, it failed in 7 of 8 (layout, mode) runs at 2 threads here, while the shorter shapes passed.
SHAPES = [(16, 256, 1), (48, 256, 1), (208, 512, 1), (48, 256, 7), (16, 256, 5), (80, 256, 300), (400, 1024, 260),
          (1024, 2048, 300)]
BIG = 1024 * 2048 * 300  # multiply-adds past which the scalar reference is too slow to run 8 times


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k,m", SHAPES)
def test_matmuls_are_bit_identical_at_any_thread_count(variant, layout, n, k, m):
    if native.unsupported(variant):
        pytest.skip(f"{variant} kernels: {native.unsupported(variant)}")
    if variant == "ref" and n * k * m >= BIG:
        pytest.skip("the scalar reference at this size: seconds a call")
    mm = _matmul(layout, n, k, seed=n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
    x[:, 7] = 25.0  # an outlier block
    outs = {}
    with on(variant):
        for t in COUNTS:
            for deal in (False, True):
                with pool(t, deal):
                    outs[t, deal] = mm(x)
    first = outs[1, False]
    assert torch.isfinite(first).all() and first.abs().max() > 0
    for (t, deal), y in outs.items():
        assert torch.equal(_bits(y), _bits(first)), f"{t} threads, {'dealt' if deal else 'claimed'}"


def test_simd_and_reference_still_agree_on_many_threads(simd):
    mm = _matmul("q8k", 208, 512, seed=3)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(1))
    with pool(3):
        with on(simd):
            a = mm(x)
        with on("ref"):
            b = mm(x)
    assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_eviction_is_bit_identical_at_any_thread_count(variant):
    if native.unsupported(variant):
        pytest.skip(f"{variant} kernels: {native.unsupported(variant)}")
    torch.manual_seed(4)
    keys, values = torch.randn(1, 5, 64, 48).bfloat16(), torch.randn(1, 5, 64, 48).bfloat16()
    ang = 7 * (1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)))
    cs, sn = torch.cat([torch.cos(ang)] * 2), torch.cat([-torch.sin(ang)] * 2)  # partial rotary: 32 of 48 dims
    outs = []
    with on(variant):
        for t, deal in [(t, d) for t in COUNTS for d in (False, True)]:
            k, v = keys.clone(), values.clone()
            with pool(t, deal):
                assert native.kv_evict(k, v, 4, 9, 40, (cs, sn))  # 5 heads: 3 dealt to thread 0 of 2
            outs.append((k, v))
    for k, v in outs[1:]:
        assert torch.equal(_bits(k), _bits(outs[0][0])) and torch.equal(_bits(v), _bits(outs[0][1]))
    assert not torch.equal(outs[0][0], keys)


# ---- the decode step ---------------------------------------------------------------------------------------------
class _Recorder:
    """A decode step that keeps copies of what it returns: logits, pre-RoPE queries, gauge."""

    def __init__(self, step: Any) -> None:
        self.step, self.outs = step, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        out = self.step(*args, **kw)
        self.outs.append([t.clone() for t in out])
        return out


def _four_layouts() -> Any:
    from test_native_archs import build, pack
    from test_qk import K_SHAPE, _four

    return pack(build("llama", **K_SHAPE), _four), "float32"


def _tied_table() -> Any:
    from fakes import tiny_model
    from sinkchat.model import int4

    model = tiny_model("llama", tie_word_embeddings=True, hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=160, score_std=3.0)
    int4.quantize_model(model.model.layers, kernels="native")
    assert int4.quantize_tied_table(model, "native")
    return model, "bfloat16"


def _stream(model: Any, kv: str) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], int]:
    """Prefill 12 tokens, then 78 one at a time through a 40-slot sink cache: the step's outputs, the cache, and
    how many tokens were evicted."""
    from fakes import WordTokenizer
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.decode import select

    step = select(model, "native")
    assert type(step).__name__ == "NativeStep"
    eng = Engine(model, WordTokenizer(), CacheConfig("sink", 4, 40, 5), SamplingConfig(temperature=0),
                 step=_Recorder(step), kv_dtype=kv, gauge_every=1)
    ids = [(37 * i + 3) % (model.config.vocab_size - 2) + 1 for i in range(90)]
    list(eng.feed_ids(ids[:12]))
    for t in ids[12:]:
        list(eng.feed_ids([t]))
    cache = [t.clone() for layer in eng.cache.layers for t in (layer.keys, layer.values)]
    return eng.step.outs, cache, eng.ledger.evicted


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("make", [_four_layouts, _tied_table], ids=["q4-q4k-q8g-q8k", "tied-table-bf16"])
def test_the_decode_step_is_bit_identical_at_any_thread_count(variant, make):
    if native.unsupported(variant):
        pytest.skip(f"{variant} kernels: {native.unsupported(variant)}")
    model, kv = make()
    runs, configs = [], [(1, False), (2, False), (2, True), (3, True)]  # (threads, dealt)
    with on(variant):
        for t, deal in configs:
            with pool(t, deal):
                runs.append(_stream(model, kv))
    outs, cache, evicted = runs[0]
    assert evicted > 40 and len(outs) == 78 and outs[0][2].abs().sum() > 0  # evictions; the gauge was measured
    for t, (o, c, e) in zip(configs[1:], runs[1:]):
        assert e == evicted
        for step, (a, b) in enumerate(zip(outs, o)):
            for name, x, y in zip(("logits", "queries", "gauge"), a, b):
                assert torch.equal(_bits(x), _bits(y)), f"{t} threads, step {step}: {name}"
        for x, y in zip(cache, c):
            assert torch.equal(_bits(x), _bits(y)), f"{t} threads: cache"


def test_the_bundled_model_end_to_end_at_one_and_two_threads():
    """The real thing through `--threads` (loader.set_threads: the pool, and torch's threads with OMP_WAIT_POLICY
    PASSIVE as conftest sets it): the bundled q4 model's prefill (transformers' forward on the pool's prefill
    matmuls) and 120 decode steps through a 256-slot sink cache give the same logits, bit for bit."""
    from sinkchat.config import CacheConfig, ModelConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.decode import select
    from sinkchat.model import loader

    if native.unsupported(native.variant()):
        pytest.skip(f"native kernels: {native.unsupported(native.variant())}")
    prev, prev_torch = native.threads(), torch.get_num_threads()
    lm = loader.load(ModelConfig(threads=1))
    step = select(lm.model, "native", lm.spec)
    assert type(step).__name__ == "NativeStep"
    ids = lm.tokenizer(Path(__file__).read_text())["input_ids"][:420]
    runs = []
    try:
        for n in (1, 2):
            loader.set_threads(n)
            eng = Engine(lm.model, lm.tokenizer, CacheConfig("sink", 4, 256, 0), SamplingConfig(temperature=0),
                         spec=lm.spec, step=step, kv_dtype="bfloat16")
            list(eng.feed_ids(ids[:300]))
            outs = [eng.last_logits.clone()]
            for t in ids[300:]:
                list(eng.feed_ids([t]))
                outs.append(eng.last_logits.clone())
            runs.append((torch.stack(outs), eng.ledger.evicted))
    finally:
        native.set_threads(prev)
        torch.set_num_threads(prev_torch)
    (a, ev), (b, ev2) = runs
    assert ev == ev2 > 100 and torch.equal(_bits(a), _bits(b))


# ---- the pool itself ---------------------------------------------------------------------------------------------
def test_the_pool_resizes_between_calls():
    variant = _variants()[0]
    lib = native.library(variant)
    mm = _matmul("q4", 208, 512, seed=1)
    x = torch.randn(300, 512)
    with on(variant):
        with pool(1):
            want = mm(x)
            for n in (4, 2, 1, 3, 0, 2):
                assert native.set_threads(n) == max(n, 1) and lib.sc_threads() == max(n, 1)
                assert torch.equal(_bits(mm(x)), _bits(want)) and torch.equal(_bits(mm(x[:1])), _bits(want[:1]))


def _worker_ticks(tids: set[str]) -> int:
    """CPU time (clock ticks, user + system) of these threads of this process."""
    total = 0
    for tid in tids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_the_workers_take_chunks():
    """The threads sc_set_threads starts are the ones that compute (not only the caller): with the chunks dealt,
    4-thread matmuls give them CPU time, however busy the machine. (Claimed, the product's way, a worker that wakes
    on its caller's CPU leaves the job to the caller: pool.c's backoff.) Up to 10 s of matmuls until their CPU ticks
    move: the kernel counts ticks of 10 ms, which a worker sharing 2 busy cores with 3 others took up to a second
    to be charged (it failed 2 runs of 3 at 0.5 s with both cores busy)."""
    variant = _variants()[0]
    mm = _matmul("q4", 2048, 1024, seed=2)
    x = torch.randn(1, 1024)
    with on(variant), pool(1, deal=True):
        mm(x)
        before = set(os.listdir("/proc/self/task"))
        native.set_threads(4)
        workers = set(os.listdir("/proc/self/task")) - before
        assert len(workers) == 3 * len(native._LOADED)  # each loaded variant has its own pool
        start, t0 = _worker_ticks(workers), time.perf_counter()
        while _worker_ticks(workers) == start and time.perf_counter() - t0 < 10:
            for _ in range(20):
                mm(x)
        assert _worker_ticks(workers) > start


def test_a_buffer_for_fewer_threads_runs_on_fewer():
    """Prefill keeps 16 KB of accumulators per thread: the work sizes count them, and a kernel given a buffer for
    fewer threads than the pool has runs on as many as it holds scratch for (same bits), not past its end."""
    lib = native.library(_variants()[0])
    one, four = lib.sc_q4_work(300, 512, 1), lib.sc_q4_work(300, 512, 4)
    assert four - one == 3 * 16 * 1024 and lib.sc_q4_work(1, 512, 4) == lib.sc_q4_work(1, 512, 1)
    qw, sw = native.pack_q4(torch.randint(0, 16, (208, 512)), torch.rand(208, 16) * 0.05, torch.randn(208, 16) * 0.05)
    x = torch.randn(300, 512)
    ys = []
    with pool(4):
        for size in (four, one + 16 * 1024, one):
            buf = torch.full((size + 64,), 0xA5, dtype=torch.uint8)
            y = torch.empty(300, 208)
            assert lib.q4_matmul(x.data_ptr(), 300, 512, 208, qw.data_ptr(), sw.data_ptr(), None, y.data_ptr(),
                                 buf.data_ptr(), size) == 0
            assert (buf[size:] == 0xA5).all()  # nothing written past the buffer
            ys.append(y)
        assert lib.q4_matmul(x.data_ptr(), 300, 512, 208, qw.data_ptr(), sw.data_ptr(), None, y.data_ptr(),
                             buf.data_ptr(), one - 1) == -2  # SC_EWORK: not even one thread's scratch
    assert all(torch.equal(_bits(y), _bits(ys[0])) for y in ys)


STRESS = """
import os, sys, threading
import torch
from sinkchat.kernels import native
native.use(sys.argv[1])
lib = native.library()
lib.sc_set_grain(0)
qw, sw = native.pack_q4(torch.randint(0, 16, (48, 64)), torch.rand(48, 2) * 0.05, torch.randn(48, 2) * 0.05)
x1, x5 = torch.randn(1, 64), torch.randn(5, 64)
want = [native.q4_matmul(x, qw, sw, None) for x in (x1, x5)]
def same():
    return all(torch.equal(native.q4_matmul(x, qw, sw, None), w) for x, w in zip((x1, x5), want))
for i in range(40):  # many small jobs, the pool resized between them
    native.set_threads(1 + i % 4)
    assert all(same() for _ in range(100)), i
native.set_threads(4)
bad = []
def hammer():  # concurrent callers: one gets the pool, the others run alone
    if not all(same() for _ in range(1500)):
        bad.append(1)
def resize():
    for i in range(200):
        native.set_threads(2 + i % 3)
ts = [threading.Thread(target=hammer) for _ in range(3)] + [threading.Thread(target=resize)]
for t in ts:
    t.start()
for t in ts:
    t.join()
assert not bad
pid = os.fork()  # a child has no workers: it runs alone, and exits
if pid == 0:
    os._exit(0 if same() and lib.sc_threads() == 1 else 3)
assert os.waitpid(pid, 0)[1] == 0
native.set_threads(3)
assert same()
print("ok")
"""  # and the process exits with a live pool: the destructor joins it


@pytest.mark.parametrize("variant", VARIANTS)
def test_many_small_calls_resizes_concurrent_callers_and_fork_do_not_hang(variant):
    if native.unsupported(variant):
        pytest.skip(f"{variant} kernels: {native.unsupported(variant)}")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(STRESS), variant], capture_output=True, text=True,
                         timeout=180, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


# ---- --threads -------------------------------------------------------------------------------------------------
def test_physical_cores_count_each_core_once(monkeypatch):
    from sinkchat import config

    smt = {0: ("0", "0"), 1: ("0", "1"), 2: ("0", "0"), 3: ("0", "1"), 4: ("1", "0"), 5: ("1", "0")}
    monkeypatch.setattr(config, "_sysfs_cores", lambda: smt)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert config.physical_cores() == 3  # two packages; SMT siblings once
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})
    assert config.physical_cores() == 1  # only the CPUs this process may run on
    monkeypatch.setattr(config, "_sysfs_cores", lambda: (_ for _ in ()).throw(OSError("no sysfs")))
    monkeypatch.setattr(config, "_cpuinfo_cores", lambda: {0: ("0", "0")})  # does not know CPU 2: not trusted
    assert config.physical_cores() == 2
    monkeypatch.undo()
    assert 1 <= config.physical_cores() <= (os.cpu_count() or 1)


def test_the_default_is_the_physical_cores_and_sizes_pool_and_torch(monkeypatch):
    from sinkchat import config
    from sinkchat.bootstrap import build_settings
    from sinkchat.model import loader

    monkeypatch.delenv("SINKCHAT_THREADS", raising=False)
    assert config.ENV_SETTINGS["SINKCHAT_THREADS"][0] == "0"
    s = build_settings({})
    assert s.model.threads == 0 and s.model.resolved_threads == config.physical_cores()
    assert build_settings({"threads": 3}).model.resolved_threads == 3
    prev, prev_torch = native.threads(), torch.get_num_threads()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    try:
        assert loader.set_threads(3) == 3
        assert native.threads() == 3 and torch.get_num_threads() == 3
        assert all(native.library(v).sc_threads() == 3 for v in _variants())
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # spinning OpenMP threads: torch keeps one
        assert loader.set_threads(0) == config.physical_cores() == native.threads()
        assert torch.get_num_threads() == 1
    finally:
        native.set_threads(prev)
        torch.set_num_threads(prev_torch)
