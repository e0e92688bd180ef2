"""A model's chat template rendered through jinja2 directly, as transformers' `apply_chat_template(...,
tokenize=False)` renders it, for `light_tokenizer.LightTokenizer` (a later start without transformers' tokenizer
classes, whose import and construction cost ~0.4 s of a ~3 s start on a busy 2-core box).

The environment is transformers' own (`transformers.utils.chat_template_utils._cached_compile_jinja_template`, 5.x):
an `ImmutableSandboxedEnvironment` with trim_blocks / lstrip_blocks, the loopcontrols extension and a `{% generation
%}` tag, its `tojson` filter (no HTML escaping; indent, separators, sort_keys), `raise_exception`, `strftime_now`,
a `dict` without attribute tricks and a `namespace` that refuses underscore names; the template sees the messages
(None values dropped, reasoning fields aliased), `tools`, `documents=None`, `add_generation_prompt` and the
tokenizer's named special tokens (`bos_token`, `eos_token`, ...). Only plain JSON data is rendered here
(`plain_data`); anything else is the caller's cue to use transformers itself. `tests/test_light_tokenizer.py` checks
the renderings against transformers' on every fixture's template.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' `_REASONING_FIELDS`


class NotPlain(ValueError):
    """Input this module does not render itself (objects, callables): the caller renders through transformers."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (transformers tracks the assistant's spans with it
    only for `return_assistant_tokens_mask`, which this module never serves)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


@lru_cache(maxsize=8)
def compiled(template: str) -> jinja2.Template:
    """The template compiled once (a chat renders every turn)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def plain_data(value: Any) -> Any:
    """A copy of JSON-typed data as transformers hands it to a template (`_plain_template_data` on plain types:
    subclasses of str / int / float back to the base type); NotPlain for anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    raise NotPlain(type(value).__name__)


def _messages(conversation: Any) -> list[dict[str, Any]]:
    """transformers' `_normalize_chat_messages` then `_alias_reasoning_fields`, for a list of plain dicts."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise NotPlain("not a non-empty list of messages")
    out = []
    for message in conversation:
        if type(message) is not dict:
            raise NotPlain("a message that is not a dict")
        msg = plain_data({k: v for k, v in message.items() if v is not None})
        reasoning = next((msg[k] for k in REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def pick(template: str | dict[str, str] | None, tools: Any) -> str:
    """The template to render (transformers' `get_chat_template` without a named template)."""
    if isinstance(template, dict):
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        raise ValueError("This model has multiple chat templates with no default specified!")
    if template is None:
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
    return template


def render(template: str | dict[str, str] | None, conversation: Any, special_tokens: dict[str, str],
           tools: Any = None, add_generation_prompt: bool = False, **kwargs: Any) -> str:
    """The text transformers' `apply_chat_template(conversation, tools=tools, tokenize=False,
    add_generation_prompt=...)` gives; `special_tokens`: the tokenizer's `special_tokens_map`, under `kwargs`."""
    text = pick(template, tools)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise NotPlain("tools given as callables")
    template_kwargs = plain_data({**special_tokens, **kwargs})
    return compiled(text).render(messages=_messages(conversation), tools=plain_data(tools), documents=None,
                                 add_generation_prompt=add_generation_prompt, **template_kwargs)
