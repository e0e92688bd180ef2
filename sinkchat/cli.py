"""The thin click group. Subcommands live with their clients and are imported lazily, so `sinkchat --help` and a
mistyped flag answer at once without importing torch.

`sinkchat --help` lists every command with its one-line summary, which click takes from each command object: that
imported all eleven command modules, torch and transformers with them (the agent's grammar, the chat's rich UI),
and took 1.6 s on a quiet machine, 2.5 s on a busy one. The summaries are kept here instead (`SUMMARIES`, checked
against the commands' own help by tests/test_startup.py), and `--help` imports no command: ~0.1 s."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

# Must be set before torch/OpenMP start: spinning OpenMP waits make a 2-core box ~30x slower under load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import click  # noqa: E402

from sinkchat import __version__  # noqa: E402
from sinkchat.bootstrap import common_options  # noqa: E402
from sinkchat.apps import exits  # noqa: E402
from sinkchat.model import collector  # noqa: E402

COMMANDS: dict[str, tuple[str, str]] = {
    "chat": ("sinkchat.apps.chat.repl", "chat_command"),
    "ppl": ("sinkchat.apps.evals.ppl", "ppl_command"),
    "demo": ("sinkchat.apps.evals.demo", "demo_command"),
    "probe-sinks": ("sinkchat.apps.evals.demo", "probe_sinks_command"),
    "bench": ("sinkchat.apps.evals.bench", "bench_command"),
    "summarize": ("sinkchat.apps.summarize.command", "summarize_command"),
    "agent": ("sinkchat.apps.agent.command", "agent_command"),
    "soak": ("sinkchat.apps.soak.command", "soak_command"),
    "serve": ("sinkchat.apps.serve.command", "serve_command"),
    "logs": ("sinkchat.apps.logs", "logs_command"),
    "cache": ("sinkchat.apps.cache", "cache_command"),
}
# Each command's first help paragraph, as its docstring has it (click cuts it to the terminal's width itself).
SUMMARIES: dict[str, str] = {
    "chat": "Chat with the model forever: replies stream, the cache never overflows (attention sinks keep it sane), "
            "and the toolbar shows memory, cache fill, evictions and the sink gauge. /help inside lists the slash "
            "commands.",
    "ppl": "Stream FILE through the engine token by token and print perplexity per bin and overall, per policy.",
    "demo": "Show on the loaded model why the first tokens must stay: window vs sink ppl, attention shares, ablation.",
    "probe-sinks": "Which early positions act as attention sinks for this model, and how many --sinks it needs (by "
                   "ppl).",
    "bench": "Measure prefill/decode speed, p50/p99 latency, RSS and KV bytes for sink, dense and recompute.",
    "summarize": "Summarize a log as it arrives: `tail -f app.log | sinkchat summarize` or a FILE.",
    "agent": "Run a tool-using agent on TASK (no TASK: type tasks at a prompt, or pipe one task per line).",
    "soak": "Run a scenario on the one persistent cache for hours; record metrics, then judge them (report.md, "
            "PNGs).",
    "serve": "Serve the model over the OpenAI API: POST /v1/chat/completions (tools, response_format, streaming), "
             "/v1/completions, GET /v1/models, /v1/sessions/{id}, /health. Name a session with the X-Session-Id "
             "header and it keeps its own sink cache for good: each request feeds only its new messages.",
    "logs": "List logged sessions (newest first); `logs show ID` prints one, `logs rm ID` deletes one.",
    "cache": "The model cache (converted GGUFs, keyed by content and shared by all your environments). `cache list` "
             "(the default) shows each entry; `cache clean` removes old-layout, half-written, orphaned and unused "
             "ones.",
}


CHAT_ONLY_OPTIONS = ("--system", "--system-file", "--load", "--resume", "--snapshot-every", "--no-log")


class LazyGroup(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """`sinkchat --no-log ...` means `sinkchat chat --no-log ...`: chat's own options work without the word."""
        if not any(a in COMMANDS for a in args) and any(a.split("=")[0] in CHAT_ONLY_OPTIONS for a in args):
            args = ["chat", *args]
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name, (mod, _) in COMMANDS.items() if importlib.util.find_spec(mod) is not None]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        mod, attr = COMMANDS[name]
        if importlib.util.find_spec(mod) is None:
            return None
        return getattr(importlib.import_module(mod), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list of `--help` from `SUMMARIES`, without importing any command (click's own
        `format_commands` calls `get_command` for each, for its short help)."""
        rows = [(name, click.Command(name, help=SUMMARIES.get(name, ""))) for name in self.list_commands(ctx)]
        if not rows:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in rows)
        with formatter.section("Commands"):
            formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in rows])


@click.group(cls=LazyGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="sinkchat", message="%(prog)s %(version)s")
@common_options
@click.pass_context
def main(ctx: click.Context, **opts: Any) -> None:
    """sinkchat: chat, summarize logs and run agents forever on one 4-bit model and one attention-sink KV cache.

    With no command, starts `sinkchat chat`. Options given here apply to every command; settings come from flags,
    then SINKCHAT_* environment variables, then a .env file in the working directory.

    The default model, the embedded SmolLM2-135M-Instruct, is a small demo model: fast anywhere, often wrong. For
    real use pass your own: `sinkchat --model FILE.gguf` (a llama.cpp GGUF of a Llama, Qwen2/3, Mistral, Phi-3 or
    Gemma 2/3 model: Q4_0 ... Q8_0, K-quants, F16) or `--model FOLDER` (a Hugging Face model folder).
    """
    ctx.obj = opts
    if ctx.invoked_subcommand is None:
        chat = ctx.command.get_command(ctx, "chat")  # type: ignore[attr-defined]
        if chat is None:
            raise click.ClickException("the chat command is not installed")
        ctx.invoke(chat)


def run() -> None:
    """The `sinkchat` command. A command that allowed it (a piped chat) ends in `exit_now`; SINKCHAT_FAST_EXIT=0
    turns that off (the interpreter's own exit, for comparison). Python's garbage collector is off until the model
    is loaded (`model/collector.py`: 0.7-0.8 s of a later start on the busy 2-core box)."""
    exits.reset()
    collector.pause()
    try:
        main(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit as e:
        if exits.fast_exit_allowed() and e.code in (0, None) and os.environ.get("SINKCHAT_FAST_EXIT", "1") != "0":
            exits.exit_now(0)
        raise
    finally:
        collector.resume(freeze=False)  # a command that loaded no model (an in-process caller gets it back)


if __name__ == "__main__":
    run()
