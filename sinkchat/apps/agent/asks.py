"""What a task asks for, read from its text: whether the final answer itself is the result a user waits for (a
question, "count the lines ..."), and whether that result is a count or a total. Pure functions, used by verify.py
(an acknowledgment is no answer to a task that asks for something; a count comes from a tool) and by the grammar
(`TaskContext.answer_numbers`).

Why narrow rules: a user audit's "Count the lines of notes.txt" ended `answer: done`, verified, exit 0; the first
rules (any of read / find / check / get in the task; count / total / sum anywhere) then sent back right answers: "done"
after "Find old.log and delete it" (a side effect is the result), `east` for "Which region has the biggest total?"
(a name), `hello` for "Read total.txt and tell me what it says" (a file name), `completed` for "What is the status
field in job.json?" (a status word a tool returned). tests/test_agent_asks.py holds each case.
"""

from __future__ import annotations

import re

QUESTION = re.compile(r"\?\s*$|^\s*(?:what|which|who|whom|whose|where|when|how|why)\b", re.I)
LOOKUP = re.compile(r"^\s*(?:please\s+)?(?:count|find|list|show|tell|report|look\s+up|compute|calculate|read|print|"
                    r"get|give|check|search|display|return|say)\b", re.I)
MUTATES = re.compile(r"\b(?:delete|remove|rm|fix|set|append|move|rename|write|create|update|edit|change|replace|"
                     r"follow|rid|clean|install|run|execute|copy|save|add|make|put|store|insert|overwrite|truncate|"
                     r"empty|clear|archive|compress|sort)\b", re.I)
# a count or a total as the thing asked for; a keyword inside a file name ("total.txt") is no such word
_KEY = r"(?:count|total|sum|average|mean|number\s+of)(?![.\w-])"
COUNT = re.compile(rf"^\s*(?:please\s+)?count\b|\bhow\s+(?:many|much)\b|"
                   rf"^\s*(?:please\s+)?(?:what(?:'s|\s+is|\s+are|\s+was|\s+were)?|tell\s+me|give\s+me|report|"
                   rf"compute|calculate|find|get|show(?:\s+me)?)\s+(?:the\s+|a\s+)?(?:\w+\s+)?{_KEY}", re.I)
NOT_COUNT = re.compile(r"^\s*(?:which|who|whom|whose|where|does|do|did|is|are|was|were|can|could|will|should)\b",
                       re.I)
ACK_WORDS = {"done", "ok", "okay", "finished", "complete", "completed", "success", "successful", "successfully",
             "ready", "all", "set"}
ACK_FILLER = {"i", "i'm", "i've", "im", "ive", "have", "has", "am", "is", "it", "it's", "its", "the", "this", "that",
              "my", "task", "job", "work", "request", "everything", "now", "already", "been", "was"}
NEGATIVE = re.compile(r"^\s*(?:there\s+(?:are|is|were|was)\s+)?(?:no|none|zero|nothing)\b", re.I)
NUMBER_WORDS = re.compile(r"\b(?:zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|"
                          r"fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|"
                          r"seventy|eighty|ninety|hundred|thousand|million)\b", re.I)


def asks_something(task: str) -> bool:
    """The task asks for information, so the answer is its result: a question, or a look-up imperative ("Count
    ...", "List ...", "Read X and tell me ...") with no verb that changes anything ("Find old.log and delete it"
    is done when the file is gone; "done" answers it)."""
    if QUESTION.search(task):
        return True
    return bool(LOOKUP.search(task)) and not MUTATES.search(task)


def asks_count(task: str) -> bool:
    """The answer is a count or a total ("Count the lines ...", "How many ...", "What is the total of ..."); not a
    name or a yes / no that merely mentions one ("Which region has the biggest total?", "Does the sum match 42?")."""
    return not NOT_COUNT.search(task) and bool(COUNT.search(task))


def is_acknowledgment(answer: str, results: str = "") -> bool:
    """The answer only says the work is done ("done", "OK", "Task complete!", "I have completed the task."), and no
    tool result of the task holds it as data (`completed` read from a job's status field is an answer)."""
    words = re.findall(r"[a-z']+", answer.lower())
    if not words or not any(w in ACK_WORDS for w in words) or any(w not in ACK_WORDS | ACK_FILLER for w in words):
        return False
    if re.search(r"[0-9]", answer):
        return False
    said = answer.strip(" .!\n")
    return not re.search(rf"(?<!\w){re.escape(said)}(?!\w)", results, re.I)


def negative_count(answer: str) -> bool:
    """A count of none, or one in words: "none", "No errors", "There are no matches", "four lines"."""
    return bool(NEGATIVE.search(answer) or NUMBER_WORDS.search(answer))
