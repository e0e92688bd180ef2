"""Does a system-prompt rule survive a long conversation? `--pin system` against `--pin none`, side by side.

A rule the bundled 135M model follows at the start of a conversation ("You only speak French": it answers in a
Romance language, though often Italian) is given as the system prompt; then many turns, each feeding a few hundred
tokens of English text (the GPL-3 licence, paragraph by paragraph) and asking an English question. Each answer is
judged by its function words: more French/Italian/Spanish ones ("le", "la", "il", "di", "des", ...) than English
ones ("the", "is", "of", ...) counts as following the rule. The share is printed for the first turns (system prompt
certainly in the cache) and for the turns after `--after` tokens of conversation, for each pin setting, and the
ratio between them.

    python benchmarks/pinned_rule.py --tokens 20000 --cache 2048
    python benchmarks/pinned_rule.py --tokens 20000 --scripted   # the filler's replies scripted in English

Generated replies carry the rule themselves (the model copies the language of its own recent answers), so the
first form measures the model as much as the pin; `--scripted` fills the conversation with English replies that are
fed, not generated, so that only the system prompt (pinned, or evicted long ago) can say "French".
"""

from __future__ import annotations

import argparse
import re
import sys
import time

ROMANCE = {"le", "la", "les", "des", "du", "un", "une", "est", "et", "il", "di", "del", "della", "che", "el", "los",
           "las", "por", "para", "une", "je", "vous", "nous", "ce", "cette", "sont", "dans", "avec", "pour", "qui"}
ENGLISH = {"the", "is", "are", "of", "and", "to", "in", "it", "this", "that", "you", "a", "an", "for", "with", "be"}
QUESTIONS = ["What is this text about?", "Summarize it in one sentence.", "Who is it written for?",
             "What does it allow?", "What does it forbid?"]
SYSTEM = "You only speak French. Always answer in French, whatever language the user writes in."


def follows_rule(text: str) -> bool:
    words = re.findall(r"[a-zàâçéèêëîïôûùüÿœ']+", text.lower())
    return sum(w in ROMANCE for w in words) > sum(w in ENGLISH for w in words)


SCRIPTED_REPLY = "This part of the licence is about the terms of use."


def fill_scripted(eng, paragraphs: list[str], tokens: int) -> None:
    """Replay `tokens` of conversation whose assistant turns are scripted English (fed, not generated): the window
    then holds no reply that follows the rule, so only the (pinned or evicted) system prompt can carry it."""
    turn = 0
    while eng.ledger.seen < tokens:
        question = QUESTIONS[turn % len(QUESTIONS)]
        list(eng.add_message("user", f"{paragraphs[turn % len(paragraphs)]}\n\n{question}"))
        list(eng.add_message("assistant", SCRIPTED_REPLY, add_generation_prompt=False))
        turn += 1


def run(pin: str, args: argparse.Namespace, paragraphs: list[str]) -> tuple[list[bool], list[bool], int]:
    from sinkchat.api import start
    from sinkchat.bootstrap import build_settings
    from sinkchat.core.events import DoneEvent

    s = build_settings({"temperature": 0.0, "max_tokens": args.max_tokens, "cache_size": args.cache, "pin": pin})
    eng = start(s, SYSTEM).engine
    early, late, turn, trace = [], [], 0, []
    if args.scripted:
        fill_scripted(eng, paragraphs, args.tokens)
        turn = args.early_turns  # no early turns: every answer is a late one
    while eng.ledger.seen < args.tokens + args.late_turns * 500:
        text = paragraphs[turn % len(paragraphs)]
        question = QUESTIONS[turn % len(QUESTIONS)]
        reply = next(e.text for e in eng.chat(f"{text}\n\n{question}") if isinstance(e, DoneEvent))
        ok = follows_rule(reply)
        trace.append("F" if ok else "e")
        if turn < args.early_turns:
            early.append(ok)
        elif eng.ledger.seen >= args.tokens:
            late.append(ok)
            if len(late) >= args.late_turns:
                break
        turn += 1
    print(f"  --pin {pin}: per turn (F = follows the rule, e = does not): {''.join(trace)}", flush=True)
    return early, late, eng.ledger.seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000, help="conversation length before the late turns")
    ap.add_argument("--cache", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--early-turns", type=int, default=10)
    ap.add_argument("--late-turns", type=int, default=20)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--scripted", action="store_true",
                    help="fill the --tokens with scripted English replies instead of generated ones")
    args = ap.parse_args()
    raw = open(args.text, encoding="utf-8").read()
    paragraphs = [p.strip() for p in raw.split("\n\n") if len(p.strip()) > 400]
    print(f"rule: {SYSTEM!r}; cache {args.cache}; late turns after {args.tokens} tokens; greedy", flush=True)
    rows = []
    for pin in ("system", "none"):
        t0 = time.time()
        early, late, seen = run(pin, args, paragraphs)
        rows.append((pin, sum(early) / max(1, len(early)), sum(late) / max(1, len(late)), len(late), seen,
                     time.time() - t0))
        print(f"--pin {pin:6}: first {len(early)} turns {rows[-1][1]:.0%} follow the rule; {len(late)} turns after "
              f"{args.tokens} tokens: {rows[-1][2]:.0%} ({seen} tokens seen, {rows[-1][5]:.0f} s)", flush=True)
    (_, e1, l1, *_), (_, e0, l0, *_) = rows
    print(f"late share, pinned vs not: {l1:.0%} vs {l0:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
