"""`sinkchat summarize`, the command: options, input selection, signals and exit codes around the Summarizer."""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import click

from sinkchat.api import start
from sinkchat.bootstrap import build_settings, common_options, pop_common, read_prompt, setup_logging, user_errors
from sinkchat.apps.runlog import open_log
from sinkchat.apps.summarize.batching import Batcher
from sinkchat.apps.summarize.output import FORMATS, Output, OutputClosed
from sinkchat.apps.summarize.reader import LineQueue, Reader, follow_chunks, stream_chunks
from sinkchat.apps.summarize.stop import signal_name
from sinkchat.apps.summarize.summarizer import DEFAULT_SUMMARY_TOKENS, Interrupted, Status, Summarizer

log = logging.getLogger(__name__)

READER_GRACE = 0.5  # seconds a stopped reader gets to hand over its count (it may sit in a blocking read forever)


def _compile(pattern: str | None, flag: str) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise click.UsageError(f"{flag} {pattern!r} is not a valid regular expression: {e}") from None


@click.command("summarize")
@click.argument("file_arg", metavar="[FILE]", required=False, type=click.Path(dir_okay=False))
@click.option("--file", "file_path", type=click.Path(dir_okay=False), default=None, help="read this file instead of stdin")
@click.option("--follow", "follow_path", type=click.Path(dir_okay=False), default=None,
              help="follow this file like `tail -F` (survives rotation and truncation); ends with Ctrl-C")
@click.option("--from-end", is_flag=True, help="with --follow: skip what the file already holds")
@click.option("--every", type=click.IntRange(0, None), default=100, show_default=True,
              help="summarize every N input lines (0 = only on --interval and at the end)")
@click.option("--interval", type=click.FloatRange(0, None), default=300.0, show_default=True,
              help="summarize at least every SECONDS when lines came in (0 = off)")
@click.option("--chunk-lines", type=click.IntRange(1, None), default=32, show_default=True, help="lines fed per chunk")
@click.option("--chunk-tokens", type=click.IntRange(1, None), default=256, show_default=True, help="tokens fed per chunk")
@click.option("--grep", default=None, help="keep only lines matching this regex")
@click.option("--exclude", default=None, help="drop lines matching this regex")
@click.option("--dedupe/--no-dedupe", default=True, show_default=True, help="count repeated identical lines like uniq -c")
@click.option("--max-line-chars", type=click.IntRange(16, None), default=500, show_default=True,
              help="longer lines are cut, with a marker")
@click.option("--backpressure", type=click.Choice(("drop", "block")), default=None,
              help="when the model falls behind: drop lines (counted as skipped) or block the writer "
                   "[default: block for --file or a redirected file, drop for pipes and --follow]")
@click.option("--queue-lines", type=click.IntRange(1, None), default=10000, show_default=True,
              help="lines read ahead of the model before back-pressure starts")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True)
@click.option("--prompt", "prompt_path", type=click.Path(dir_okay=False), default=None,
              help="question template instead of prompts/summarize.txt ({first_line} {last_line} {lines} {skipped} ...)")
