"""The words a summary sentence may use without the log lines backing them: English function words, and a small
fixed vocabulary of words every summary of a log uses ("lines", "entries", "shows", "between", "several").

Why a list in code and not a package: this is part of the support rule itself (every other word of a model
sentence must occur in the lines or their digest, factcheck.py), so it is kept short, reviewed and versioned with
the rule; a stop-word package's list changes with its releases and holds content words a summary must not use
freely ("system", "problem", "computer" are in some). Stemming, which is logic, comes from snowballstemmer
(Porter2; "installed", "installation" and "install" share the stem "instal").
"""

from __future__ import annotations

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
CHANGE_WORDS = {
    "restart": r"re-?start(?:s|ed|ing)?|respawn(?:s|ed|ing)?",
    "start": r"start(?:s|ed|ing)?|launch(?:es|ed|ing)?|listening on|up and running",
    "stop": r"stop(?:s|ped|ping)?",
    "exit": r"exit(?:s|ed|ing)?",
    "terminated": r"terminat(?:e|es|ed|ing|ion)",
    "shutdown": r"shut(?:ting)?[ -]?down|shutdown",
    "reboot": r"re-?boot(?:s|ed|ing)?",
    "reload": r"reload(?:s|ed|ing)?",
    "signal": r"sig(?:term|kill|hup|int|segv|abrt|quit)",
    "core dump": r"core dump(?:ed)?|dumped core",
    "exception": r"exception|traceback|(?-i:(?:[\w$]+\.)*[A-Z][\w$]*(?:Exception|Error))",  # Java/Python classes
    "failover": r"fail[ -]?over",
    "deploy": r"deploy(?:s|ed|ing|ment)?|roll(?:ed|ing)? out|rollout",
    "rollback": r"roll(?:ed|ing)?[ -]?back|rollback",
    "connection lost": r"(?:connection|conn) (?:lost|reset|closed|dropped)|lost connection|disconnect(?:s|ed|ing)?",
    "reconnect": r"reconnect(?:s|ed|ing)?",
    "down": r"(?:is|went|gone|going) down",
    "recovered": r"recover(?:s|ed|y|ing)?|back (?:up|online)|resum(?:e|es|ed|ing)",
    "unhealthy": r"unhealthy|degraded",
    "leader": r"(?:new|elected|became) leader|leader (?:elected|changed)|promot(?:ed|ing)|demot(?:ed|ing)",
    "evicted": r"evict(?:ed|ion)",
    "throttled": r"throttl(?:ed|ing)|rate[ -]limit(?:ed)?",
}
