"""The few exception types colab_resilience raises.

Each inherits the built-in a caller would already catch, carries its facts as attributes, and
stays picklable (its ``args`` are the message only). Messages are one line: what happened, what
was kept, what to do next.
"""

from __future__ import annotations


class ResilienceError(Exception):
    """Base class of every error this package raises on purpose."""


class CheckpointError(ResilienceError):
    """A checkpoint could not be written, or none could be read."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """The run directory holds no complete checkpoint yet."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint failed verification (truncated, altered, or not a checkpoint at all)."""


class UntrustedCheckpointError(CheckpointError, PermissionError):
    """A pickled blob is not signed by this installation's key; it was not loaded."""


class UnsaveableValueError(CheckpointError, TypeError):
    """A declared variable holds a value that cannot be checkpointed (generator, open file, ...)."""

    def __init__(self, message: str, name: str = "", type_name: str = "", reason: str = ""):
        super().__init__(message)
        self.name = name
        self.type_name = type_name
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.args[0], self.name, self.type_name, self.reason))


class RunLockedError(ResilienceError, RuntimeError):
    """Another live process holds the run directory."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid

    def __reduce__(self):
        return (type(self), (self.args[0], self.pid))


class KeyPermissionError(ResilienceError, PermissionError):
    """The installation key file is readable by other users."""
