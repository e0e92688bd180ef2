"""The thin click group. Subcommands live with their clients and are imported lazily, so `sinkchat --help` and a
mistyped flag answer at once without importing torch."""

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
    try:
        main(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    run()
