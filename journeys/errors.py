"""Errors that mean "bad input or configuration": the CLI prints them on one line, exit 2."""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a scheduler's stop, Ctrl+C: `Interrupted`


class JourneysError(Exception):
    """A user-facing problem with input, configuration or environment (exit code 2)."""


class ConfigError(JourneysError):
    """The configuration file or an override is invalid."""


class InputError(JourneysError):
    """An input file or dataset is missing, unreadable or does not match the configuration."""


class Interrupted(BaseException):
    """The command was stopped by a signal (SIGTERM, or SIGINT from Ctrl+C).

    A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it; the
    command line exits with 128 + the signal's number (143, 130).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def run_status(err: BaseException) -> str:
    """The MLflow run status for a run that ended with `err`: KILLED when stopped."""
    return "KILLED" if isinstance(err, Interrupted | KeyboardInterrupt) else "FAILED"


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, for one-line error reports."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
