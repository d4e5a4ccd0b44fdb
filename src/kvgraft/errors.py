"""Typed errors for user mistakes. The CLI turns each into one line and exit status 2."""


class KvgraftError(Exception):
    """Base of every error kvgraft raises for bad user input."""


class CheckpointError(KvgraftError, ValueError):
    """A checkpoint directory or file is missing, corrupt, or does not match its config."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its options is not supported."""
