"""`sinkchat chat`: the terminal chat REPL over one Engine and its attention-sink cache.

One core, `ChatLoop.run(read)`, serves both paths: on a terminal `read` is a prompt-toolkit PromptSession (history,
emacs keys, completion, a bottom toolbar refreshed twice a second); off a terminal it reads lines from stdin (invalid
UTF-8 becomes U+FFFD) and the Renderer writes plain replies to stdout and everything else to stderr. Tests drive the
same loop with prompt-toolkit's pipe input or with plain line lists.
"""

from __future__ import annotations

import logging
import sys
from signal import SIGTERM
import time
from pathlib import Path
from typing import Any

import click

from sinkchat.api import start
from sinkchat.bootstrap import build_settings, common_options, pop_common, read_prompt, setup_logging, user_errors
from sinkchat.config import ConfigError, data_dir
from sinkchat.core.events import DoneEvent, EvictionEvent, Event, ForgottenEvent, TokenEvent
from sinkchat.core.metrics import Metrics, Stats, model_bytes
from sinkchat.apps.chat.answer import FORMATS, TurnResult
from sinkchat.apps.chat.commands import Exit, dispatch
from sinkchat.apps.chat.inputs import (  # noqa: F401 - lines_reader, stream_reader: re-exported for callers
    Reader, lines_reader, make_prompt_session, prompt_reader, stream_reader,
)
from sinkchat.apps.chat import recall, session
from sinkchat.apps.chat.loading import logs_after_spinner
from sinkchat.apps.chat.signals import sigterm_exits as _sigterm_exits
from sinkchat.apps.memory_view import memory_figures, plural, span
from sinkchat.apps.render import Renderer, live_stats, toolbar_fragments
from sinkchat.memory import report

log = logging.getLogger(__name__)

FENCE = '"""'
MAX_EVICTION_LINES = 6  # per turn; a huge paste evicts hundreds of times, the rest is summarised


