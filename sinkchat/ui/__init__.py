"""Terminal front end: the chat REPL (`repl`), its slash commands (`commands`) and rich rendering (`render`)."""
