"""`sinkchat logs`: list, show, export and delete sessions of the SQLite log (read by `sinkchat.store.transcript`)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import click

from sinkchat.store.logdb import LogError, db_path
from sinkchat.store.sessionlog import MODES
from sinkchat.store.transcript import SessionInfo, delete_session, export, latest_session, list_sessions
from sinkchat.textutil import plural


# ------------------------------------------------------------------------------------------------ formatting
def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def format_sessions(sessions: list[SessionInfo]) -> str:
    """One row per session. TOKENS is what the model processed in every mode (see `logs --help`); a session
    logged before that was counted shows the tokens of its turns, marked `+` (a lower bound)."""
    named = any(_name(s) for s in sessions)
    head = f"{'ID':>5}  {'STARTED':16}  {'MODE':9}  {'MODEL':28}  {'TURNS':>5}  {'TOKENS':>8}  " + \
        (f"{'STATUS':12}  NAME" if named else "STATUS")
    lines = [head]
    for s in sessions:
        status = s.status or ("ended" if s.ended else "open/crashed")
        tokens = f"{s.tokens}" if s.tokens_counted else f"{s.tokens}+"
        tail = f"{status:12}  {_name(s)}".rstrip() if named else status
        lines.append(f"{s.id:>5}  {_when(s.started):16}  {s.mode[:9]:9}  {_cut(_model_name(s.model), 28):28}  {s.turns:>5}  "
                     f"{tokens:>8}  {tail}")
    return "\n".join(lines)


def _name(s: SessionInfo) -> str:
    """What names the session beyond its id: a served session's X-Session-Id ('' for the other modes)."""
    name = s.settings.get("session") if s.mode == "serve" else None
    return str(name) if name else ""


def format_transcript(data: dict[str, Any], markdown: bool = False) -> str:
    """The session as the user lived it: turns in order, each followed by what happened before the next one (tool
    calls, slash commands, the agent's error feedback, evictions, in the order they happened), then the totals."""
    s = data["session"]
    title = f"session {s['id']} · {s['mode']} · {s['model'] or '-'} · started {_when(s['started'])}"
    out: list[str] = [f"# {title}" if markdown else title]
    if s.get("system"):
        out.append(f"**system**: {s['system']}" if markdown else f"[system] {s['system']}")
    after: dict[int, list[tuple[float, Any]]] = {}
    for tc in data["tool_calls"]:
        after.setdefault(tc["turn_seq"], []).append((tc["created"], _tool_line(tc, markdown)))
    for ev in data.get("events", []):
        after.setdefault(ev["turn_seq"], []).append((ev["created"], _event_line(ev, markdown)))
    for ev in data["evictions"]:
        after.setdefault(ev.get("turn_seq", 0), []).append((ev["created"], ev))
    out += _between(after.get(0, []), markdown)
    for t in data["turns"]:
        stat = _turn_stat(t)
        if markdown:
            out.append(f"\n## {t['role']} ({stat})\n\n{t['text']}")
        else:
            out.append(f"\n[{t['role']}] ({stat})\n{t['text']}")
        out += _between(after.get(t["seq"], []), markdown)
    return "\n".join(out + _totals(data, markdown))


MAX_EVICTION_LINES = 3  # evictions in a row shown one per line; the rest of the run as one summary line


def _between(items: list[tuple[float, Any]], markdown: bool) -> list[str]:
    """What happened after a turn, in time order: tool calls and events as their lines, evictions one per line up to
    MAX_EVICTION_LINES in a row and the rest of that run summed (a stream soak evicts thousands of times)."""
    out: list[str] = []
    run: list[dict[str, Any]] = []

    def close_run() -> None:
        shown, rest = {"evicted": 0, "forgotten": 0}, {"evicted": [], "forgotten": []}  # type: ignore[var-annotated]
        for e in run:  # the first few of each kind one per line, in order
            what = _verb(e)
            if shown[what] < MAX_EVICTION_LINES:
                out.append(_eviction_line(e, markdown))
                shown[what] += 1
            else:
                rest[what].append(e)
        for what, evs in rest.items():
            if evs:
                out.append(_rest_line(what, evs, markdown))
        run.clear()

    for _, item in sorted(items, key=lambda x: x[0]):
        if isinstance(item, dict):
            run.append(item)
            continue
        close_run()
        out.append(item)
    close_run()
    return out