class ChatLoop:
    """The REPL core: turns lines into chat turns or slash commands, streams events to a Renderer."""

    def __init__(self, engine: Any, renderer: Renderer, metrics: Metrics | None = None,
                 interactive: bool = False, exit_on_interrupt: bool = False, slog: Any = None,
                 auto_snapshot: Any = None, settings: Any = None, sampling_flags: dict[str, Any] | None = None
                 ) -> None:
        from sinkchat.store.nulllog import NullLog  # (sessionlog imports sqlite3 and psutil)

        self.engine = engine
        self.slog = slog if slog is not None else NullLog()  # the SQLite session log (NullLog with --no-log)
        self.auto_snapshot = auto_snapshot
        self.exit_on_interrupt = exit_on_interrupt  # piped input: Ctrl-C ends the run (after a consistent stop)
        self.r = renderer
        self.metrics = metrics or Metrics()
        self.interactive = interactive
        self._model_nbytes = model_bytes(engine.model)
        self._deferred: list[EvictionEvent | ForgottenEvent] | None = None  # evictions of the turn under way
        self.settings = settings  # what /memory on opens a memory with (None: the defaults)
        self.sampling_flags = dict(sampling_flags or {})  # typed for this run: they win over a loaded snapshot's
        self.last_recalled: list[Any] = []  # blocks the last reply read from the recall memory (/recall)
        self.recall_tally = [0, 0]  # replies that read the memory, blocks they read
        self._memory_stats: Any = None
        if self.r.stats is None:
            self.r.stats = self.stats
        self.r.memory = self.memory_stats

    def stats(self) -> Stats:
        """What the toolbar, the status line and /stats show; eviction figures from `self.metrics` alone."""
        return live_stats(self.engine, self.metrics, self._model_nbytes)

    def memory_stats(self) -> Any:
        """The recall memory's figures with its region's KV (`memory_view.MemoryFigures`), None when it is off.
        Read from the live status's thread too, while the engine may be adding a block: a reading that fails gives
        the last one."""
        mem = self.engine.memory
        if mem is None:
            return None
        try:
            self._memory_stats = memory_figures(self.engine, report.stats(mem))
        except Exception:  # noqa: BLE001 - a dict changed size mid-read: the previous figures stand
            pass
        return self._memory_stats

    def toolbar(self) -> list[tuple[str, str]]:
        try:
            from prompt_toolkit.application import get_app

            width = get_app().output.get_size().columns
        except Exception:  # noqa: BLE001 - no running app (tests): full width
            width = 200
        return toolbar_fragments(self.stats(), width, self.memory_stats())

    # ------------------------------------------------------------------------------------------- events
    def on_event(self, ev: Event) -> None:
        self.metrics.fold(ev)
        if isinstance(ev, TokenEvent):
            self.r.token(ev.text)
        elif isinstance(ev, (EvictionEvent, ForgottenEvent)):
            self.slog.eviction(ev)  # a forgotten event goes to the log as one too (logs show: "forgotten")
            if self._deferred is not None:  # inside a turn: shown after the reply, never between its lines
                self._deferred.append(ev)
            else:
                self.r.eviction(ev)

    def _show_turn_evictions(self) -> None:
        """The turn's evictions, after its reply: the first few as lines, the rest summarised (a huge paste
        evicts hundreds of times)."""
        evs, self._deferred = self._deferred or [], None
        for ev in evs[:MAX_EVICTION_LINES]:
            self.r.eviction(ev)
        for kind, rest in (("evictions", [e for e in evs[MAX_EVICTION_LINES:] if isinstance(e, EvictionEvent)]),
                           ("forgotten", [e for e in evs[MAX_EVICTION_LINES:] if isinstance(e, ForgottenEvent)])):
            if rest:  # the range in the chat's one notation (`memory_view.span`), as the lines above
                n = sum(e.count for e in rest)
                what = plural(len(rest), "more eviction" if kind == "evictions" else "more forgotten range")
                self.r.info(f"⟂ ... and {what} this turn: {plural(n, 'token')} {span(rest[0].first, rest[-1].last)}",
                            style="dim yellow")

    # ------------------------------------------------------------------------------------------- actions
    def turn(self, text: str, log_user: bool = True) -> DoneEvent | None:
        """One chat turn. Ctrl-C stops it; whatever was generated stays in the cache and the conversation. Every
        turn ends with one answer record on the renderer (`--format jsonl`, or the text separator)."""
        eng = self.engine
        res = TurnResult(text)
        self._deferred = []
        self.r.begin_reply()
        try:
            try:
                self._feed_prompt(res, log_user)
                self._generate(res)
            finally:
                self._close_reply(res)
        except KeyboardInterrupt:
            res.interrupted = True
        finally:
            unsent = None
            if res.interrupted and not res.generating:
                unsent = ("message not sent: taken back out of the cache" if eng.message_taken_back
                          else "message cut while being fed: the part already fed stays (it had evicted older tokens)")
            self.r.end_reply(res.done, res.interrupted, unsent)
            self._show_turn_evictions()
            res.recalled = recall.show_after_reply(self)
        self.r.answer(res.record())
        self.r.status(self.stats())
        if res.interrupted and self.exit_on_interrupt:
            raise KeyboardInterrupt
        return res.done

    def _feed_prompt(self, res: TurnResult, log_user: bool) -> None:
        """Feed the user message, timing it: the time to prefill a long paste is the user turn's time in the log."""
        eng = self.engine
        seen0, t0 = eng.ledger.seen, time.perf_counter()
        feed = eng.add_message("user", res.question, recall=True)
        try:
            for ev in feed:
                self.on_event(ev)
        finally:
            feed.close()
        res.prompt_tokens, res.prefill_seconds = eng.ledger.seen - seen0, time.perf_counter() - t0
        if log_user:
            session.log_turn(self, "user", res.question, res.prompt_tokens, seconds=res.prefill_seconds)

    def _generate(self, res: TurnResult) -> None:
        eng = self.engine
        eng.last_reply_ids = []
        res.generating, t0 = True, time.perf_counter()
        gen = eng.generate()
        try:
            for ev in gen:
                self.on_event(ev)
                if isinstance(ev, DoneEvent):
                    res.done = ev
        finally:
            gen.close()
            res.seconds = res.done.seconds if res.done is not None else time.perf_counter() - t0

    def _close_reply(self, res: TurnResult) -> None:
        """Record the reply even when cut (the engine.chat contract). A prompt cut while being fed is taken back
        whole by the engine; only if it had already evicted does it stay, and then an empty reply closes its turn so
        the next message extends the conversation by prefix."""
        eng = self.engine
        if res.generating or not eng.message_taken_back:
            eng.conv.add_reply(eng.reply_text() if res.generating else "")
        if not res.generating:
            return
        res.reply = res.done.text if res.done is not None else eng.tokenizer.decode(eng.last_reply_ids,
                                                                                    skip_special_tokens=True)
        res.tokens = len(eng.last_reply_ids)
        session.log_turn(self, "assistant", res.reply, res.tokens, res.done, seconds=res.seconds)
        if self.auto_snapshot is not None:
            self.auto_snapshot.after_turn(eng, self.slog, session.eviction_record(self.metrics))

    def feed_message(self, role: str, content: str, quiet: bool = False) -> int:
        """Feed a message without a reply (transcript replay, mid-conversation system prompt); returns tokens."""
        eng = self.engine
        before = eng.ledger.seen
        from jinja2 import TemplateError

        try:
            events = list(eng.add_message(role, content, add_generation_prompt=False))
        except TemplateError as e:  # a chat template may refuse a role or position (e.g. a late system message)
            if eng.conv.messages and eng.conv.messages[-1] == {"role": role, "content": content}:
                eng.conv.messages.pop()  # rendering failed before anything was fed
            raise ConfigError(f"the chat template refused a {role} message here: {e}") from None
        for ev in events:
            self.metrics.fold(ev)
            if isinstance(ev, (EvictionEvent, ForgottenEvent)):
                self.slog.eviction(ev)  # logged even when not shown: a replay's evictions were missing from the log
                if not quiet:
                    self.r.eviction(ev)
        recall.take(self)  # what feeding it read is no reply's: the next reply's report starts here
        return eng.ledger.seen - before

    def handle(self, line: str) -> None:
        """One input: slash command, message, or nothing (empty line). Raises Exit on /bye."""
        if not line.strip():
            return
        from sinkchat.core.cache_policy import ContextFull

        is_command = line.lstrip().startswith("/") and "\n" not in line.strip()
        try:
            if is_command:
                dispatch(self, line.strip())
            else:
                self.turn(line)
        except ContextFull as e:
            self.r.error(f"{e} (/policy sink, or /clear)")
            if not is_command:  # still one answer per message, so a script's answers stay aligned
                self.r.answer(TurnResult(line, error=str(e)).record())

    def run(self, read: Reader) -> None:
        """Read-eval loop until EOF or /bye. Ctrl-C at the prompt clears the line (or a pending \"\"\" block)."""
        while True:
            try:
                line = read(False)
                if line.lstrip().startswith(FENCE):
                    line = self._read_block(line, read)
            except KeyboardInterrupt:
                if self.exit_on_interrupt:
                    raise
                continue
            except EOFError:
                return
            try:
                self.handle(line)
            except Exit:
                return
            except KeyboardInterrupt:  # Ctrl-C inside a slash command (e.g. a long /load)
                if self.exit_on_interrupt:
                    raise
                self.r.error("^C interrupted")

    @staticmethod
    def _read_block(first: str, read: Reader) -> str:
        """ollama-style multi-line input: from a line starting with \"\"\" to a line ending with \"\"\"."""
        body = first.lstrip()[len(FENCE):]
        if body.rstrip().endswith(FENCE):
            return body.rstrip()[: -len(FENCE)]
        lines = [body] if body else []
        while True:
            try:
                line = read(True)
            except EOFError:
                break
            if line.rstrip().endswith(FENCE):
                lines.append(line.rstrip()[: -len(FENCE)])
                break
            lines.append(line)
        return "\n".join(lines).strip("\n")


