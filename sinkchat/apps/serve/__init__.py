"""`sinkchat serve`: the OpenAI-compatible server (command.py > app.py > runner.py > sessions.py, grammar.py,
requests.py)."""
