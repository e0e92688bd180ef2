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
    (old / gguf_convert.TABLE).write_text(json.dumps({"architecture": "llama", "tensors": []}))
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
        (d / gguf_convert.MARKER).write_text(json.dumps({"from": str(kept)}))  # as sinkchat writes every one
        for p in (*d.iterdir(), d):
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


def test_clean_never_removes_a_folder_sinkchat_did_not_make(tmp_path, cache, conversions):
    """SINKCHAT_CACHE_DIR may be a folder of the user's (`/data`): a model folder of theirs in `models/` and a folder
    of notes in `tokenizers/` are listed as not sinkchat's and left alone by `clean`, even `--all`; sinkchat's own
    old-layout folders (both path-keyed layouts), temp dirs and tokenizer folders go."""
    from sinkchat.apps import cache as cache_app
    from sinkchat.cli import main

    week_ago = time.time() - 7 * 86400
    models = cache / "models"
    mine = models / "my-llama3"
    mine.mkdir(parents=True)
    (mine / "llama3.gguf").write_bytes(b"GGUF" + b"\0" * 100)
    looks_old = models / "notes-0123456789abcdef0123"  # the old name's pattern, but no sinkchat marker inside
    looks_old.mkdir()
    (looks_old / "config.json").write_text("{}")
    looks_new = models / f"{gguf_convert.PREFIX}{'a' * 20}"  # the current name, without a marker
    looks_new.mkdir()
    (looks_new / "data.bin").write_bytes(b"x")
    (models / ".notes.lock").write_text("mine")  # a lock file of some other tool's
    notes = cache / "tokenizers" / "notes"
    notes.mkdir(parents=True)
    (notes / "todo.txt").write_text("buy milk")
    for p in (*notes.iterdir(), notes, *mine.iterdir(), mine):
        os.utime(p, (week_ago, week_ago))
    theirs = [mine, mine / "llama3.gguf", looks_old, looks_new, notes, notes / "todo.txt", models / ".notes.lock"]
    old = _old_layout_entry(models, tmp_path / "model.gguf")
    first = models / "model-00112233445566778899"  # the first layout: the model in safetensors
    first.mkdir()
    (first / "config.json").write_text("{}")
    (first / "sinkchat-converted.json").write_text(json.dumps({"source": "/x/model.gguf", "version": 1}))
    (models / ".trash-gguf-v4-x-1").mkdir()
    tok = cache / "tokenizers" / ("b" * 20)
    tok.mkdir()
    (tok / gguf_convert.MARKER).write_text(json.dumps({"from": "/x/model.gguf"}))
    for p in (*tok.iterdir(), tok):
        os.utime(p, (week_ago, week_ago))
    status = {e.label: e.status for e in cache_app.entries()}
    assert status == {"models/.trash-gguf-v4-x-1": cache_app.PARTIAL, f"models/{looks_new.name}": cache_app.FOREIGN,
                      f"models/{first.name}": cache_app.OLD, "models/my-llama3": cache_app.FOREIGN,
                      f"models/{old.name}": cache_app.OLD, f"models/{looks_old.name}": cache_app.FOREIGN,
                      "tokenizers/notes": cache_app.FOREIGN, f"tokenizers/{tok.name}": cache_app.UNUSED}, status
    runner = CliRunner()
    r = runner.invoke(main, ["cache", "list"])
    assert r.exit_code == 0 and r.output.count("not sinkchat's") == 4, r.output
    for args in (["cache", "clean"], ["cache", "clean", "--all"], ["cache", "clean", "--all", "--older-than", "0"]):
        r = runner.invoke(main, args)
        assert r.exit_code == 0, r.output
        assert all(p.exists() for p in theirs), (args, r.output)
        assert "my-llama3" not in r.output and "notes" not in r.output, r.output
    assert not old.exists() and not first.exists() and not tok.exists() and not (models / ".trash-gguf-v4-x-1").exists()
    assert (mine / "llama3.gguf").read_bytes().startswith(b"GGUF") and (notes / "todo.txt").read_text() == "buy milk"


def _load_and_wait(path: str, cache_dir: str, ready: str, go: str, out: multiprocessing.Queue) -> None:
    """A loader: holds the entry as `loader.load` does, says so, waits for `go`, then reads the folder."""
    os.environ["SINKCHAT_CACHE_DIR"] = cache_dir
    try:
        with gguf_convert.prepared(Path(path), lambda m: None) as folder:
            Path(ready).write_text(str(folder))
            deadline = time.time() + 30
            while not os.path.exists(go) and time.time() < deadline:
                time.sleep(0.02)
            out.put(json.loads((folder / gguf_convert.MARKER).read_text())["version"])
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(repr(e))


def test_clean_skips_an_entry_another_process_is_loading(tmp_path, cache, conversions):
    """A process loading an entry holds its lock shared: `clean --all` (and an orphan's removal) skips that entry
    with a note, removes the rest, and the load reads its folder to the end; once it is done, the entry goes."""
    from sinkchat.apps import cache as cache_app
    from sinkchat.cli import main

    loading = write_gguf(tmp_path / "loading.gguf", seed=0)
    other = write_gguf(tmp_path / "other.gguf", seed=1)
    gguf_convert.prepare(other, lambda m: None)
    ready, go = tmp_path / "ready", tmp_path / "go"
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_load_and_wait, args=(str(loading), str(cache), str(ready), str(go), q))
    child.start()
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.02)
        folder = Path(ready.read_text())
        loading.unlink()  # its entry is now an orphan: plain `clean` would remove it too
        for args in (["cache", "clean"], ["cache", "clean", "--all"]):
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 0, r.output
            assert f"skipped models/{folder.name}: in use" in r.output and gguf_convert.is_done(folder), r.output
        assert [e.path for e in cache_app.entries() if e.path.parent.name == "models"] == [folder]
    finally:
        go.touch()
        child.join(60)
    assert child.exitcode == 0 and q.get(timeout=5) == gguf_convert.VERSION
    r = CliRunner().invoke(main, ["cache", "clean", "--all"])
    assert r.exit_code == 0 and f"removed models/{folder.name}" in r.output and not folder.exists(), r.output


def test_the_loader_holds_the_entry_while_it_reads_it(tmp_path, cache, conversions, monkeypatch):
    """`loader.load` holds a GGUF's entry from its conversion to the end of the load (here: when it reads the
    config), and lets it go after; a folder removed between the conversion and the lock is converted again."""
    from sinkchat.apps import cache as cache_app
    from sinkchat.config import ModelConfig
    from sinkchat.model import loader

    path = write_gguf(tmp_path / "model.gguf")
    seen = []

    def read_config(src):
        seen.append((Path(src), cache_app._held(Path(src)), gguf_convert.is_done(Path(src))))
        raise loader.LoadError("stop here")

    monkeypatch.setattr(loader, "_load_config", read_config)
    with pytest.raises(loader.LoadError, match="stop here"):
        loader.load(ModelConfig(model=str(path)))
    [(folder, held, done)] = seen
    assert held and done and not cache_app._held(folder)
    real_prepare = gguf_convert.prepare

    def prepare_then_clean(p, progress):  # `cache clean --all` runs between the conversion and the lock
        out = real_prepare(p, progress)
        if _count(conversions) == 1:
            assert cache_app.remove(cache_app._model_entry(out))
        return out

    monkeypatch.setattr(gguf_convert, "prepare", prepare_then_clean)
    with gguf_convert.prepared(path, lambda m: None) as again:
        assert again == folder and gguf_convert.is_done(again) and _count(conversions) == 2
