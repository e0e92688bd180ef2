"""What a task asks for (apps/agent/asks.py): the cases a code review found the first rules got wrong, and the ones
they were written for. Each line is a real kind of task a user types."""

from __future__ import annotations

import pytest

from sinkchat.apps.agent.asks import asks_count, asks_something, is_acknowledgment, negative_count
from sinkchat.apps.agent.verify import TaskCheck


@pytest.mark.parametrize("task,asks", [
    ("Count the lines of notes.txt", True),
    ("What port is set in config.json?", True),
    ("List the files in the workspace.", True),
    ("Read the file file2.txt and tell me what it says.", True),
    ("Is debug on in config.json?", True),
    ("Get rid of old.log", False),  # side effects: "done" answers them once done
    ("Find old.log and delete it", False),
    ("Check config.json and fix the typo in it", False),
    ("Read config.json, then set debug to true in it", False),
    ("Read notes.txt and append the line 'reviewed' to it", False),
    ("Read the instructions in notes.txt and follow them", False),
    ("Do the cleanup in the workspace", False),
])
def test_a_task_asks_for_something_only_when_its_answer_is_the_result(task, asks):
    assert asks_something(task) == asks


@pytest.mark.parametrize("task,count", [
    ("Count the lines of notes.txt", True),
    ("How many lines does notes.txt have?", True),
    ("What is the total of the amount column in sales.csv?", True),
    ("Tell me the number of files in the workspace", True),
    ("What's the sum of column a?", True),
    ("Which region has the biggest total in sales.csv?", False),  # a name
    ("Find the user with the largest number of logins", False),
    ("Which file has the highest count of errors?", False),
    ("Does the sum in report.txt match 42?", False),  # yes / no
    ("Read total.txt and tell me what it says", False),  # a file name
])
def test_a_count_is_asked_for_only_as_the_answer(task, count):
    assert asks_count(task) == count


@pytest.mark.parametrize("answer,results,ack", [
    ("done", "", True), ("Task complete!", "", True), ("I have completed the task.", "", True), ("all set", "", True),
    ("done for 4", "", False), ("completed", '{"status": "completed"}', False),  # a status a tool returned
    ("ready", "server ready", False), ("done", "the job was abandoned", True),  # whole words only
])
def test_an_acknowledgment_says_only_that_the_work_is_done(answer, results, ack):
    assert is_acknowledgment(answer, results) == ack


def test_a_count_comes_from_a_tool_or_says_there_is_none():
    """"How many of the first 10 lines ... are errors?" answered `10` (the task's own number) was verified."""
    check = TaskCheck("How many of the first 10 lines of app.log are errors?", None)
    check.grounding.add("INFO a\nINFO b")
    assert check.unanswered("10") and check.unanswered("done")
    assert check.unanswered("none") == [] == check.unanswered("No errors") == check.unanswered("two")
    assert negative_count("There are no errors") and not negative_count("some lines")
    check.grounding.add("2")
    assert check.unanswered("2 lines") == [] and check.context().answer_numbers == ("2",)


def test_a_number_too_long_to_offer_does_not_break_the_grammar():
    check = TaskCheck("What is the total in big.txt?", None)
    check.grounding.add("1" * 40)
    assert check.context().answer_pattern() is not None  # the plain grounded pattern, not a ValueError
