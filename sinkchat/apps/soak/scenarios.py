"""The workloads `sinkchat soak` runs on the one persistent cache, by name: one module per scenario family
(scenario_agent, scenario_chat, scenario_summarize, scenario_stream); what a step yields and the helpers the
scenarios share are in steps.py, the tap that scores what they feed in tap.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sinkchat.apps.soak.scenario_agent import AgentScenario
from sinkchat.apps.soak.scenario_chat import ChatScenario, chat_prompts
from sinkchat.apps.soak.scenario_stream import StreamScenario, check_input
from sinkchat.apps.soak.scenario_summarize import SummarizeScenario
from sinkchat.apps.soak.steps import CHAT_MAX_TOKENS


def make_scenario(name: str, engine: Any, *, input_path: str | None = None, workspace: Path | None = None,
                  allow_shell: bool = False, max_tokens: int | None = None, seed: int = 0) -> Any:
    if name == "chat":
        return ChatScenario(chat_prompts(), max_tokens or CHAT_MAX_TOKENS, seed)
    if name == "stream":
        check_input(input_path)
        return StreamScenario(engine, input_path)
    if name == "agent":
        return AgentScenario(engine, workspace or Path("soak-workspace"), allow_shell, max_tokens, seed)
    if name == "summarize":
        return SummarizeScenario(max_tokens or CHAT_MAX_TOKENS, seed)
    raise click.UsageError(f"unknown scenario {name!r}")


SCENARIOS = ("agent", "chat", "summarize", "stream")