@click.option("--quiet", "-q", is_flag=True, help="no progress or notices on stderr")
@click.option("--no-log", is_flag=True, help="do not write the SQLite session log")
@common_options
@click.pass_context
def summarize_command(ctx: click.Context, file_arg: str | None, file_path: str | None, follow_path: str | None,
                      from_end: bool, every: int,
                      interval: float, chunk_lines: int, chunk_tokens: int, grep: str | None, exclude: str | None,
                      dedupe: bool, max_line_chars: int, backpressure: str | None, queue_lines: int, fmt: str,
                      prompt_path: str | None, quiet: bool, no_log: bool, **kw: Any) -> None:
    """Summarize a log as it arrives: `tail -f app.log | sinkchat summarize` or a FILE.

    Lines are fed once into the one persistent sink cache; every --every lines or --interval seconds a summary of
    what happened since the last one is printed to stdout, headed by a timestamp and its line range. At the end of
    input: a final summary, exit 0. Ctrl-C: feeding stops at once; a final summary of what the cache holds (lines
    read but not fed are counted as skipped), exit 130 (SIGTERM: the same, exit 143).
    """
    opts = pop_common(kw)
    setup_logging(opts["verbose"] or 0)
    status = Status(sys.stderr, quiet)
    with user_errors():
        if file_arg and follow_path:  # `--follow a.log b.log`: "use either --file or --follow" named no --file
            raise click.UsageError(f"--follow reads one file: {follow_path} (and {file_arg} given too)")
        if from_end and not follow_path:
            raise click.UsageError("--from-end goes with --follow FILE (it skips what the followed file holds)")
        if file_arg and file_path and file_arg != file_path:
            raise click.UsageError(f"two files given: {file_arg} and --file {file_path}")
        file_path = file_path or file_arg  # `summarize app.log`, as `--file app.log`
        if file_path and follow_path:
            raise click.UsageError("use either --file or --follow, not both")
        grep_re, exclude_re = _compile(grep, "--grep"), _compile(exclude, "--exclude")
        prompt = _load_prompt(prompt_path)
        if opts["max_tokens"] is None and not os.environ.get("SINKCHAT_MAX_TOKENS"):
            opts["max_tokens"] = DEFAULT_SUMMARY_TOKENS
        settings = build_settings(opts)
        q = LineQueue(maxsize=queue_lines)
        reader = _start_reader(q, file_path, follow_path, from_end, backpressure, max_line_chars, status)
        try:
            engine = start(settings, None, status.notice).engine
        except KeyboardInterrupt:
            reader.stop.set()
            ctx.exit(130)  # Ctrl-C while loading: nothing was summarized yet
        halt = threading.Event()
        with StopSignals(lambda: (halt.set(), reader.stop.set())) as signals:  # a stop request, not an exception
            batcher = Batcher(lambda s: len(engine.encode(s)), chunk_lines, chunk_tokens, grep_re, exclude_re, dedupe)
            slog = open_log(engine, "summarize", no_log, fed_system(engine), status.notice,
                            extra={"input": follow_path or file_path or "stdin", "every": every, "interval": interval,
                                   "prompt": prompt_path or "prompts/summarize.txt"})
            summ = Summarizer(engine, batcher, Output(fmt, sys.stdout), status, prompt=prompt, every=every,
                              interval=interval, max_tokens=settings.sampling.max_tokens, slog=slog, halt=halt)
            summ.queued = lambda: q.lines  # lines only: q.qsize() also counts the End marker and notices
            code = _summarize(summ, q, reader, status, slog, signals)
    ctx.exit(code)


