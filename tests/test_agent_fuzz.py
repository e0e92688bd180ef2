"""parse_reply on random model-like text: whatever comes in, a `Parsed` comes out, and everything it carries can be
JSON-encoded (a soak once hit `TypeError: Object of type set is not JSON serializable` on a tool name written as a
Python set). Plain `random` over many seeds: no hypothesis dependency."""

from __future__ import annotations

import json
import random

import pytest

from sinkchat.apps.agent.protocol import Parsed, complete_call, parse_reply

FRAGMENTS = ['{', '}', '{"', '"}', '":', ': ', ', ', ',', '"tool"', "'tool'", '"name"', '"args"', "'args'",
             '"arguments"', '"final"', '"function"', '"answer"', '"clock"', "'calculator'", '{1, 2}', "{'a'}",
             'set()', '(1, 2)', "b'x'", '1j', '[', ']', 'None', 'True', 'nan', '1e999', '-0', '"\\u00e9"', "'",
             '"', '\\', '\n', '```json\n', '```', '<tool_call>', '</tool_call>', '<|im_end|>', '<|im_start|>',
             'Final answer: ', 'answer:', 'Sure! ', "it's ", 'the tool ', '{"tool": "notes", "args": {',
             '{"tool": {', '{"final": {"x": [1, {2, 3}]}}', "{'tool': {'clock'}, 'args': {}}", "((((", "[[[[",
             '{"tool": "read_file", "args": "{\\"path\\": 1}"}', '9' * 30, ' ' * 3, '\x00', 'é', '🙂']


def random_reply(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 25)))


@pytest.mark.parametrize("seed", range(40))
def test_parser_never_raises_and_stays_json(seed):
    rng = random.Random(seed)
    for _ in range(100):
        text = random_reply(rng)
        p = parse_reply(text)
        assert isinstance(p, Parsed) and p.kind in ("call", "final", "error", "none"), text
        assert isinstance(p.answer, str) and isinstance(p.error, str) and isinstance(p.name, str)
        json.dumps(p.args)
        complete_call(text)


@pytest.mark.parametrize("text, kind", [
    ("{'tool': {'clock'}, 'args': {}}", "error"),
    ("{'final': {1, 2}}", "final"),
    ("{'tool': 'calculator', 'args': {1: b'x', 'e': (1, 2j)}}", "call"),
    ("{'tool': 'final', 'args': {'answer': {3}}}", "final"),
    ("(" * 500 + ")" * 500, "none"),
    ("{" * 2000 + "}" * 2000, "none"),
])
def test_python_literals_that_are_not_json(text, kind):
    p = parse_reply(text)
    assert p.kind == kind, p
    json.dumps(p.args)
    json.dumps(p.answer)