# ----------------------------------------------------------------------------------------------- command
def resolve_system(text: str | None, path: str | None) -> str:
    if text is not None and path is not None:
        raise ConfigError("give --system or --system-file, not both")
    if text is not None:
        return text
    if path is not None:
        try:
            return Path(path).read_text(encoding="utf-8", errors="replace").strip()
        except OSError as e:
            raise ConfigError(f"cannot read --system-file {path}: {e.strerror}") from None
    return read_prompt("system")


def load_engine(settings: Any, system: str, tty: bool) -> Any:
    """Load the model with a rich status spinner on stderr (a plain line per step off a terminal); log lines
    written meanwhile are shown after it (`loading.logs_after_spinner`)."""
    if not tty:
        return start(settings, system, lambda m: click.echo(m, err=True)).engine
    from rich.console import Console

    console = Console(stderr=True)
    with logs_after_spinner(console), console.status("loading model ...") as st:
        return start(settings, system, lambda m: st.update(m)).engine


@click.command("chat")
@click.option("--system", "system_text", default=None, metavar="TEXT",
              help="system prompt (default: prompts/system.txt)")
@click.option("--system-file", type=click.Path(dir_okay=False), default=None, help="read the system prompt from a file")
@click.option("--load", "load_name", default=None, metavar="NAME|FILE.json",
              help="start from a snapshot saved with /save NAME, or replay a transcript saved with /save FILE.json")
@click.option("--resume", "resume_arg", is_flag=False, flag_value="", default=None, metavar="[ID]",
              help="continue a logged session after a crash (default: the newest chat session)")
@click.option("--snapshot-every", type=click.IntRange(0, None), default=0, show_default=True,
              help="write an automatic snapshot every N turns (used by --resume)")
@click.option("--no-log", is_flag=True, help="do not write the SQLite session log")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="text: replies as plain text; jsonl: one JSON object per message line read (keys: question, "
                   "answer, tokens, finish_reason, seconds, prompt_tokens, prefill_seconds; error if it failed; "
                   "with --memory on, recalled: the memory blocks the turn read, each block, first, last (the stream "
                   "range [first, last)), age_seconds (since its text was fed), layers, of, reread (read again as text))")
