"""Errors whose message is meant for the user, not for a traceback."""


class UserError(Exception):
    """Bad input: the CLI prints the message once (rank 0) and exits non-zero."""


class ConfigError(UserError, ValueError):
    """A model, batch or world size that does not fit the chosen layout."""