def _rest_line(what: str, evs: list[dict[str, Any]], markdown: bool) -> str:
    """One line for the rest of a run: how many, their tokens and span, and for forgotten ones why (by reason)."""
    n = sum(e["count"] for e in evs)
    kind = plural(len(evs), "more eviction") if what == "evicted" else plural(len(evs), "more forgotten range")
    text = f"... and {kind}: {n} tokens [{evs[0]['first']},{evs[-1]['last']})"
    if what == "forgotten":
        why: dict[str, int] = {}
        for e in evs:
            reason = str(e.get("policy")).partition(":")[2] or "?"
            why[reason] = why.get(reason, 0) + e["count"]
        text += " (" + ", ".join(f"{r}: {t} tokens" for r, t in why.items()) + ")"
    return f"\n> *{what}* {text}" if markdown else f"  <{what} {text}>"


def _verb(ev: dict[str, Any]) -> str:
    """'forgotten' for a recall memory's forgotten tokens (policy "forgotten:<reason>"), else 'evicted'."""
    return "forgotten" if str(ev.get("policy") or "").startswith("forgotten") else "evicted"


def _eviction_line(ev: dict[str, Any], markdown: bool) -> str:
    verb = _verb(ev)
    why = f" ({str(ev['policy']).partition(':')[2]})" if verb == "forgotten" else ""
    text = f"{ev['count']} tokens [{ev['first']},{ev['last']}){why}" + (f": {ev['preview']}" if ev.get("preview") else "")
    return f"\n> *{verb}* {text}" if markdown else f"  <{verb} {text}>"


def _totals(data: dict[str, Any], markdown: bool) -> list[str]:
    """The session's evictions and tokens in one closing line. The turns' own figures leave out what was fed
    between them (an agent's tool results, summarize's log lines), so the line says how the total splits."""
    s = data["session"]
    evs = [e for e in data["evictions"] if _verb(e) == "evicted"]
    gone = [e for e in data["evictions"] if _verb(e) == "forgotten"]
    parts = []
    if evs:
        parts.append(f"{plural(len(evs), 'eviction')}, {sum(e['count'] for e in evs)} tokens evicted")
    copies = sum(e["count"] for e in gone if str(e.get("policy")) == "forgotten:re-read")
    lost = sum(e["count"] for e in gone) - copies
    if lost:
        parts.append(f"{lost} tokens forgotten by the recall memory")
    if copies:  # copies of blocks read again, let go as they left the window: the memory holds the originals
        parts.append(f"{copies} tokens of blocks read again let go (their blocks held)")
    recalls = [e for e in data.get("events", []) if e["kind"] == "recalled"]
    if recalls:
        parts.append(f"{plural(len(recalls), 'reply', 'replies')} read the recall memory")
    in_turns = sum(t["tokens"] for t in data["turns"])
    if s.get("tokens_counted") and s["tokens"] >= in_turns:
        parts.append(f"{s['tokens']} tokens processed: {in_turns} in the turns, {s['tokens'] - in_turns} between them")
    elif s.get("tokens_counted"):
        parts.append(f"{s['tokens']} tokens processed")
    if not parts:
        return []
    text = "; ".join(parts)
    return [f"\n_{text}_" if markdown else f"\n({text})"]


def _turn_stat(t: dict[str, Any]) -> str:
    """A prompt's time is the time to feed it (prefill), a reply's the time to generate it; say which."""
    what = "generated" if t["role"] == "assistant" else "fed"
    return f"{t['tokens']} tokens {what} in {_duration(t['seconds'])}" + (f", {t['reason']}" if t.get("reason") else "")


