"""The one exception type users see: its message is a complete one-line explanation."""


class LladaError(Exception):
    """Bad input or a bad checkpoint; the CLI prints the message and exits non-zero."""
