"""One-token decoding without transformers' module stack: the same math as the model's forward, in ~20 tensor ops a
layer, over the sink cache's fixed-size buffers, so torch.compile can turn it into one static-shape graph.

Why: a decode step of the bundled model spends ~13 ms in its matmuls and attention and, through transformers'
`forward`, ~14 ms more in Python (masks, cache API, ~700 small ops). This step fuses q/k/v and gate/up into one
int4 matmul each, and attends over all `capacity` slots with a -inf bias on the empty ones, so every call has the
same shapes whatever the cache holds (the sink policy keeps the cache full anyway). Compiled by inductor (C++
wrapper, elementwise ops fused) it costs the kernels plus ~1 ms. The transformers forward stays the reference:
tests check that this step's logits and cache writes match it.

Where sinkchat's kernels run (AVX-512, AVX-VNNI, AVX2 or NEON and a C compiler), `NativeStep` (the same math in C
over those kernels) is faster still and needs no build; this torch step is the path elsewhere, and for
`--decoder compiled|eager`.

Only what can be checked is taken: Llama / Qwen2 shaped decoders (`ModelSpec.fast_step_refusal`) whose linears are
all `Int4Linear` (`--quant q4`), fp32 compute. Anything else returns None from `TorchStep.for_model` and the Engine keeps the
transformers forward.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from sinkchat.model import heap
from sinkchat.model import int4
from sinkchat.model.spec import ModelSpec

log = logging.getLogger(__name__)

PACK_ROWS = 64  # the CPU int4 pack interleaves output rows in blocks of 64: only whole blocks can be stacked


@dataclass
class Projection:
    """One projection (q/k/v, o, gate/up or down) of every layer, stacked over layers, so the compiled step takes a
    dozen weight tensors instead of ~300 (each graph input costs a guard check and pointer setup per call).

    Fused along the output dim: one kernel call instead of three (q, k, v) or two (gate, up). Groups run along the
    input dim, so stacking rows keeps every (scale, zero) pair with its weights, as long as every stacked part but
    the last fills whole 64-row pack blocks; otherwise the parts run one call each. The model's own Int4Linears are
    pointed at views of the stacks, so the 4-bit weights are in memory once; fused scales stay duplicated (1/8 of
    the bytes: the kernel needs them contiguous, which a column slice of a fused [K/g, N, 2] is not)."""

    parts: list[tuple[torch.Tensor, torch.Tensor]]  # (uint8 [L, N, K/2], bf16 [L, K/g, N, 2]) per kernel call
    bias: torch.Tensor | None  # fp32 [L, N total]

    @classmethod
    def of(cls, per_layer: list[list[Any]]) -> "Projection":
        first = per_layer[0]
        groups: list[list[int]] = [[]]
        for j, lin in enumerate(first):
            groups[-1].append(j)
            if lin.out_features % PACK_ROWS:
                groups.append([])
        parts = [_stack_group(per_layer, g) for g in groups if g]
        bias = None
        if any(lin.bias is not None for lins in per_layer for lin in lins):
            bias = torch.stack([torch.cat([lin.bias.data if lin.bias is not None else torch.zeros(lin.out_features)
                                           for lin in lins]) for lins in per_layer])
        return cls(parts, bias)

    def __call__(self, x: torch.Tensor, i: int) -> torch.Tensor:  # layer i: x [M, K] fp32 -> [M, N] fp32
        xc = x.to(int4.COMPUTE_DTYPE)
        ys = [torch._weight_int4pack_mm_for_cpu(xc, p[i], int4.GROUP, sz[i]) for p, sz in self.parts]
        y = (ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)).float()
        return y if self.bias is None else y + self.bias[i]


def _stack_group(per_layer: list[list[Any]], group: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack linears `group` of every layer: packed [L, N, K/2] and scales [L, K/g, N, 2]; re-point the modules."""
    packed = torch.stack([torch.cat([lins[j].packed for j in group]) for lins in per_layer])
    scales = torch.stack([torch.cat([lins[j].scales_zeros for j in group], dim=1) for lins in per_layer])
    for i, lins in enumerate(per_layer):
        row = 0
        for j in group:
            lins[j].packed = packed[i, row : row + lins[j].out_features]
            row += lins[j].out_features
        if len(group) == 1:
            lins[group[0]].scales_zeros = scales[i]
    return packed, scales


@dataclass
class Weights:
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    norm_in: torch.Tensor  # fp32 [L, C]: the RMSNorm weights, applied with transformers' formula
    norm_post: torch.Tensor  # fp32 [L, C]
    eps: float
    n_layers: int
    embed: nn.Module
    norm: nn.Module
    head: nn.Module
    inv_freq: torch.Tensor  # fp32 [D/2]
    rope_scale: float
    n_heads: int
    n_kv: int
    head_dim: int
    inter: int
    scaling: float


