"""Errors that mean "bad input or configuration": the CLI prints them on one line, exit 2."""


class JourneysError(Exception):
    """A user-facing problem with input, configuration or environment (exit code 2)."""


class ConfigError(JourneysError):
    """The configuration file or an override is invalid."""


class InputError(JourneysError):
    """An input file or dataset is missing, unreadable or does not match the configuration."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, for one-line error reports."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
