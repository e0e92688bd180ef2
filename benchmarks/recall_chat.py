#!/usr/bin/env python
"""Conversation recall: facts given early in a chat, asked for after thousands of tokens of other turns.

Recall memory on, off, and a dense cache (the model's own ceiling, where the conversation fits its context).

One conversation per (seed, mode): a user turn plants four facts drawn from a seeded RNG (a name, a 6-character
code, a date, a favourite fruit) and the assistant answers; then filler turns, real prose pasted by the user ("Here
is a passage: ... Summarize it in one sentence.", ~300-600 tokens cut from lcet10.txt and the license texts under
/usr/share/common-licenses) each answered by the model (greedy, `--max-tokens`). Once the conversation passes a
checkpoint of `--lengths` each fact is asked in its own turn (the questions and replies stay in the chat) and scored
right when the reply contains the value (case-insensitive); then the filler goes on to the next checkpoint. Each
seed's facts and passages are the same in every mode.

The memory's part is reported apart from the model's: for memory on, whether a block holding the fact's tokens
(their stream range, found in the ledger when planted) was among the blocks the question and its reply read
(`memory.report.take_recalled`), and in how many layers at one call, beside the other blocks read (a question reads
most blocks in some layer over its calls: the layer counts tell a chosen block from a passing one). Recalled but
answered wrong: the model's limit; answered by the dense cache but not with the memory: the memory's. Facts at a
chat's very start sit in the block next to the sinks, which most layers choose whatever is asked: `--plant-after N`
puts N filler turns before them (the control).

Usage: python benchmarks/recall_chat.py [--lengths 5000,20000,100000] [--seeds 3] [--modes off,on,dense]
                                        [--model PATH|gemma3] [--cache 1024] [--max-tokens 24] [--threads 1]
                                        [--plant-after TURNS] [--budget MB] [--texts F1,F2] [--out DIR]
Writes DIR/<model>.json (every trial, replies included; rewritten after every question) and prints the tables:
checkpoint x mode -> right / asked with the memory's figures, and per fact.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FIRST = ["Mara", "Tobias", "Ingrid", "Kofi", "Lucia", "Dmitri", "Aiko", "Rafael", "Nadia", "Henrik", "Priya", "Oskar",
         "Elena", "Samir", "Greta", "Mateo", "Yusuf", "Sabine", "Teodor", "Amara"]
LAST = ["Lindqvist", "Okafor", "Brennan", "Castillo", "Novak", "Hayashi", "Moreau", "Petrov", "Alvarez", "Kowalski",
        "Fischer", "Duarte", "Marsh", "Olsen", "Varga", "Quinlan"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
FRUITS = ["mango", "papaya", "apricot", "blackberry", "pomegranate", "kiwi", "cherry", "lychee", "plum", "fig",
          "pineapple", "raspberry", "nectarine", "guava", "persimmon", "watermelon"]
CODE_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
QUESTIONS = {"name": "What is my name? I told you at the start of our conversation.",
             "code": "What was the access code I gave you at the start?",
             "date": "When is my birthday? I told you at the start.",
             "fruit": "What is my favourite fruit? I told you at the start."}
HEADROOM = 1024  # a dense cache holds the checkpoint plus one passage's overshoot and the four questions
Say = Callable[[str], str]  # one user turn in, the assistant's reply out


def new_facts(rng: random.Random) -> dict[str, str]:
    return {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
            "code": "".join(rng.choice(CODE_CHARS) for _ in range(6)),
            "date": f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(1950, 2005)}",
            "fruit": rng.choice(FRUITS)}


def plant_text(f: dict[str, str]) -> str:
    return (f"Please remember these details about me for later. My name is {f['name']}. My access code is "
            f"{f['code']}. My birthday is {f['date']}. My favourite fruit is {f['fruit']}. Please confirm briefly.")


def is_right(value: str, reply: str) -> bool:
    return value.lower() in reply.lower()


def default_texts() -> list[Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llamacpp_tools as lt  # type: ignore[import-not-found]

    lic = Path("/usr/share/common-licenses")
    return [Path(lt.canterbury("lcet10.txt"))] + [p for p in (lic / n for n in (
        "GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "LGPL-2.1", "Artistic", "CC0-1.0")) if p.is_file()]


def passages(paths: list[Path], lo: int = 1400, hi: int = 2400) -> list[str]:
    """The texts as paste-sized pieces: paragraphs (lines joined) packed to lo-hi characters (~300-600 tokens), a
    longer piece cut at its last sentence end before `hi`."""
    out: list[str] = []
    for p in paths:
        paras = [" ".join(b.split()) for b in re.split(r"\n\s*\n", p.read_text(encoding="utf-8", errors="replace"))]
        cur = ""
        for para in filter(None, paras):
            cur = f"{cur}\n\n{para}" if cur else para
            if len(cur) >= lo:
                cut = cur[:hi]
                out.append(cut[: cut.rfind(". ") + 1] if len(cur) > hi and ". " in cut[lo // 2:] else cut)
                cur = ""
    return out


def fact_span(engine: Any, since: int, value: str) -> tuple[int, int]:
    """The stream range [first, last) of the first tokens the ledger holds from stream index `since` on whose text
    contains `value`: the shortest run at the first place it occurs."""
    pairs = [(i, a) for i, a in zip(engine.ledger.ids, engine.ledger.abs_index) if a >= since]
    ids, dec = [t for t, _ in pairs], engine.tokenizer.decode
    j = next((k for k in range(1, len(ids) + 1) if value in dec(ids[:k])), None)
    if j is None:
        raise ValueError(f"{value!r} is not among the cache's tokens from {since} on (a cache too small?)")
    i = max(k for k in range(j) if value in dec(ids[k:j]))
    return pairs[i][1], pairs[j - 1][1] + 1


def overlapping(recalled: list[Any], span: tuple[int, int]) -> list[Any]:
    """The recalled blocks (`report.Recalled`) that hold any token of the stream range `span`."""
    return [r for r in recalled if r.first < span[1] and r.last > span[0]]


def ask(engine: Any, say: Say, kind: str, value: str, span: tuple[int, int]) -> dict[str, Any]:
    """One question turn, scored; for memory on, which recalled blocks held the fact."""
    from sinkchat.memory.report import take_recalled

    mem = engine.memory
    in_window = span[0] in engine.ledger.abs_index
    if mem is not None:
        take_recalled(mem)  # the tally starts at this question
    t0 = time.perf_counter()
    reply = say(QUESTIONS[kind])
    got = take_recalled(mem) if mem is not None else None
    hit = overlapping(got, span) if got is not None else []
    return {"fact": kind, "value": value, "span": list(span), "at": engine.ledger.seen, "reply": reply,
            "right": is_right(value, reply), "in_window": in_window,
            "recalled": None if got is None else bool(hit), "recalled_layers": max((r.layers for r in hit), default=0),
            "reread": None if got is None else any(r.reread for r in hit),
            "recalled_blocks": None if got is None else [[r.first, r.last, r.layers] for r in got],
            "seconds": round(time.perf_counter() - t0, 2)}


def filler(passage: str) -> str:
    return f"Here is a passage:\n\n{passage}\n\nSummarize it in one sentence."


def converse(engine: Any, say: Say, facts: dict[str, str], texts: list[str], lengths: list[int],
             log: Callable[[str], None] = lambda s: None, out: dict[str, Any] | None = None,
             before: int = 0) -> dict[str, Any]:
    """One conversation: `before` filler turns, then plant `facts`, then filler turns from `texts` (cycled); at each
    checkpoint in `lengths` (tokens fed since the facts) ask every fact. Fills and returns `out`: the plant's
    reply, the trials, the filler replies."""
    from sinkchat.core.cache_policy import ContextFull

    since, out = engine.ledger.seen, {} if out is None else out
    out.update(trials=[], filler=[say(filler(texts[n % len(texts)])) for n in range(before)])
    mark = engine.ledger.seen
    out.update(facts=facts, plant_reply=say(plant_text(facts)), plant_at=mark - since)
    spans = {k: fact_span(engine, mark, v) for k, v in facts.items()}
    out["spans"] = {k: list(s) for k, s in spans.items()}
    todo, n = sorted(lengths), before
    try:
        while todo:
            if engine.ledger.seen - mark >= todo[0]:
                for kind, value in facts.items():
                    t = ask(engine, say, kind, value, spans[kind])
                    out["trials"].append({"target": todo[0], **t})
                    out["tokens"] = engine.ledger.seen - since
                    log(f"{todo[0]:>7} {kind:>5}: {'right' if t['right'] else 'WRONG'} {t['reply'].strip()[:50]!r}"
                        + (f" recalled={t['recalled']}" if t["recalled"] is not None else ""))
                todo.pop(0)
                continue
            out["filler"].append(say(filler(texts[n % len(texts)])))
            n += 1
    except ContextFull as e:  # a dense cache that could not hold the conversation: said, never silently short
        out["stopped"] = str(e)
        log(f"stopped: {e}")
    out["tokens"] = engine.ledger.seen - since
    return out


def open_mode(args: argparse.Namespace, mode: str) -> tuple[Any, list[int]]:
    """The engine of a mode and the checkpoints it runs: dense, only those its context holds (cache = the largest
    of them + HEADROOM, and HEADROOM for each turn before the facts), tried from the largest down."""
    from sinkchat.api import start
    from sinkchat.bootstrap import build_settings
    from sinkchat.config import ConfigError

    opts: dict[str, Any] = {"temperature": 0.0, "threads": args.threads, "model": args.model_path,
                            "max_tokens": args.max_tokens, "memory_budget": args.budget}
    if mode != "dense":
        if mode.startswith("on:"):  # "on:RULE": the memory with another retrieval rule, side by side
            from sinkchat.memory import recall

            recall.RULE = mode.split(":", 1)[1]
        opts.update(policy="sink", cache_size=args.cache, memory="on" if mode.startswith("on") else mode)
        return start(build_settings(opts)).engine, args.lengths
    for k in range(len(args.lengths), 0, -1):
        try:
            cache = args.lengths[k - 1] + HEADROOM * (1 + args.plant_after)  # a passage and its reply < HEADROOM
            opts.update(policy="dense", cache_size=cache, memory="off")
            return start(build_settings(opts)).engine, args.lengths[:k]
        except ConfigError:
            continue
    raise ConfigError(f"no checkpoint of {args.lengths} fits the model's context with a dense cache")


def run(args: argparse.Namespace, texts: list[str], results: dict[str, Any]) -> None:
    """Every seed's conversation in every mode, seed by seed (a cut run still has every mode of its first seeds)."""
    from sinkchat.api import Session

    engines = {}
    for mode in args.modes:
        try:
            engines[mode] = open_mode(args, mode)
        except Exception as e:  # noqa: BLE001 - a dense cache past the model's context: say so, go on
            print(f"{mode}: not run ({e})", file=sys.stderr)
    for seed in range(args.seeds):
        for mode, (engine, lengths) in engines.items():
            rng = random.Random(f"recall-chat-{args.seed}-{seed}")
            facts, order = new_facts(rng), list(range(len(texts)))
            rng.shuffle(order)
            engine.clear()
            sess, t0 = Session(engine), time.perf_counter()
            conv: dict[str, Any] = {"seed": seed, "mode": mode}
            results["conversations"].append(conv)

            def log(line: str, mode: str = mode, seed: int = seed, conv: dict[str, Any] = conv) -> None:
                print(f"seed {seed} {mode:>5} {line}  [{time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
                conv["seconds"] = round(time.perf_counter() - t0, 1)
                save(args, results)  # after every question: a cut run keeps what it asked

            converse(engine, lambda t: sess.chat(t, max_tokens=args.max_tokens), facts,
                     [texts[i] for i in order], lengths, log, conv, args.plant_after)
            log(f"done: {conv['tokens']} tokens")
    for engine, _ in engines.values():
        if engine.memory is not None:
            engine.memory.close()


def table(results: dict[str, Any], mem_mode: str = "on") -> str:
    """checkpoint x mode -> right / asked; for memory on (`mem_mode`: "on" or "on:RULE"): the facts whose block a
    question recalled (in any layer), of those the right ones, and in how many layers (at one call, median) the
    fact's block and the other blocks read were chosen."""
    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for c in results["conversations"]:
        for t in c["trials"]:
            cells.setdefault((t["target"], "on" if c["mode"] == mem_mode else c["mode"]), []).append(t)
    modes = [m for m in ("off", "on", "dense") if any(k[1] == m for k in cells)]
    rows = [f"| tokens | {' | '.join(modes)} | on: fact's block recalled | on: right when recalled "
            "| on: layers, fact's block / others (median) |", "|---|" + "---|" * (len(modes) + 3)]
    for length in sorted({k[0] for k in cells}):
        row = [f"{sum(t['right'] for t in ts)}/{len(ts)}" if (ts := cells.get((length, m))) else "-" for m in modes]
        on = cells.get((length, "on"), [])
        rec = [t for t in on if t["recalled"]]
        others = [b[2] for t in on for b in t["recalled_blocks"] if not (b[0] < t["span"][1] and b[1] > t["span"][0])]
        row += [f"{len(rec)}/{len(on)}", f"{sum(t['right'] for t in rec)}/{len(rec)}",
                f"{median([t['recalled_layers'] for t in on]):g} / {median(others or [0]):g}"] if on else ["-"] * 3
        rows.append(f"| {length:,} | " + " | ".join(row) + " |")
    return "\n".join(rows)


def fact_table(results: dict[str, Any]) -> str:
    """fact x (checkpoint, mode) -> right / asked: which facts the model can give back at all."""
    cells: dict[tuple[str, int, str], list[bool]] = {}
    for c in results["conversations"]:
        for t in c["trials"]:
            cells.setdefault((t["fact"], t["target"], c["mode"]), []).append(t["right"])
    cols = sorted({k[1:] for k in cells}, key=lambda k: (k[0], k[1] != "off", k[1] == "dense", k[1]))
    rows = ["| fact | " + " | ".join(f"{n:,} {m}" for n, m in cols) + " |", "|---|" + "---|" * len(cols)]
    for fact in QUESTIONS:
        got = [cells.get((fact, *k), []) for k in cols]
        rows.append(f"| {fact} | " + " | ".join(f"{sum(g)}/{len(g)}" if g else "-" for g in got) + " |")
    return "\n".join(rows)


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[5000, 20000, 100000])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="base seed (conversation i uses base and i)")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["off", "on", "dense"],
                    help="off, on, dense, or on:RULE (sinkchat.memory.recall.RULES: rules side by side)")
    ap.add_argument("--plant-after", type=int, default=0, help="filler turns before the facts (a control: the "
                    "facts then sit past the stream's first blocks)")
    ap.add_argument("--model", default=None, help="a model path; gemma3 = Gemma 3 270M (benchmarks/hybrid_ppl.py)")
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=int, default=8192, help="the memory's disk budget, MB (100k tokens of the "
                    "bundled model take ~2.3 GB: the default 1024 would forget the facts, and say so)")
    ap.add_argument("--texts", type=lambda s: [Path(x) for x in s.split(",")], default=None)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "sinkchat" / "recall_chat")
    args = ap.parse_args()
    args.model_path = args.model
    if args.model == "gemma3":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from hybrid_ppl import gemma3_270m  # type: ignore[import-not-found]

        args.model_path = str(gemma3_270m())
    args.tag = "bundled" if args.model is None else Path(args.model).stem
    texts = passages(args.texts or default_texts())
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "conversations": []}
    run(args, texts, results)
    save(args, results)
    for on in [m for m in args.modes if m.startswith("on")] or ["on"]:
        print(f"{args.tag} (cache {args.cache}, {args.seeds} seeds, 4 facts each, memory on = {on})\n"
              f"{table(results, on)}\n")
    print(fact_table(results))


if __name__ == "__main__":
    main()