class StopSignals:
    """SIGTERM and Ctrl-C while summarizing. The first one raises nothing where it lands: it calls `on_stop` (set
    the Summarizer's halt event and stop the reader), so feeding stops at the next chunk or token boundary and the
    final summary follows at once, whatever backlog is queued. A second one raises KeyboardInterrupt, which gives
    that final summary up (an impatient second Ctrl-C must still end the process)."""

    def __init__(self, on_stop: Callable[[], Any]) -> None:
        self.on_stop = on_stop
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() of the first signal: the final summary's clock starts here
        self.old: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.old[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        """Put the previous handlers back: the command also runs inside other processes (tests, click's runner),
        where a stale handler would swallow the next Ctrl-C."""
        for sig, old in self.old.items():
            signal.signal(sig, old)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum, self.at = signum, time.monotonic()
        self.on_stop()

    @property
    def code(self) -> int:
        """The exit status: 143 after SIGTERM, 130 after Ctrl-C (128 + the signal, as a shell reports it), else 0."""
        return 0 if self.signum is None else 128 + self.signum


def _summarize(summ: Summarizer, q: LineQueue, reader: Reader, status: Status, slog: Any,
               signals: StopSignals) -> int:
    """Run the Summarizer until the input ends or a stop; returns the exit status."""
    try:
        try:
            summ.run(q)
        except Interrupted:
            status.clear()
            reader.join(READER_GRACE)  # its count of the lines it read is final once it has stopped
            summ.finish_stopped(q, reader.n, at=signals.at, by=signal_name(signals.signum))
    except KeyboardInterrupt:
        log.info("a second signal: the final summary was given up")
    except OutputClosed:
        reader.stop.set()
        _silence_stdout()
        return 0
    except Exception as e:
        if type(e).__name__ == "TemplateError":
            raise click.ClickException(f"the model's chat template refused the log turns: {e}") from None
        raise
    finally:
        slog.close()
    return signals.code or (1 if summ.error else 0)


_MARK = "SINKCHAT-PROBE-{}-7f3a"  # text no template rewrites, to find where a message's content goes


def fed_system(engine: Any) -> str | None:
    """The system prompt the model is actually fed: the conversation's own, else the one the chat template puts in
    when there is none (SmolLM2's "You are a helpful AI assistant named SmolLM, trained by Hugging Face"), else
    None. Why: the session log's [system] entry showed the question template with its `{first_line} ... {digest}
    ... {note}` unfilled, while the eviction line beside it showed the real, template-supplied prompt being
    evicted. Found by rendering one user message with and without a marked system message: the text in the marked
    one's place is the default."""
    conv = getattr(engine, "conv", None)
    if conv is None or conv.system is not None:
        return None if conv is None else conv.system
    tok = conv.tokenizer
    if not getattr(tok, "chat_template", None):
        return None
    user = [{"role": "user", "content": _MARK.format("user")}]
    try:
        plain = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=False)
        marked = tok.apply_chat_template([{"role": "system", "content": _MARK.format("system")}] + user,
                                         tokenize=False, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that refuses either rendering: nothing known to be fed
        log.debug("chat template cannot render the system probe", exc_info=True)
        return None
    pre, _, post = marked.partition(_MARK.format("system"))
    if not post or not plain.startswith(pre) or not plain.endswith(post) or len(plain) < len(pre) + len(post):
        return None
    return plain[len(pre): len(plain) - len(post)] or None


def _load_prompt(prompt_path: str | None) -> str:
    """The question template: --prompt FILE, else prompts/summarize.txt."""
    if not prompt_path:
        return read_prompt("summarize")
    try:
        return Path(prompt_path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise click.UsageError(f"cannot read --prompt {prompt_path}: {getattr(e, 'strerror', None) or e}") from None


def _start_reader(q: LineQueue, file_path: str | None, follow_path: str | None, from_end: bool,
                  backpressure: str | None, max_line_chars: int, status: Status) -> Reader:
    """Start the reader thread on --follow, --file or stdin, so reading runs while the model loads. The default
    back-pressure blocks a file (nothing is lost, the writer is not live) and drops for pipes and --follow (a live
    writer must never stall behind the model)."""
    stop = threading.Event()
    reader_box: list[Reader] = []
    if follow_path:
        chunks: Any = follow_chunks(follow_path, stop, lambda m: reader_box[0].notice(m), from_end=from_end)
        mode = backpressure or "drop"
    else:
        stream = _open_input(file_path)
        regular = _is_regular(stream)
        chunks = stream_chunks(stream, stop)
        mode = backpressure or ("block" if file_path or regular else "drop")
        if not file_path and not regular and getattr(sys.stdin, "isatty", lambda: False)():
            status.notice("reading log lines from the terminal; end with Ctrl-D")
    reader = Reader(chunks, q, max_line_chars=max_line_chars, backpressure=mode, stop=stop)
    reader_box.append(reader)
    reader.start()
    return reader


def _open_input(file_path: str | None) -> Any:
    if not file_path:
        return getattr(sys.stdin, "buffer", sys.stdin)
    try:
        return open(file_path, "rb")  # noqa: SIM115 - owned by the reader thread until exit
    except OSError as e:
        raise click.ClickException(f"cannot read {file_path}: {e.strerror}") from None


def _is_regular(stream: Any) -> bool:
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, AttributeError, ValueError):
        return False


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush cannot complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
