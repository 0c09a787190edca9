"""What a `k3` command reports when it fails, and with which exit status: one line, never a traceback (`--debug`
shows it)."""

from __future__ import annotations


from torch.distributed import DistError

from k3.fileio import describe_error


EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
"""Exit statuses: a run that failed (a full disk, a diverged run, a corpus that cannot be fetched); a usage error
(a bad option, a missing or invalid input file or checkpoint); Ctrl-C."""


class UsageError(ValueError):
    """A bad command line, found by a command (exit status 2)."""


class Failure(Exception):
    """An expected runtime failure that a command reports (exit status 1), e.g. a library error that is not a
    ValueError or OSError."""


def one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def expected_failure(error: BaseException) -> tuple[int, str] | None:
    """(exit status, message) of an expected failure; None for anything else (a bug: shown with its traceback).
    The one place that decides what a `k3` command reports and how."""
    from safetensors import SafetensorError

    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(error, (ValueError, SafetensorError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return EXIT_USAGE, describe_error(error, limit=None)  # ValueError includes ConfigError, CheckpointError
    if isinstance(error, (OSError, Failure)):
        return EXIT_FAILURE, describe_error(error, limit=None)
    if isinstance(error, DistError):  # a torchrun peer died or timed out: this rank stops with it
        return EXIT_FAILURE, f"the distributed job failed: {describe_error(error)}"
    return None