@click.option("--separator", default=None, metavar="LINE",
              help="text format: print LINE on a line of its own after every answer (e.g. '---'), so answers "
                   "spanning several lines can be split")
@common_options
def chat_command(system_text: str | None, system_file: str | None, load_name: str | None, resume_arg: str | None,
                 snapshot_every: int, no_log: bool, fmt: str, separator: str | None, **kw: Any) -> None:
    """Chat with the model forever: replies stream, the cache never overflows (attention sinks keep it sane), and
    the toolbar shows memory, cache fill, evictions and the sink gauge. /help inside lists the slash commands.

    With stdin/stdout not a terminal it reads one message per line and writes plain replies, so
    `sinkchat chat < questions.txt > answers.txt` works (events and stats go to stderr). In text format each answer
    ends with one newline and nothing else marks where it ends, so an answer with line breaks cannot be told from
    two answers: give --separator LINE to end each answer with LINE, or --format jsonl for one JSON object per
    answer (evictions are reported after a reply, on stderr, never inside it)."""
    opts = pop_common(kw)
    setup_logging(opts["verbose"] or 0)
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    out, err = sys.stdout, sys.stderr
    tty_out = _isatty(out) and fmt == "text"
    interactive = tty_out and _isatty(stdin)
    with user_errors():
        settings = build_settings(opts)
        system = resolve_system(system_text, system_file)
        if load_name is not None and resume_arg is not None:
            raise ConfigError("give --load or --resume, not both")
        resume_id = session.resume_target(resume_arg) if resume_arg is not None else None
        if resume_id is not None:
            session.check_resumable(resume_id)  # a wrong id is told before the model loads
        if load_name is not None and not session.is_transcript_file(load_name):
            settings = session.settings_for_load(settings, load_name)
        elif load_name is not None:
            session.read_transcript(Path(load_name).expanduser())  # a missing or broken file: before the model
        engine = load_engine(settings, system, tty_out)
        renderer = Renderer(out, err, tty=tty_out, fmt=fmt, separator=separator)
        slog = session.open_log(engine, "chat", no_log, system, lambda m: renderer.error(m), resume_id)
        auto = None
        if snapshot_every:
            from sinkchat.store.resume import AutoSnapshot

            auto = AutoSnapshot(snapshot_every, warn=lambda m: renderer.error(m))
        loop = ChatLoop(engine, renderer, interactive=interactive, exit_on_interrupt=not interactive, slog=slog,
                        auto_snapshot=auto, settings=settings, sampling_flags=session.sampling_flags(opts))
        with _sigterm_exits() as closing:
            try:
                _start(loop, load_name, resume_id, interactive, stdin)
            except SystemExit as e:
                if e.code == 128 + SIGTERM:  # say why it ended (a service manager's log otherwise shows nothing)
                    at = f"; its log: sinkchat logs show {slog.id}" if getattr(slog, "id", None) else ""
                    renderer.error(f"stopped by SIGTERM{at}")
                raise
            finally:
                closing()  # from here SIGTERM is ignored: the log's close is not cut short
                slog.close()
    if not interactive:  # piped: all written and closed; skip the interpreter's teardown of torch (`exits.exit_now`)
        from sinkchat.apps.exits import allow_fast_exit

        allow_fast_exit()


def _start(loop: ChatLoop, load_name: str | None, resume_id: int | None, interactive: bool, stdin: Any) -> None:
    """Restore (--load / --resume) if asked, then run the loop on a prompt or on stdin."""
    engine = loop.engine
    with user_errors():
        if load_name is not None:
            loaded = (session.load_transcript(loop, load_name) if session.is_transcript_file(load_name)
                      else session.load(loop, load_name, strict=True))
            loop.slog.event("command", f"--load {load_name}", loaded)
        elif resume_id is not None:
            session.do_resume(loop, resume_id)
        if interactive:
            loaded = getattr(engine, "loaded", None)
            c = engine.cache_cfg
            what = f"{Path(loaded.source).name} ({loaded.quant}, {loaded.device})" if loaded is not None else "model"
            pol = f"{c.policy} with {c.n_sink} sinks" if c.policy == "sink" else c.policy
            loop.r.info(f"sinkchat · {what} · cache {c.capacity} tokens, {pol} · "
                        f"/help for commands, /bye or Ctrl-D to exit", style="bold cyan")
            prompt = make_prompt_session(loop, data_dir() / "history")
            loop.run(prompt_reader(prompt))
        else:
            loop.run(stream_reader(stdin))


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


if __name__ == "__main__":  # pragma: no cover
    chat_command(sys.argv[1:])
