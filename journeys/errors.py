"""Errors that mean "bad input or configuration": the CLI prints them on one line, exit 2."""


class JourneysError(Exception):
    """A user-facing problem with input, configuration or environment (exit code 2)."""


class ConfigError(JourneysError):
    """The configuration file or an override is invalid."""


class InputError(JourneysError):
    """An input file or dataset is missing, unreadable or does not match the configuration."""
