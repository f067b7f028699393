"""Errors that reach the user as one line, by exit status."""


class UsageError(Exception):
    """Bad input (arguments, paths, a directory that is not a store): exit 2, nothing changed."""


class MountError(Exception):
    """A mount that cannot proceed, described in one line: exit 1."""
