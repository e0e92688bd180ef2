"""Start-up (issue #33 item 3): what a start imports and how often it parses the GGUF. Never wall-clock time here
(benchmarks/startup.py measures that); each check fails on the regression that made a start slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from sinkchat import cli

HEAVY = ("torch", "transformers", "numpy", "rich", "prompt_toolkit", "gguf", "tokenizers", "jinja2")

# the modules are listed by an atexit handler: a piped chat ends in `exits.exit_now`, which runs those, then `_exit`
PROBE = """
import atexit, json, sys
sys.argv = ["sinkchat", *json.loads(sys.argv[1])]
def modules():
    mods = sorted({m.split(".")[0] for m in sys.modules} | set(sys.modules))
    sys.stderr.write("\\nMODULES " + json.dumps(mods) + "\\n")
atexit.register(modules)
import gc
atexit.register(lambda: sys.stderr.write("\\nGCSTATS " + json.dumps([gc.isenabled(), gc.get_freeze_count(),
                                                                    [s["collections"] for s in gc.get_stats()]]) + "\\n"))
from sinkchat.cli import run
try:
    run()
except SystemExit:
    pass
"""


def imported_by(*args: str) -> set[str]:
    """The modules a `sinkchat ARGS` process imported, in a fresh interpreter."""
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], capture_output=True, text=True,
                       timeout=120)
    line = [x for x in r.stderr.splitlines() if x.startswith("MODULES ")]
    assert line, r.stderr[-2000:]
    return set(json.loads(line[-1].removeprefix("MODULES ")))


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("-h",)])
def test_help_imports_nothing_heavy(args: tuple[str, ...]) -> None:
    """`sinkchat --help` took 1.6-2.5 s because listing the commands imported every command module (torch and
    transformers with the agent's grammar): it must import neither those libraries nor any command's module."""
    mods = imported_by(*args)
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))
    assert not [m for m in mods if m.count(".") >= 3 and m.startswith("sinkchat.apps.")], sorted(mods)


@pytest.mark.parametrize("width", [50, 80, 200])
def test_summaries_match_the_commands(width: int) -> None:
    """The command list `--help` prints from `cli.SUMMARIES` equals click's own, built from the imported commands
    (a command whose docstring changed without its summary here fails)."""
    ctx = click.Context(cli.main)
    ours, theirs = click.HelpFormatter(width=width), click.HelpFormatter(width=width)
    cli.LazyGroup.format_commands(cli.main, ctx, ours)
    click.Group.format_commands(cli.main, ctx, theirs)
    assert ours.getvalue() == theirs.getvalue()
    assert set(cli.SUMMARIES) == set(cli.COMMANDS)


# ------------------------------------------------------------------------------------------ the first start
@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SINKCHAT_CACHE_DIR", str(d))
    return d


def _no_gguf_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("gguf.GGUFReader parsed the file (2.6-20 s on a real vocabulary)")

    monkeypatch.setattr(gguf, "GGUFReader", boom)


@pytest.mark.slow  # gguf-py's full parse of the bundled file, ~12 s idle
def test_inspect_reads_what_gguf_py_reads(tmp_path, monkeypatch):
    """`inspect` takes every value from the header scan, without gguf-py's parse: the architecture's fields
    (Gemma's window pattern, soft-capping, key length) and the rest equal gguf-py's `contents()`."""
    import gguf
    import gguf_gemma

    from sinkchat.model import gguf_file
    from sinkchat.model.loader import bundled_gguf

    files = [bundled_gguf(), gguf_gemma.write_gguf(gguf_gemma.tiny_model("gemma2"), tmp_path / "g2.gguf", "F32")]
    want = []
    for path in files:
        r = gguf.GGUFReader(str(path), "r")
        want.append({k: f.contents() for k, f in r.fields.items()
                     if not k.startswith(("GGUF.", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                          "tokenizer.ggml.token_type", "tokenizer.ggml.scores"))})
    _no_gguf_reader(monkeypatch)
    for path, values in zip(files, want):
        info = gguf_file.inspect(path)
        head = gguf_file.scan(path)
        assert {k: v for k, v in head.values.items() if k in values} == values
        arch = info.architecture
        assert info.hparams == {k.removeprefix(f"{arch}."): v for k, v in values.items() if k.startswith(f"{arch}.")}
        assert info.hparams and info.key_length == values.get(f"{arch}.attention.key_length")
    assert gguf_file.inspect(files[0]).tokenizer_key == gguf_file.inspect(files[1]).tokenizer_key  # one tokenizer


def test_config_dict_is_transformers_own(tmp_path):
    """`gguf_meta.config_dict` equals transformers' `load_gguf_checkpoint(...)["config"]` for every architecture
    sinkchat maps (and the bundled file), without its parse."""
    import gguf_gemma
    import gguf_models
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from sinkchat.model import gguf_meta

    files = [gguf_models.write_gguf(gguf_models.tiny_model(a), tmp_path / f"{a}.gguf", "F32", tokenizer=False)
             for a in gguf_models.ARCHS]
    files += [gguf_gemma.write_gguf(gguf_gemma.tiny_model(a), tmp_path / f"{a}.gguf", "F32", tokenizer=False)
              for a in ("gemma2", "gemma3_text")]
    for path in files:
        assert gguf_meta.config_dict(path) == load_gguf_checkpoint(str(path), return_tensors=False)["config"], path


@pytest.mark.slow  # two conversions of the bundled file, one through transformers' parse, ~13 s idle
def test_first_start_parses_the_gguf_once_and_converts_the_same(tmp_path, cache, monkeypatch):
    """The bundled file's conversion without gguf-py's parse (it ran three times: 4.4 s twice in transformers and
    3.4 s in sinkchat's check) writes the very files transformers' own conversion wrote, byte for byte."""
    import contextlib

    from sinkchat.model import gguf_convert, gguf_meta
    from sinkchat.model.loader import bundled_gguf

    with monkeypatch.context() as m:
        m.setattr(gguf_meta, "served", lambda path: contextlib.nullcontext())  # transformers' own parse
        m.setenv("SINKCHAT_CACHE_DIR", str(tmp_path / "reference"))
        ref = gguf_convert.prepare(bundled_gguf(), lambda msg: None)
    _no_gguf_reader(monkeypatch)
    out = gguf_convert.prepare(bundled_gguf(), lambda msg: None)
    names = sorted(p.name for p in ref.iterdir() if p.name != gguf_convert.MARKER)
    assert names == sorted(p.name for p in out.iterdir() if p.name != gguf_convert.MARKER)
    assert "tokenizer.json" in names and "config.json" in names
    for name in names:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name


# ------------------------------------------------------------------------------------------ the later start
def _engines(monkeypatch: pytest.MonkeyPatch, model: str | None) -> tuple[object, object]:
    """A model's engine through transformers' model (the first start: it packs and writes the sidecar), then through
    `LightModel` (a later start), with the same settings."""
    from sinkchat.bootstrap import build_settings, open_engine
    from sinkchat.model import gguf_light

    settings = build_settings({"model": model, "quant": "q4", "threads": 1, "temperature": 0.0, "max_tokens": 12})
    with monkeypatch.context() as m:
        m.setattr(gguf_light, "load_for", lambda *a, **k: None)
        full = open_engine(settings, "You are brief.")
    light = open_engine(settings, "You are brief.")
    assert isinstance(light.model, gguf_light.LightModel) and not isinstance(full.model, gguf_light.LightModel)
    return full, light


@pytest.mark.parametrize("arch", ["bundled", "qwen2", "phi3"])
def test_the_light_model_computes_as_transformers_model(arch, tmp_path, cache, monkeypatch):
    """A later start's `LightModel` holds the same weights, spec, stop ids and fingerprint as the transformers
    model, replies with the same tokens and logits (the native step and prefill), and its transformers forward
    (built on first use around the same modules) and config digest (snapshots) are the transformers model's. The
    bundled Llama, a Qwen2 (q/k/v biases) and a Phi-3 (fused qkv and gate_up, partial rotary)."""
    import torch

    from sinkchat.core.tokens import stop_ids
    from sinkchat.model.light_tokenizer import LightTokenizer

    model = None
    if arch != "bundled":
        import gguf_models

        tiny = gguf_models.tiny_model(arch, seed=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2)
        model = str(gguf_models.write_gguf(tiny, tmp_path / f"{arch}.gguf", "Q8_0"))
    full, light = _engines(monkeypatch, model)
    assert light.spec == full.spec and light.loaded.fingerprint == full.loaded.fingerprint
    assert stop_ids(light.tokenizer, light.model) == stop_ids(full.tokenizer, full.model) == full.stop_ids
    # a plain TokenizersBackend through `tokenizers` + jinja2 directly; a class of transformers' own (Qwen2's) as is
    plain = type(full.tokenizer).__name__ == "TokenizersBackend"
    assert type(light.tokenizer) is (LightTokenizer if plain else type(full.tokenizer)), type(full.tokenizer)
    assert light.tokenizer is not full.tokenizer and (arch != "bundled" or plain)
    for name in ("special_tokens_map", "all_special_ids", "chat_template", "bos_token_id", "eos_token_id"):
        assert getattr(light.tokenizer, name) == getattr(full.tokenizer, name), name
    assert light.tokenizer.backend_tokenizer.to_str() == full.tokenizer.backend_tokenizer.to_str()
    a = {k: v for k, v in full.model.state_dict().items() if "rotary_emb" not in k}
    b = light.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert light.model.model.layers[1].self_attn is not full.model.model.layers[1].self_attn
    replies = []
    for eng in (full, light):
        ids = [e.token_id for e in eng.chat("What is the capital of France?") if type(e).__name__ == "TokenEvent"]
        replies.append((ids, eng.last_logits.clone()))
    assert replies[0][0] == replies[1][0] and len(replies[0][0]) > 3
    assert torch.equal(replies[0][1], replies[1][1])
    assert light.model.__dict__["_hf"] is None  # nothing so far needed transformers' model
    x = torch.tensor([[1, 504, 3458, 314, 4649, 30]])
    with torch.no_grad():
        want = full.model(input_ids=x, use_cache=False).logits
        got = light.model(input_ids=x, use_cache=False).logits
    assert torch.equal(got, want)
    assert light.model.config.to_json_string(use_diff=False) == full.model.config.to_json_string(use_diff=False)


def test_a_sidecar_that_does_not_match_the_weights_loads_through_transformers(cache, monkeypatch):
    """A sidecar naming other weights than the packed cache holds (a cache packed again, an edit) is not used, and
    the load through transformers writes a right one."""
    import json

    from sinkchat.config import ModelConfig
    from sinkchat.model import gguf_light, loader

    cfg = ModelConfig(quant="q4", threads=1, decoder="native")
    first = loader.load(cfg)
    side = Path(first.path) / gguf_light.sidecar_name("native")
    assert side.is_file() and not isinstance(first.model, gguf_light.LightModel)
    assert isinstance(loader.load(cfg).model, gguf_light.LightModel)
    data = json.loads(side.read_text())
    data["names"] = data["names"][1:]
    side.write_text(json.dumps(data))
    assert not isinstance(loader.load(cfg).model, gguf_light.LightModel)
    assert isinstance(loader.load(cfg).model, gguf_light.LightModel)  # that load wrote the sidecar again


def test_a_later_start_imports_no_transformers_model(tmp_path):
    """`echo hi | sinkchat` on a converted and packed model answers without importing transformers (its config,
    model and tokenizer classes, torch._dynamo with them, were 1.7-2.9 s of a 4-6 s start; transformers itself
    1.1 s more: the tokenizer goes through `tokenizers` directly, `light_tokenizer`), with the first start's reply."""
    env = {**os.environ, "SINKCHAT_CACHE_DIR": str(tmp_path / "cache")}
    args = json.dumps(["--max-tokens", "6", "--temperature", "0", "--no-log"])
    out, gcs = [], []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", PROBE, args], input="What is 2+2?\n", capture_output=True,
                           text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        line = [x for x in r.stderr.splitlines() if x.startswith("MODULES ")][-1]
        out.append((r.stdout, set(json.loads(line.removeprefix("MODULES ")))))
        gcs.append(json.loads([x for x in r.stderr.splitlines() if x.startswith("GCSTATS ")][-1][8:]))
    # the garbage collector off until the load ended, then what the start made frozen (`model/collector.py`): 41
    # collections on a later start where 440 took 0.7-0.8 s; on again for the reply
    for enabled, frozen, collections in gcs:
        assert enabled and frozen > 50_000 and sum(collections) < 150 and collections[2] <= 1, (frozen, collections)
    heavy = {"transformers.modeling_utils", "transformers.models.llama.modeling_llama",
             "transformers.models.llama.configuration_llama", "torch._dynamo", "transformers.models.auto",
             "transformers.tokenization_utils_base", "transformers.tokenization_utils_tokenizers"}
    assert out[0][0] == out[1][0] and out[0][0].strip()
    assert heavy <= out[0][1]  # the first start builds transformers' model (the check can fail)
    assert not heavy & out[1][1], sorted(heavy & out[1][1])
    # nor rich (its plain lines are written as rich would write them: `render.plain`), nor sqlite3 (--no-log's
    # NullLog, `store/nulllog.py`): 0.12 s and 0.05 s of a start at load 2-3
    assert not {"rich", "sqlite3", "sinkchat.store.sessionlog"} & out[1][1]
    # nor transformers at all (1.1 s): the KV cache's transformers base is deferred (`kv_cache.TransformersBase`)
    assert "transformers" not in out[1][1], sorted(m for m in out[1][1] if m.startswith("transformers"))[:5]
    # nor gguf-py (`ggml_types` sizes the header's tensors) nor prompt-toolkit (a terminal's prompt only): 0.1-0.4 s
    assert not {"gguf", "yaml", "prompt_toolkit"} & out[1][1], sorted({"gguf", "yaml", "prompt_toolkit"} & out[1][1])


def test_ggml_types_are_gguf_pys():
    """`ggml_types` (the header scan's sizes, without importing gguf-py) holds gguf-py's every type: its name, block
    and bytes; an id gguf-py does not know is refused as before."""
    from gguf.constants import GGML_QUANT_SIZES

    from sinkchat.model import ggml_types

    assert ggml_types.SIZES == {t.value: (t.name, *size) for t, size in GGML_QUANT_SIZES.items()}
    assert ggml_types.known(200) is None and ggml_types.name(14) == "Q6_K"
    assert (ggml_types.F32, ggml_types.F16, ggml_types.BF16) == (0, 1, 30)


# ------------------------------------------------------------------------------------------ the exit
CHAT = """
import atexit, json, sys
sys.argv = ["sinkchat", *json.loads(sys.argv[1])]
atexit.register(lambda: sys.stderr.write("\\nATEXIT\\n"))
if len(sys.argv) > 1 and sys.argv[-1] == "--thread":
    sys.argv.pop()
    import threading
    threading.Thread(target=threading.main_thread().join).start()  # alive until the interpreter's shutdown
from sinkchat.cli import run
try:
    run()
except SystemExit as e:
    sys.stderr.write(f"\\nRETURNED {e.code}\\n")
    raise
"""


def _piped_chat(args: list[str], home: Path, fast: bool, text: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SINKCHAT_HOME": str(home), "SINKCHAT_FAST_EXIT": "1" if fast else "0"}
    return subprocess.run([sys.executable, "-c", CHAT, json.dumps(args)], input=text, capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_piped_chat_ends_without_teardown_and_loses_nothing(tmp_path):
    """A piped chat ends in `exits.exit_now` (no interpreter teardown: 0.2-2.7 s of freeing torch) with everything a
    normal exit leaves: the same replies on stdout, atexit handlers run (the recall memory's folder removed), the
    session log closed as 'ended' with its turns, the automatic snapshot written; status 0."""
    from sinkchat.store import transcript

    args = ["--max-tokens", "24", "--temperature", "0", "--snapshot-every", "1", "--memory", "on", "--cache", "256"]
    got = {}
    for fast in (True, False):
        home = tmp_path / ("fast" if fast else "normal")
        r = _piped_chat(args, home, fast, "What is 2+2?\nName a colour.\n")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "ATEXIT" in r.stderr and ("RETURNED" in r.stderr) is not fast, r.stderr[-500:]
        (info,) = transcript.list_sessions(path=home / "sinkchat.db")
        assert info.status == "ended" and len(transcript.turns(info.id, path=home / "sinkchat.db")) == 4
        assert (home / "snapshots" / "auto" / f"session-{info.id}.safetensors").is_file()
        assert not list((home / "memory").iterdir())  # the store's folder went with the process (atexit)
        got[fast] = r.stdout
    assert got[True] == got[False] and got[True].count("\n") >= 2


def test_exit_now_waits_for_a_thread_and_not_for_an_error(tmp_path):
    """With a non-daemon thread alive the interpreter's own exit (which waits for it) ends the chat; a start that
    fails (status 1) exits as usual too."""
    r = _piped_chat(["--max-tokens", "2", "--no-log", "--thread"], tmp_path, True, "hi\n")
    assert r.returncode == 0 and "RETURNED 0" in r.stderr, r.stderr[-1500:]
    r = _piped_chat(["--model", str(tmp_path / "missing.gguf"), "--no-log"], tmp_path, True, "hi\n")
    assert r.returncode == 1 and "RETURNED 1" in r.stderr and "ATEXIT" in r.stderr, r.stderr[-1500:]
