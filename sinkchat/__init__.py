"""sinkchat: a terminal chat, log summarizer and agent REPL on one 4-bit model and one attention-sink KV cache."""

__version__ = "0.1.0"