def _duration(seconds: float) -> str:
    """Milliseconds below a second: a prefill of a short prompt takes a few, and '0.0 s' reads as not measured."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _tool_line(tc: dict[str, Any], markdown: bool) -> str:
    mark = "ok" if tc["ok"] else "failed"
    return (f"\n> tool `{tc['name']}` {tc['args']} -> {mark}: {tc['result']}" if markdown else
            f"  <tool {tc['name']} {tc['args']} -> {mark}: {tc['result']}>")


def _event_line(ev: dict[str, Any], markdown: bool) -> str:
    """A slash command with its outcome, or the error text the agent fed back to the model; what a reply read from
    the recall memory ('recalled') as a line like an eviction's, where it happened among them."""
    if ev["kind"] == "recalled":
        return f"\n> *recalled* {ev['text']}" if markdown else f"  <recalled {ev['text']}>"
    detail = f" -> {ev['detail']}" if ev.get("detail") else ""
    if markdown:
        return f"\n> *{ev['kind']}*: `{ev['text']}`{detail}"
    return f"\n[{ev['kind']}] {ev['text']}{detail}"


def _cut(text: str, width: int) -> str:
    """`text` in `width` columns, an ellipsis marking a cut ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "...Q4_1.g" said
    nothing of the cut): the end kept, where a file's quantization and type are."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1 :]


def _model_name(model: str | None) -> str:
    """The file or folder name (a full path cut to the column width says nothing), or the hub id."""
    if not model:
        return "-"
    return Path(model).name if model.startswith(("/", ".", "~")) else model


# ------------------------------------------------------------------------------------------------ CLI
@click.group("logs", invoke_without_command=True)
@click.option("--mode", type=click.Choice(MODES), default=None,
              help="only sessions of this mode")
@click.option("-n", "--limit", type=click.IntRange(1, None), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.pass_context
def logs_command(ctx: click.Context, mode: str | None, limit: int, as_json: bool) -> None:
    """List logged sessions (newest first); `logs show ID` prints one, `logs rm ID` deletes one.

    TOKENS: the tokens the model processed in the session, fed and generated: prompts and replies, and what is
    fed between them (an agent's tool results, summarize's log lines); the soak report's total for a soak run. A
    trailing + marks a session logged before that was counted: the tokens of its turns, a lower bound.

    NAME: a served session's X-Session-Id.

    STATUS: ended; running (the process that writes it still runs); crashed (never closed, and its process is
    gone); other host (written on another machine); open/crashed (logged by an older sinkchat: cannot tell)."""
    if ctx.invoked_subcommand is not None:
        return
    with _cli_errors():
        sessions = list_sessions(mode, limit) if db_path().exists() else []
    if as_json:
        click.echo(json.dumps([asdict(s) for s in sessions], indent=1))
    elif not sessions:
        click.echo("no sessions logged yet")
    else:
        click.echo(format_sessions(sessions))


@logs_command.command("show")
@click.argument("session_id", type=int, required=False)
@click.option("--json", "as_json", is_flag=True, help="export everything as JSON")
@click.option("--markdown", is_flag=True, help="export as Markdown")
def show_command(session_id: int | None, as_json: bool, markdown: bool) -> None:
    """Print the transcript of session ID (default: the newest)."""
    with _cli_errors():
        if session_id is None:
            latest = latest_session()
            if latest is None:
                raise LogError("no sessions logged yet")
            session_id = latest.id
        data = export(session_id)
    click.echo(json.dumps(data, indent=1) if as_json else format_transcript(data, markdown))


@logs_command.command("rm")
@click.argument("session_ids", type=int, nargs=-1, required=True)
def rm_command(session_ids: tuple[int, ...]) -> None:
    """Delete sessions (and their automatic snapshots)."""
    with _cli_errors():
        for sid in session_ids:
            delete_session(sid)
            click.echo(f"removed session {sid}")


@contextlib.contextmanager
def _cli_errors() -> Iterator[None]:
    """Log problems (missing, newer schema, unknown id) as one-line click errors, never a traceback."""
    from sinkchat.config import ConfigError

    try:
        yield
    except (LogError, sqlite3.Error) as e:
        raise click.ClickException(str(e)) from None
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
