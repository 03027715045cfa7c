"""Command-line plumbing shared by example.py, bench.py and `nanovllm serve`: a user mistake (a bad
flag, a bad value, a missing folder) ends in one stderr line naming it and exit status 2."""
import argparse
import sys

USER_ERROR = 2  # argparse's own exit status for a bad command line


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line is reported in one line (no usage block)."""

    def error(self, message: str):
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def print_error(prog: str, error: Exception | str, status: int = USER_ERROR) -> int:
    """Print `prog: error: ...` on stderr (one line); return the exit status, a user mistake's by default."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    return status
