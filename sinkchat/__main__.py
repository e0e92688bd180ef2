"""`python -m sinkchat`: the same CLI as the `sinkchat` command."""

from sinkchat.cli import run

if __name__ == "__main__":
    run()
