#!/usr/bin/env python
"""Passkey retrieval through the sink cache: recall memory on, off, and a dense cache as the model's own ceiling.

The Landmark / InfLLM format: an instruction, filler ("The grass is green. The sky is blue. The sun is yellow. Here
we go. There and back again." repeated), the needle "The pass key is K. Remember it. K is the pass key." at an even
spread of depths, more filler, then "What is the pass key? The pass key is". A trial is right when the greedy reply's
first number is K. Each length's trials use the same keys and depths in every mode (seeded), fed as one document
through the Engine (`Engine.feed_ids`, the BOS first), as `ppl` feeds a text.

Retrieval is reported apart from answering: for memory-on trials, whether the needle's block was among the blocks
the last prompt token recalled, in how many of the memory layers.

Usage: python benchmarks/passkey.py [--lengths 4096,16384] [--trials 20] [--cache 1024] [--modes off,on,dense]
                                    [--haystack filler|prose] [--task passkey|number|kv] [--no-intro] [--out DIR]
                                    [--model M] [--topk K] [--block B] [--rule far|attn|bound|mass] [--reps R]
                                    [--oracle] [--reread N] [--resume]
Appends every trial to DIR/trials.jsonl as it ends, writes DIR/passkey.json (every trial) at the end and prints the
table (right / trials per length and mode). `--resume` (the same arguments) skips the trials DIR/trials.jsonl already
holds: a 128k run takes hours, and a killed one goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_REPS = 4  # --reps, for modes "on:RULE" that name none
REREAD = None  # --reread: blocks read again before the question (None: the setting's default)
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
         "you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


NUMBER_INTRO = ("There is an important number hidden inside a lot of irrelevant text. Find it and memorize it. I "
                "will quiz you about it.\n")
KV_INTRO = "Extract the value of the specified key from the JSON object below.\n{\n"


def needle(key: Any, task: str = "passkey") -> str:
    if task == "number":  # infinite-bench Retrieve.Number: a 10-digit number
        return f"The sequence of digits is {key}. Remember it. {key} is the sequence of digits. "
    if task == "kv":  # infinite-bench Retrieve.KV: one UUID pair among many
        return f'"{key[0]}": "{key[1]}",\n'
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def task_parts(task: str, key: Any) -> tuple[str, str]:
    """(intro, question) of a trial."""
    if task == "number":
        return NUMBER_INTRO, "\nWhat is the sequence of digits? The sequence of digits is"
    if task == "kv":
        return KV_INTRO, f'}}\nKey: "{key[0]}"\nThe value associated with the specified key is: "'
    return INTRO, QUESTION


def new_key(task: str, rng: random.Random) -> Any:
    if task == "number":
        return str(rng.randint(10**9, 10**10 - 1))
    if task == "kv":
        return (str(uuid.UUID(int=rng.getrandbits(128))), str(uuid.UUID(int=rng.getrandbits(128))))
    return rng.randint(10000, 99999)


def is_right(task: str, key: Any, reply: str) -> bool:
    if task == "kv":
        return reply.strip().strip('"').startswith(key[1])
    found = re.search(r"\d+", reply)
    return bool(found and found.group() == str(key))


def haystack_units(kind: str, task: str = "passkey") -> list[str]:
    """The text the needle hides in, as sentence-sized units: the filler, or real prose (a public-domain text); for
    the KV task, other UUID pairs."""
    if task == "kv":
        rng = random.Random(1)
        return [needle(new_key("kv", rng), "kv") for _ in range(5000)]
    if kind == "filler":
        return [FILLER]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llamacpp_tools as lt  # type: ignore[import-not-found]

    text = Path(lt.canterbury("lcet10.txt")).read_text(encoding="utf-8", errors="replace")
    return [u.strip() + " " for u in re.split(r"(?<=[.!?])\s+", text) if u.strip()]


def build(engine: Any, units: list[str], length: int, depth: float, key: Any, intro: bool = True,
          task: str = "passkey") -> tuple[list[int], int]:
    """Token ids of one trial near `length` tokens and the stream index where the needle starts."""
    enc = engine.encode
    intro_text, question = task_parts(task, key)
    head, q, nd = enc(intro_text) if intro else [], enc(question), enc(needle(key, task))
    body_len = max(0, length - len(head) - len(q) - len(nd) - 1)
    body: list[int] = []
    i = 0
    while len(body) < body_len:
        body += enc(units[i % len(units)])
        i += 1
    body = body[:body_len]
    at = int(body_len * depth)
    ids = engine.encode_document("")[:1] if engine.encode_document("") else []
    ids = ids + head + body[:at] + nd + body[at:] + q
    return ids, len(ids) - len(q) - len(body) + at - len(nd)


def answer(engine: Any, ids: list[int], start: int, n: int, max_tokens: int = 10, oracle: list[Any] | None = None,
           question: int = 0) -> tuple[str, int | None]:
    """The greedy reply, and in how many memory layers the last prompt token recalled the needle (None: off). The
    last `question` ids are the question: the document is fed, then what the memory holds that the question names
    is read again (`Engine.feed_query`, as a chat message gets it; nothing with the memory off or `--memory-reread 0`),
    then the question."""
    engine.clear()
    cut = len(ids) - question
    for _ in engine.feed_ids(ids[:cut]):
        pass
    for _ in engine.feed_query(ids[cut:]):
        pass
    hits = needle_layers(engine, start, n) if engine.memory is not None else None  # None: off, or not in a block
    if oracle is not None and hits is not None:
        oracle.append(oracle_layers(engine, start, n))
    text = ""
    for ev in engine.generate(max_tokens=max_tokens):
        text = getattr(ev, "text", text) if type(ev).__name__ == "DoneEvent" else text
    return text, hits


def needle_layers(engine: Any, start: int, n: int) -> int | None:
    """In how many memory layers the last prompt token's recall held a block overlapping the needle; None when no
    stored block holds a needle token (the needle is still in the window or the queue)."""
    mem = engine.memory
    where = mem.store.where
    start += engine.ledger.start  # stream indices run on across clears
    if not any(w.first < start + n and w.last > start for w in where.values()):
        return None
    hits = 0
    for c in mem.chosen:
        if any(b in where and where[b].first < start + n and where[b].last > start for b in c):
            hits += 1
    return hits


def needle_reread(engine: Any, start: int, n: int) -> bool | None:
    """Whether a block read again before the question (`Engine.feed_query`) held a needle token; None: memory off."""
    mem = engine.memory
    if mem is None:
        return None
    where, start = mem.store.where, start + engine.ledger.start
    return any(b in where and where[b].first < start + n and where[b].last > start for b in mem.reread)


def oracle_layers(engine: Any, start: int, n: int) -> tuple[int, int]:
    """(rule, exact): in how many memory layers the needle's block is among the top-k of the next choice (the last
    prompt token's queries) by the memory's own rule, and by the exact attention mass those queries would put on
    each block with all its keys (per query head a softmax over every stored key, summed over the block and the
    heads): the best any index of a few rows a block can do with these queries."""
    import torch

    mem = engine.memory
    where, ids, k = mem.store.where, mem.index_ids, mem.topk
    start += engine.ledger.start
    hit = {i for i, b in enumerate(ids) if where[b].first < start + n and where[b].last > start}
    pos = engine.pinned_slots()
    rule = sum(any(ids.index(b) in hit for b in c) for c in mem.choose(pos))
    q = mem._rotated_queries(pos).float()  # [M, H_kv, G, D]
    lse = []
    for b in ids:
        blk = mem.store.read(b)
        un = mem._rotate(blk.keys.float(), torch.from_numpy(-blk.slots.astype("int64")))  # [M, H_kv, n, D]
        dots = torch.einsum("mkgd,mknd->mkgn", q, un) * mem.scaling.float()[:, None, None, None]
        lse.append(torch.logsumexp(dots, -1))  # [M, H_kv, G]
    mass = torch.softmax(torch.stack(lse), 0).sum((2, 3))  # [NB, M]
    top = mass.topk(min(k, len(ids)), dim=0).indices  # [k, M]
    return rule, sum(any(int(i) in hit for i in top[:, m]) for m in range(mass.shape[1]))


def recall_line(layers: list[int], engine: Any) -> str:
    """", needle's block stored in N trials: recalled in a..b of M layers (median x)" for memory-on runs."""
    if engine.memory is None or not layers:
        return ""
    s = sorted(layers)
    med = (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
    return (f", needle in a block in {len(s)} trials: recalled in {s[0]}-{s[-1]} of {len(engine.memory.layers)} "
            f"layers (median {med:g}), in >= half the layers in {sum(x * 2 >= len(engine.memory.layers) for x in s)}")


def open_mode(mode: str, cache: int, length: int, model: str | None, topk: int, block: int, budget: int) -> Any:
    from sinkchat.api import start
    from sinkchat.bootstrap import build_settings

    from sinkchat.memory import recall

    if mode.startswith("on:"):  # "on:RULE" or "on:RULE:REPS": another retrieval rule, side by side in one run
        _, rule, *reps = mode.split(":")
        recall.RULE, recall.REPS = rule, int(reps[0]) if reps else DEFAULT_REPS
        mode = "on"
    opts: dict[str, Any] = {"temperature": 0.0, "model": model, "memory_topk": topk, "memory_block": block,
                            "memory_budget": budget, "memory_reread": REREAD}
    if mode == "dense":
        opts.update(policy="dense", cache_size=length + 64)
    else:
        opts.update(policy="sink", cache_size=cache, memory=mode)
    return start(build_settings(opts)).engine


SETUP = ("cache", "haystack", "topk", "block", "budget", "no_intro", "task", "model", "rule", "reps", "reread", "seed",
         "oracle")


def trial_key(target: int, mode: str, depth: float, key: Any) -> tuple[int, str, float, str]:
    return target, mode, depth, json.dumps(key)  # a kv key (a tuple) comes back from JSON as a list


def done_trials(path: Path, resume: bool, setup: dict[str, Any] | None = None
                ) -> dict[tuple[int, str, float, str], dict[str, Any]]:
    """The trials a killed run already recorded, by trial_key; a torn last line is dropped. The file's first line
    is the run's setup (`SETUP` arguments): a resume with another setup is refused (SystemExit with the
    difference), never mixed into it. Without `resume` the file starts over."""
    setup = setup or {}
    head = json.dumps({"setup": setup}) + "\n"
    done: dict[tuple[int, str, float, str], dict[str, Any]] = {}
    if resume and path.exists():
        for line in path.read_text().splitlines():
            try:
                t = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "setup" in t:
                if t["setup"] != setup:
                    diff = {k: (t["setup"].get(k), setup.get(k)) for k in sorted({*setup, *t["setup"]})
                            if t["setup"].get(k) != setup.get(k)}
                    raise SystemExit(f"{path} was run with another setup (recorded, now): {diff}; use another --out")
                continue
            done[trial_key(t["target"], t["mode"], t["depth"], t["key"])] = t
    tmp = path.with_name(path.name + ".tmp")  # rewritten whole (the torn line gone), then renamed into place
    tmp.write_text(head + "".join(json.dumps(t) + "\n" for t in done.values()))
    os.replace(tmp, path)
    return done


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    results: dict[str, Any] = {"args": vars(args), "trials": []}
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "trials.jsonl"
    done = done_trials(log, args.resume, {k: getattr(args, k) for k in SETUP})
    units_cache: list[str] | None = None
    for length in args.lengths:
        keys = [new_key(args.task, rng) for _ in range(args.trials)]
        depths = [(i + 0.5) / args.trials for i in range(args.trials)]
        for mode in args.modes:
            try:
                engine = open_mode(mode, args.cache, length, args.model, args.topk, args.block, args.budget)
            except Exception as e:  # noqa: BLE001 - a dense cache past the model's context: say so, go on
                print(f"{length:>7} {mode:>5}: not run ({e})", file=sys.stderr)
                continue
            units_cache = units_cache or haystack_units(args.haystack, args.task)
            right, layers, oracle = 0, [], []
            for key, depth in zip(keys, depths):
                if (old := done.get(trial_key(length, mode, depth, key))) is not None:
                    results["trials"].append(old)
                    right += old["right"]
                    layers += [] if old["needle_layers"] is None else [old["needle_layers"]]
                    print(f"{length:>7} {mode:>5} depth {depth:.2f}: {'right' if old['right'] else 'WRONG'} "
                          "(recorded before)", file=sys.stderr, flush=True)
                    continue
                ids, at = build(engine, units_cache, length, depth, key, not args.no_intro, args.task)
                t0 = time.perf_counter()
                text, hits = answer(engine, ids, at, len(engine.encode(needle(key, args.task))),
                                    max_tokens=24 if args.task == "kv" else 12, oracle=oracle if args.oracle else None,
                                    question=len(engine.encode(task_parts(args.task, key)[1])))
                ok = is_right(args.task, key, text)
                again = needle_reread(engine, at, len(engine.encode(needle(key, args.task))))
                right += ok
                layers += [] if hits is None else [hits]
                results["trials"].append({"length": len(ids), "target": length, "mode": mode, "depth": depth,
                                          "key": key, "reply": text, "right": ok, "needle_layers": hits,
                                          "needle_reread": again,
                                          "layers": len(engine.memory.layers) if engine.memory else None,
                                          "next_rule_exact": oracle[-1] if oracle and hits is not None else None,
                                          "seconds": round(time.perf_counter() - t0, 2)})
                with log.open("a") as f:
                    f.write(json.dumps(results["trials"][-1]) + "\n")
                print(f"{length:>7} {mode:>5} depth {depth:.2f}: {'right' if ok else 'WRONG'} {text.strip()[:24]!r}"
                      + (f" needle in {hits} layers" if hits is not None else "") + (", read again" if again else ""),
                      file=sys.stderr, flush=True)
            if engine.memory is not None:
                engine.memory.close()
            rows = [t for t in results["trials"] if t["target"] == length and t["mode"] == mode]
            again = sum(bool(t["needle_reread"]) for t in rows)
            print(f"{length:>7} {mode:>5}: {right}/{len(keys)}" + recall_line(layers, engine)
                  + (f", its block read again in {again}" if engine.memory is not None else ""), flush=True)
            if oracle:
                print(f"{length:>7} {mode:>5}: next choice, the rule / the exact attention mass: "
                      + recall_line([o[0] for o in oracle], engine)[2:] + " / "
                      + recall_line([o[1] for o in oracle], engine).split(": ", 1)[1], flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["off", "on", "dense"],
                    help="off, on, dense, or on:RULE[:REPS] (e.g. on:far,on:bound,on:far:16: rules side by side)")
    ap.add_argument("--haystack", choices=("filler", "prose"), default="filler")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--budget", type=int, default=8192, help="the memory's disk budget, MB (the default 1024 holds "
                    "~47k tokens of the bundled model: a longer document would forget its start, and say so)")
    ap.add_argument("--no-intro", action="store_true", help="no instruction before the haystack")
    ap.add_argument("--task", choices=("passkey", "number", "kv"), default="passkey",
                    help="the needle: a 5-digit pass key, a 10-digit number (Retrieve.Number), a UUID pair (Retrieve.KV)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--oracle", action="store_true", help="also rank every block by the exact attention mass of "
                    "the last prompt token's queries (all its keys) and say in how many layers the needle's is top-k")
    ap.add_argument("--rule", default=None, help="the memory's retrieval rule (sinkchat.memory.recall.RULES; "
                    "default: recall.RULE)")
    ap.add_argument("--reps", type=int, default=None, help="representative keys a block (rules far, mix, attn)")
    ap.add_argument("--reread", type=int, default=None, help="blocks the memory reads again before the question "
                    "(`--memory-reread`; 0: attend the recalled blocks only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="skip the trials OUT/trials.jsonl already holds (a killed "
                    "run, the same arguments)")
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "sinkchat" / "passkey")
    args = ap.parse_args()
    from sinkchat.memory import recall

    global DEFAULT_REPS, REREAD
    REREAD = args.reread
    recall.RULE = args.rule or recall.RULE
    recall.REPS = DEFAULT_REPS = args.reps or recall.REPS
    res = run(args)
    res["args"] = {k: str(v) for k, v in vars(args).items()}
    (args.out / "passkey.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