def decode_one(tok: torch.Tensor, pos: torch.Tensor, n_gauge: torch.Tensor, keys: list[torch.Tensor],
               values: list[torch.Tensor], w: Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token `tok` [1] at in-cache slot `pos` [1]: writes its k/v into slot pos of every keys[i] / values[i]
    [1, H_kv, cap, D] (separate tensors: mutating views of one stacked input sends the compiled graph down a slow
    aliasing path) and attends over slots <= pos. Returns logits [1, V], the pre-RoPE queries [L, H*D], and the
    sink gauge [L, 3]: per layer, the attention share (mean over heads) on the first `n_gauge` [1] slots, on the
    newest `n_gauge`, and on recalled memory slots: always 0 here (this step attends no recall region: the Engine
    hands calls with memory to transformers' forward), a column so every step's gauge has the native step's shape.
    Read off the softmax the step computes anyway, so the gauge costs nothing. Static shapes: nothing depends on
    pos's value."""
    H, Hkv, D = w.n_heads, w.n_kv, w.head_dim
    G, half = H // Hkv, w.head_dim // 2
    cap = keys[0].shape[2]
    x = w.embed(tok[None]).float()[0]  # [1, C]
    ang = pos.float()[:, None] * w.inv_freq  # [1, D/2], as transformers: fp32 position x inv_freq
    ang = torch.cat([ang, ang], dim=-1)  # [1, D]
    cos, sin = ang.cos() * w.rope_scale, ang.sin() * w.rope_scale
    slots = torch.arange(cap)
    bias = torch.where(slots <= pos, 0.0, float("-inf"))  # [cap]: slots after pos are empty
    marks = torch.stack([slots < n_gauge, (slots <= pos) & (slots > pos - n_gauge)], dim=1).float()  # [cap, 2]
    queries, probs = [], []
    for i in range(w.n_layers):
        qkv = w.qkv(_rms(x, w.norm_in[i], w.eps), i)  # [1, (H + 2 H_kv) D]
        q_raw = qkv[:, : H * D]
        queries.append(q_raw)
        q = _rope(q_raw.view(Hkv, G, D), cos, sin, half)  # [H_kv, G, D]: the G query heads sharing a kv head
        k = _rope(qkv[:, H * D : (H + Hkv) * D].view(1, Hkv, 1, D), cos, sin, half)  # [1, H_kv, 1, D]
        v = qkv[:, (H + Hkv) * D :].view(1, Hkv, 1, D)
        K, V = keys[i], values[i]  # [1, H_kv, cap, D]
        K.index_copy_(2, pos, k.to(K.dtype))
        V.index_copy_(2, pos, v.to(V.dtype))
        s = torch.bmm(q.to(K.dtype), K[0].transpose(1, 2)).float() * w.scaling + bias  # [H_kv, G, cap]
        p = torch.softmax(s, dim=-1)
        probs.append(p)
        o = torch.bmm(p.to(V.dtype), V[0]).float().reshape(1, H * D)  # [1, H*D]
        x = x + w.o(o, i)
        gu = w.gate_up(_rms(x, w.norm_post[i], w.eps), i)  # [1, 2I]
        x = x + w.down(nn.functional.silu(gu[:, : w.inter]) * gu[:, w.inter :], i)
    logits = w.head(w.norm(x)).float()  # [1, V]
    gauge = (torch.stack(probs).reshape(w.n_layers, H, cap) @ marks).mean(1)  # [L, H, 2] -> [L, 2]
    gauge = torch.cat([gauge, gauge.new_zeros(w.n_layers, 1)], dim=1)  # [L, 3]: no recalled slots attended
    return logits, torch.cat(queries), gauge  # [1, V], [L, H*D], [L, 3]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm for fp32 x [1, C]."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one position (rotate_half layout)."""
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin


def unsupported_reason(model: Any, kernels: str = "torch") -> str | None:
    """Why `decode_one` (kernels="torch"), or the native step (kernels="native"), cannot run this model's weights
    (None: they can): a decoder stack with every linear packed for those kernels, fp32 on the CPU. Whether the
    model's shape is one the steps implement is `ModelSpec.fast_step_refusal`."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "no decoder stack"
    norm = getattr(base, "norm", None)
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return "not fp32 on the CPU"
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        lins = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        lins += [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(lin, int4.Int4Linear) for lin in lins):
            return "linears not all q4"
        if any(lin.kernels != kernels for lin in lins):
            return f"q4 weights packed for the {lins[0].kernels} kernels"
        if hasattr(a, "sinks"):
            return "attention variant (learned sinks)"
    return None


def weights_of(model: Any, spec: ModelSpec) -> Weights:
    base = model.model
    attn = [layer.self_attn for layer in base.layers]
    mlp = [layer.mlp for layer in base.layers]
    return Weights(
        qkv=Projection.of([[a.q_proj, a.k_proj, a.v_proj] for a in attn]), o=Projection.of([[a.o_proj] for a in attn]),
        gate_up=Projection.of([[m.gate_proj, m.up_proj] for m in mlp]), down=Projection.of([[m.down_proj] for m in mlp]),
        norm_in=torch.stack([layer.input_layernorm.weight.detach().float() for layer in base.layers]),
        norm_post=torch.stack([layer.post_attention_layernorm.weight.detach().float() for layer in base.layers]),
        eps=spec.norm.eps, n_layers=spec.n_layers,
        embed=model.get_input_embeddings(), norm=base.norm, head=model.get_output_embeddings(),
        inv_freq=spec.inv_freq(0), rope_scale=spec.layers[0].rope.attention_scaling,
        n_heads=spec.n_heads, n_kv=spec.n_kv, head_dim=spec.head_dim, inter=spec.inter, scaling=spec.layers[0].scaling,
    )


class TorchStep:
    """The Engine's single-token path: `decode_one` run eagerly at once, and swapped for its compiled form as soon
    as inductor has built it. One build serves every cache size (the slot dimension is compiled as dynamic) for a
    given kv dtype. `mode`: "eager" never compiles; "auto" builds in a background thread (the first build takes
    ~1.5 min of one core; later runs load it from inductor's on-disk cache in seconds); "compiled" builds in the
    foreground on the first token."""

    def __init__(self, model: Any, spec: ModelSpec, mode: str = "eager", build_cmd: list[str] | None = None,
                 build_key: str = "") -> None:
        """`build_cmd`: a command that builds this step into inductor's on-disk cache in another process
        (`sinkchat.decode.build`). With it, "auto" builds there and then only loads the build here: a build in a
        thread of this process holds the GIL for a minute and a half, and the eager step, which needs the GIL
        between its ~600 ops, slowed from ~44 to ~2 tok/s meanwhile (and RSS kept ~90 MB of compiler garbage).
        `build_key` (the loaded weights' fingerprint) names a marker left in inductor's cache dir after a build, so
        later sessions skip the build process and load the cached build at once."""
        self.w = weights_of(model, spec)
        heap.trim()  # stacking freed the per-layer copies; glibc keeps such holes (~30 MB of RSS) unless asked
        self.mode = mode
        self.build_cmd = build_cmd
        self.build_key = build_key
        self._stopping = False
        self._compiled: Callable[..., Any] | None = None
        self._ready: set[torch.dtype] = set()
        self._pending: set[torch.dtype] = set()
        self._lock = threading.Lock()
        self._marked: torch.Tensor | None = None  # the buffers last marked dynamic
        self.failed: str | None = None if mode == "eager" or compiler_available() else "no C++ compiler found"

    @property
    def n_kv(self) -> int:
        return self.w.n_kv

    @property
    def head_dim(self) -> int:
        return self.w.head_dim

    @classmethod
    def for_model(cls, model: Any, spec: ModelSpec, mode: str, build_cmd: list[str] | None = None,
                  build_key: str = "") -> "TorchStep | None":
        reason = spec.fast_step_refusal(native=False) or unsupported_reason(model)
        if reason is not None:
            log.info("fast decode step off: %s", reason)
            return None
        return cls(model, spec, mode, build_cmd, build_key)

    def __call__(self, tok: int, pos: int, keys: list[torch.Tensor], values: list[torch.Tensor], n_gauge: int = 4
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`decode_one` for `tok` at slot `pos` (k/v written there): logits, queries, gauge shares [L, 3]."""
        dtype = keys[0].dtype
        if self.mode == "compiled":
            self.prepare(dtype)  # builds now, on the first token
        t, p, n = torch.tensor([tok]), torch.tensor([pos]), torch.tensor([n_gauge])
        with torch.no_grad():
            if dtype not in self._ready or self._compiled is None:
                return decode_one(t, p, n, keys, values, self.w)
            if self._marked is not keys[0]:
                _mark_slots_dynamic(keys + values)
                self._marked = keys[0]
            return self._compiled(t, p, n, keys, values, self.w)

    def warm_up(self, kv_dtype: torch.dtype) -> None:
        """In "auto" mode, start building in the background now (while the user types); "compiled" mode waits for
        the first token, so a command that never decodes (ppl) never compiles."""
        if self.mode == "auto":
            self.prepare(kv_dtype)

    def prepare(self, kv_dtype: torch.dtype) -> None:
        """Make sure a compiled step for this kv dtype exists or is being built (per `mode`)."""
        if self.mode == "eager" or self.failed or kv_dtype in self._ready or kv_dtype in self._pending:
            return
        self._pending.add(kv_dtype)
        if self.mode == "compiled":
            self._build(kv_dtype)
        else:
            target = self._build_elsewhere if self.build_cmd else self._build
            threading.Thread(target=target, args=(kv_dtype,), name="sinkchat-compile", daemon=True).start()

    def _build_elsewhere(self, dtype: torch.dtype) -> None:
        """Run `build_cmd` (at low priority, so the chat keeps the CPU), then load its build from the disk cache.
        Leaving sinkchat stops a build still running (no process outlives the session)."""
        marker = self._marker(dtype)
        if marker is None or not marker.exists():
            if not self._run_build_process(dtype):
                self._pending.discard(dtype)
                return
            if marker is not None:
                try:
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.touch()
                except OSError as e:  # a read-only cache: the next session just builds again
                    log.info("cannot record the build (%s)", e)
        self._build(dtype)  # a cache hit now: seconds

    def _run_build_process(self, dtype: torch.dtype) -> bool:
        cmd = [*self.build_cmd, str(dtype).removeprefix("torch.")]  # type: ignore[misc]
        try:
            # its own session: the Ctrl-C that stops a reply must not reach the build (it would fail for good)
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, start_new_session=True)
            atexit.register(self.stop_build)
            _, err = self._proc.communicate()
            rc = self._proc.returncode
            atexit.unregister(self.stop_build)
        except (OSError, subprocess.SubprocessError) as e:
            rc, err = 1, str(e).encode()
        if rc != 0 and not self._stopping:
            tail = (err or b"").decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            self.failed = f"build process exited {rc}: {tail[0][:200]}"
            log.warning("building the decode step failed, decoding stays eager (%s)", self.failed)
        return rc == 0

    def _marker(self, dtype: torch.dtype) -> Path | None:
        """Where a finished build for these weights, kv dtype, torch and this file's code is recorded (inside
        inductor's cache dir, so clearing that cache clears the marker too)."""
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if not self.build_key or not cache:
            return None
        import transformers

        key = f"{self.build_key}|{dtype}|{torch.__version__}|{transformers.__version__}|{torch.get_num_threads()}|"
        h = hashlib.sha256(key.encode() + Path(__file__).read_bytes() + Path(int4.__file__).read_bytes())
        return Path(cache) / f"sinkchat-step-{h.hexdigest()[:20]}.built"

    def stop_build(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            self._stopping = True
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _build(self, dtype: torch.dtype) -> None:
        t0 = time.perf_counter()
        try:
            with self._lock:
                fn = self._compiled or _compile()
                w = self.w
                keys = [torch.zeros(1, w.n_kv, 16, w.head_dim, dtype=dtype) for _ in range(w.n_layers)]
                values = [torch.zeros_like(k) for k in keys]  # [1, H_kv, 16, D] each
                _mark_slots_dynamic(keys + values)
                with torch.no_grad():
                    fn(torch.tensor([0]), torch.tensor([0]), torch.tensor([4]), keys, values, w)  # builds here
                self._compiled = fn
            self._ready.add(dtype)
            log.info("compiled the decode step (kv %s) in %.1f s", dtype, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - compiling is an optimisation: the eager step stays correct
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log.warning("compiling the decode step failed, decoding stays eager (%s)", self.failed)
        finally:
            self._pending.discard(dtype)
            heap.trim()  # the compiler's garbage: ~90 MB of RSS otherwise

    @property
    def status(self) -> str:
        """What decodes now: "eager", "compiling" (eager meanwhile), "compiled" or "eager (compile failed)"."""
        if self.failed:
            return "eager (compile failed)" if self.mode != "eager" else "eager"
        if self._pending:
            return "compiling"
        return "compiled" if self._ready else "eager"


def _compile() -> Callable[..., Any]:
    import torch._inductor.config as inductor_config

    inductor_config.cpp_wrapper = True  # the whole step is one C++ call: no Python per op
    inductor_config.compile_threads = 1  # no worker pool forked from a threaded process
    return torch.compile(decode_one, fullgraph=True, dynamic=False)


def _mark_slots_dynamic(buffers: list[torch.Tensor]) -> None:
    """The slot dimension of [1, H_kv, cap, D] buffers is symbolic in the compiled graph: one build for all sizes."""
    for b in buffers:
        torch._dynamo.mark_dynamic(b, 2)


def compiler_available() -> bool:
    """inductor's CPU backend needs a C++ compiler (CXX, or g++ / clang++ on PATH)."""
    cxx = os.environ.get("CXX")
    return bool((cxx and shutil.which(cxx)) or shutil.which("g++") or shutil.which("clang++"))
