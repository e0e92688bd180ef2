"""The model cache is keyed by a GGUF's content, not its path: the same file at another path (another environment's
copy of the bundled model) finds the one entry, a changed file at the same path gets its own, two processes
converting at once make one, a killed conversion is never used, and `sinkchat cache list / clean` sees and removes
what is stale (older layouts, orphans, half-written and unused folders).

Most tests use small GGUFs written here (a 1.2 MB description makes the header longer than 1 MiB, as every real
model's vocabulary does) and replace the transformers conversion by a stand-in that only writes the marker, so they
test the keying and the cache's bookkeeping in a fraction of a second; one test converts nothing but resolves a
copy of the real bundled file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sinkchat.model import gguf_convert, gguf_file


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("SINKCHAT_CACHE_DIR", str(d))
    return d


@pytest.fixture
def conversions(monkeypatch, tmp_path) -> Path:
    """Replace transformers' part of a conversion (~6-20 s) by a stand-in that writes a done marker the way the
    real one commits (temp dir, then rename); returns a log file with one line per conversion, from any process."""
    log = tmp_path / "conversions.log"
    log.touch()

    def convert(info, out: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {out.name}\n")
        time.sleep(float(os.environ.get("FAKE_CONVERT_S", "0")))
        tmp = Path(tempfile.mkdtemp(prefix=f".convert-{out.name}-", dir=out.parent))
        (tmp / gguf_convert.MARKER).write_text(json.dumps({
            "version": gguf_convert.VERSION, "source": str(info.path), "sources": [str(info.path)],
            "tokenizer": info.tokenizer_key}))
        os.replace(tmp, out)

    monkeypatch.setattr(gguf_convert, "_convert_into", convert)
    return log


def write_gguf(path: Path, seed: int = 0, tensors: int = 3) -> Path:
    """A small llama GGUF sinkchat's checks accept: a tokenizer, F32 tensors of 1 MB each from `seed`, and a header
    over 1 MiB (a 1.2 MB description), so that files differing only in their weights share their first MiB."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-cache-test")
    w.add_description("x" * 1_200_000)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)])
    rng = np.random.default_rng(seed)
    for i in range(tensors):
        w.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((256, 1024), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _count(log: Path) -> int:
    return len(log.read_text().splitlines())


def test_the_same_content_at_another_path_reuses_the_entry(tmp_path, cache, conversions):
    """Another environment's copy (another folder, another name, a newer mtime) converts nothing."""
    (tmp_path / "a").mkdir()
    a = write_gguf(tmp_path / "a" / "model.gguf")
    b = tmp_path / "env2" / "site-packages" / "copy.gguf"
    b.parent.mkdir(parents=True)
    shutil.copy(a, b)
    os.utime(b, ns=(time.time_ns(), a.stat().st_mtime_ns + 10**9))
    said: list[str] = []
    first = gguf_convert.prepare(a, said.append)
    second = gguf_convert.prepare(b, said.append)
    assert second == first and gguf_convert.is_done(first)
    assert _count(conversions) == 1 and len(said) == 1, said
    assert [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")] == [first.name]
    assert json.loads((first / gguf_convert.MARKER).read_text())["sources"] == [str(a), str(b)]


def test_a_changed_file_at_the_same_path_gets_its_own_entry(tmp_path, cache, conversions):
    """Other weights under the same name, size, header and even mtime (a copy with `cp -p`, an unpacked archive):
    a new entry, never the old model; the old entry is then an orphan."""
    path = write_gguf(tmp_path / "model.gguf", seed=0)
    st, first_mib = path.stat(), path.read_bytes()[: 1 << 20]
    old = gguf_convert.prepare(path, lambda m: None)
    write_gguf(path, seed=1)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.read_bytes()[: 1 << 20] == first_mib
    new = gguf_convert.prepare(path, lambda m: None)
    assert new != old and gguf_convert.is_done(new) and _count(conversions) == 2
    from sinkchat.apps import cache as cache_app

    status = {e.path.name: e.status for e in cache_app.entries()}
    assert status == {old.name: cache_app.ORPHAN, new.name: cache_app.OK}, status


def test_a_tensor_change_past_the_first_mib_changes_the_key(tmp_path):
    """The key samples every tensor (its first and middle bytes) and 32 places over the data: one retrained
    tensor, anywhere, gives another key; the same bytes give the same key wherever the file is."""
    a = write_gguf(tmp_path / "a.gguf", tensors=6)
    head = gguf_file.scan(a)
    key = gguf_file.content_key(head)
    data = bytearray(a.read_bytes())
    last = head.tensors[-1]
    b = tmp_path / "b.gguf"
    b.write_bytes(data)
    assert gguf_file.content_key(gguf_file.scan(b)) == key
    data[last.offset + last.nbytes // 2] ^= 0xFF  # one byte in the middle of the last tensor
    b.write_bytes(data)
    assert gguf_file.content_key(gguf_file.scan(b)) != key


def test_the_key_of_a_multi_gb_file_takes_well_under_a_second(tmp_path):
    """A 7.5 GB file (sparse here: it reads as zeros) is keyed from its header and ~0.8 MB of samples; hashing all
    of it would take ~14 s (sha256 of a real 3.7 GB file: 6.8 s)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for i in range(400):
        w.add_tensor_info(f"blk.{i}.ffn_up.weight", [8192, 4096 // 32 * 18], np.dtype(np.uint8), 8192 * 4096 // 32 * 18,
                          raw_dtype=T.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    head_only = path.stat().st_size
    end = head_only + (-head_only % 32) + 400 * 8192 * 4096 // 32 * 18
    os.truncate(path, end)
    t = time.perf_counter()
    head = gguf_file.scan(path)
    gguf_file.content_key(head)
    assert time.perf_counter() - t < 0.5 and head.size == head.data_end == end > 7e9


def _prepare_in_child(path: str, cache_dir: str, out: multiprocessing.Queue) -> None:
    os.environ["SINKCHAT_CACHE_DIR"] = cache_dir
    out.put(str(gguf_convert.prepare(Path(path), lambda m: None)))


def test_two_processes_converting_the_same_file_make_one_entry(tmp_path, cache, conversions, monkeypatch):
    """Both start before either is done (each conversion takes 1 s here): one converts, the other waits on the
    lock and takes the finished folder; no temp dir is left."""
    monkeypatch.setenv("FAKE_CONVERT_S", "1")
    path = write_gguf(tmp_path / "model.gguf")
    ctx = multiprocessing.get_context("fork")  # the children inherit the stand-in converter
    q = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(str(path), str(cache), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    got = {q.get(timeout=5), q.get(timeout=5)}
    assert len(got) == 1 and gguf_convert.is_done(Path(got.pop()))
    assert _count(conversions) == 1
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".convert-")]


def _killed_mid_conversion(path: str, cache_dir: str) -> None:
    """A real conversion, killed (no cleanup runs) once its temp dir exists: when transformers is asked for the
    config."""
    import transformers

    os.environ["SINKCHAT_CACHE_DIR"] = cache_dir
    transformers.AutoConfig.from_pretrained = lambda *a, **k: os._exit(9)
    gguf_convert.prepare(Path(path), lambda m: None)


def test_a_killed_conversion_is_never_used_and_clean_removes_it(tmp_path, cache, monkeypatch):
    from sinkchat.apps import cache as cache_app
    from sinkchat.cli import main

    path = write_gguf(tmp_path / "model.gguf")
    child = multiprocessing.get_context("fork").Process(target=_killed_mid_conversion, args=(str(path), str(cache)))
    child.start()
    child.join(60)
    assert child.exitcode == 9
    left = [p for p in (cache / "models").iterdir() if p.is_dir()]
    assert len(left) == 1 and left[0].name.startswith(".convert-") and not gguf_convert.is_done(left[0])
    assert [e.status for e in cache_app.entries()] == [cache_app.PARTIAL]
    r = CliRunner().invoke(main, ["cache", "clean"])
    assert r.exit_code == 0, r.output
    assert not left[0].exists() and "partial" in r.output


def _old_layout_entry(models: Path, source: Path) -> Path:
    """A folder as sinkchat wrote it before content keys: `<stem>-<hash of size, mtime, first MiB>`, marker v3."""
    old = models / f"{source.stem}-0123456789abcdef0123"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    (old / gguf_convert.MARKER).write_text(json.dumps({"source": str(source), "version": 3, "types": {}}))
    (models / f".{old.name}.lock").touch()
    return old


def test_cache_list_and_clean(tmp_path, cache, conversions):
    """list: every entry with its status; clean --dry-run: removes nothing; clean: the old layout, the orphan and
    the unused tokenizer go, the entry in use and its tokenizer stay; clean --all: everything."""
    from sinkchat.apps import cache as cache_app
    from sinkchat.cli import main

    kept = write_gguf(tmp_path / "kept.gguf", seed=0)
    gone = write_gguf(tmp_path / "gone.gguf", seed=1)
    ok, orphan = gguf_convert.prepare(kept, lambda m: None), gguf_convert.prepare(gone, lambda m: None)
    gone.unlink()
    old = _old_layout_entry(cache / "models", kept)
    token_key = json.loads((ok / gguf_convert.MARKER).read_text())["tokenizer"]
    week_ago = time.time() - 7 * 86400
    for name in (token_key, "f" * 20):  # the one `ok` was built from, and one nothing needs any more
        d = cache / "tokenizers" / name
        d.mkdir(parents=True)
        (d / "tokenizer.json").write_text("{}")
        for p in (d / "tokenizer.json", d):
            os.utime(p, (week_ago, week_ago))
    runner = CliRunner()
    r = runner.invoke(main, ["cache", "list"])
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line for line in r.output.splitlines()[1:] if line.strip() and "/" in line.split()[0]}
    assert "ok" in rows[f"models/{ok.name}"] and str(kept) in rows[f"models/{ok.name}"]
    assert "orphan" in rows[f"models/{orphan.name}"] and "old layout" in rows[f"models/{old.name}"]
    assert "unused" in rows[f"tokenizers/{'f' * 20}"] and " ok " in rows[f"tokenizers/{token_key}"]
    before = sorted(p.name for p in cache.rglob("*"))
    r = runner.invoke(main, ["cache", "clean", "--dry-run"])
    assert r.exit_code == 0 and r.output.count("would remove") == 3
    assert sorted(p.name for p in cache.rglob("*")) == before
    r = runner.invoke(main, ["cache", "clean"])
    assert r.exit_code == 0, r.output
    assert {e.label: e.status for e in cache_app.entries()} == {f"models/{ok.name}": "ok",
                                                                 f"tokenizers/{token_key}": "ok"}
    assert not (cache / "models" / f".{old.name}.lock").exists()
    for f in [ok, *ok.iterdir()]:  # last used ten days ago
        os.utime(f, (time.time() - 10 * 86400,) * 2)
    assert "would remove" not in runner.invoke(main, ["cache", "clean", "--older-than", "30", "-n"]).output
    assert f"would remove models/{ok.name}" in runner.invoke(main, ["cache", "clean", "--older-than", "5", "-n"]).output
    r = runner.invoke(main, ["cache", "clean", "--all"])
    assert r.exit_code == 0 and cache_app.entries() == []


def test_a_copy_of_the_bundled_model_uses_its_entry(tmp_path, monkeypatch):
    """The user's report: each environment's copy of the bundled GGUF was converted and packed again. A copy in
    another folder (newer mtime, as pip writes it) resolves to the bundled model's own folder, converting nothing.
    The folder is the one the other tests use (converted once per user), linked into a cache dir of this test's own
    so that the user's marker does not collect this test's paths."""
    from sinkchat.model import loader

    _, bundled = loader.resolve_source(None, lambda m: None)
    cache = tmp_path / "cache"
    shutil.copytree(bundled, cache / "models" / Path(bundled).name, copy_function=os.link)
    monkeypatch.setenv("SINKCHAT_CACHE_DIR", str(cache))
    copy = tmp_path / "other-env" / loader.BUNDLED_FILE
    copy.parent.mkdir()
    shutil.copyfile(loader.bundled_gguf(), copy)
    said: list[str] = []
    _, again = loader.resolve_source(str(copy), said.append)
    assert again == str(cache / "models" / Path(bundled).name) and said == []
