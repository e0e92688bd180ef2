"""The words a summary sentence may use without the log lines backing them: English function words, and a small
fixed vocabulary of words every summary of a log uses ("lines", "entries", "shows", "between", "several").

Why a list in code and not a package: this is part of the support rule itself (every other word of a model
sentence must occur in the lines or their digest, factcheck.py), so it is kept short, reviewed and versioned with
the rule; a stop-word package's list changes with its releases and holds content words a summary must not use
freely ("system", "problem", "computer" are in some). Stemming, which is logic, comes from snowballstemmer
(Porter2; "installed", "installation" and "install" share the stem "instal").
"""

from __future__ import annotations

import re

FUNCTION_WORDS = frozenset("""
a about above across after again against all almost along already also although always am among an and another any
anyone anything are aren around as at away be became because been before being below beside besides between both
but by can cannot could couldn did didn do does doesn doing don done down during each either else enough etc even
ever every except few for from further had hadn has hasn have haven having he her here hers herself him himself his
how however i if in into is isn it its itself just least less like many may me might mine more most much must my
myself near neither no nor not now of off often on once one only onto or other others otherwise our ours ourselves
out over own per perhaps quite rather same several shall she should shouldn since so some such than that the their
theirs them themselves then there therefore these they this those though through thus to together too toward
towards under until up upon us very via was wasn we were weren what whatever when whenever where whereas whether
which while who whom whose why will with within without would wouldn yet you your yours yourself yourselves
""".split())

# Words about a log rather than in it, numbers as words, and the connectives of a plain summary. Not "mention" or
# "tell": the prompt's own instruction verbs, which a reply that paraphrases the prompt would use.
SUMMARY_WORDS = frozenset("""
line lines log logs entry entries message messages event events record records recorded item items output
period time times moment timestamp timestamps second seconds minute minutes hour hours day days date dates
first last next previous later earlier latest final initial start started starting end ended ending
total count counted number numbers amount sum several various multiple numerous single
show shows showed shown showing report reports reported reporting include includes included including
contain contains contained containing list lists listed appear appears appeared
occur occurs occurred happen happens happened take took taken see seen note noted indicate indicates indicated
repeat repeats repeated repeatedly similar different kind kinds type types form forms mostly mainly
generally overall respectively summary summarized range following followed follows
zero two three four five six seven eight nine ten eleven twelve dozen dozens hundred hundreds thousand thousands
once twice same other frequent frequently value values severity word words find finds found
""".split())

# A state change a reader must not lose, whatever the line's level word says: canonical key -> word pattern (matched
# like the severity words in digest.py: case-blind, never glued to an identifier, so "startup", "/api/start" and
# "Start-Date" are no start). Why a list of its own: in the log `INFO systemd: worker.service restarted`
# holds no severity word, so the digest named 3 of its 4 kinds and the restart in none of the summaries; a companion
# `service started on port 8080` was never shown either. Severities (digest.py) stay claims a model sentence must
# back by key; these are named by code (guard.py) and a model sentence about them is checked word by word.
# Verb forms only ("restarted", "resumed"; not "restart required", "Resume uploaded", "Traceback settings") and
# phrases for the nouns that do report an event ("scheduled restart", "leader elected", "rate limit exceeded"): a
# code review found "Resume uploaded: resume.pdf" read as recovered, "promoted user bob to admin" as a leader change
# and "rate limit 100 req/s configured" as throttled. Negated ("no exception occurred") and zero ("exit code 0",
# "pods evicted: 0") matches are no change (digest.changes).
CHANGE_WORDS = {
    "restart": r"re-?start(?:s|ed|ing)|respawn(?:s|ed|ing)|schedul(?:ed|ing) restart",
    "start": r"start(?:s|ed|ing)|launch(?:es|ed|ing)|listening on|up and running",
    "stop": r"stop(?:s|ped|ping)",
    "exit": r"exit(?:s|ed|ing)?",  # "exit code 137": the noun with a code is the event; code 0 is none
    "terminated": r"terminat(?:es|ed|ing)",
    "shutdown": r"shut(?:ting)?[ -]?down|shutdown",
    "reboot": r"re-?boot(?:s|ed|ing)",
    "reload": r"reload(?:s|ed|ing)",
    "signal": r"sig(?:term|kill|hup|int|segv|abrt|quit)",
    "core dump": r"core dump(?:ed)?|dumped core",
    "exception": r"(?:unhandled|uncaught) exception|exception in thread|exception (?:occurred|raised|thrown|caught)"
                 r"|(?:threw|raised|thrown|throws|caught)(?: an?)? exception|traceback \(most recent call last\)"
                 r"|(?-i:(?:[\w$]+\.)*[A-Z][\w$]*(?:Exception|Error)|Exception(?=:))",  # Java/Python classes
    "failover": r"fail[ -]?over",
    "deploy": r"deploy(?:s|ed|ing)|roll(?:ed|ing) out|rollout complete(?:d)?",
    "rollback": r"roll(?:ed|ing)[ -]?back",
    "connection lost": r"(?:connection|conn) (?:lost|reset|dropped)|lost connection|disconnected unexpectedly"
                       r"|unexpectedly disconnected",
    "reconnect": r"reconnect(?:s|ed|ing)",
    "down": r"(?:is|went|gone|going) down",
    "recovered": r"recover(?:s|ed|ing)|recovery complete(?:d)?|(?:is|are|came|comes|coming) back (?:up|online)"
                 r"|back online|resum(?:ed|ing)",
    "unhealthy": r"unhealthy|degraded",
    "leader": r"new leader|elected (?:as )?leader|became (?:the )?leader|leader (?:elected|changed|lost)"
              r"|lost leadership|promot(?:ed|ing) to (?:primary|master|leader)"
              r"|demot(?:ed|ing) to (?:secondary|replica|follower|standby)",
    "evicted": r"evict(?:ed|ing)",
    "throttled": r"throttl(?:ed|ing)|rate[ -]limit(?:ed| exceeded| reached)",
}

# Changes that report a failure though the line holds no severity word (a Python traceback, `Exception in thread
# "main" java.lang.NullPointerException`, "node-3 is down"): a summary that shows one never also says "No line
# shows a severity word (no errors or warnings)." (written.py), and a model's "no errors" beside one is a
# contradiction (guard.py).
FAILURE_CHANGES = frozenset({"exception", "core dump", "signal", "down", "unhealthy", "connection lost"})

# Changes a healthy system logs all day (systemd's "Started Session 42 of User root.", "Stopping User Manager...",
# a config reload): named by code only beside a failure or an ended or restarted process (written.py).
ROUTINE_CHANGES = frozenset({"start", "stop", "reload"})
ROUTINE_TRIGGERS = FAILURE_CHANGES | {"restart", "exit", "terminated"}

NEGATIONS = frozenset({"no", "not", "without", "zero", "0", "none", "never", "nor", "free", "neither"})
_WORD_RE = re.compile(r"[A-Za-z0-9']+")


def negated(text: str, start: int) -> bool:
    """A word preceded (within four words of its own clause) by a negation is not a claim: "no errors", "without
    failure", "no exception occurred", "0 pods evicted"; "did not start: permission denied" is one."""
    clause = re.split(r"[:;,(.!?]", text[max(0, start - 40): start])[-1]
    before = _WORD_RE.findall(clause.lower())[-4:]
    return any(w in NEGATIONS or w.endswith("n't") for w in before)
