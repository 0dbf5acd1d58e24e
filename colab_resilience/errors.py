"""Every exception and warning type colab_resilience raises.

Each error inherits :class:`ResilienceError` and the built-in a caller would already catch
(``except FileNotFoundError`` still catches :class:`NoCheckpointError`), carries its facts as
attributes, and stays picklable (its ``args`` are the message only). Messages are one line: what
happened, what was kept, what to do next.
"""

from __future__ import annotations


class ResilienceError(Exception):
    """Base class of every error this package raises on purpose."""


# -- checkpoints -------------------------------------------------------------------------------------


class CheckpointError(ResilienceError):
    """A checkpoint could not be written, or none could be read."""


class BuiltSinceError(CheckpointError):
    """An object that was not built at the safe point (a Keras model before its first call, an
    optimizer before its first step) is built now: no saved state takes it back to unbuilt. A
    retry in the kernel cannot repeat its build; a restarted kernel's set-up cells make it afresh."""


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


class MissingNameError(CheckpointError, KeyError):
    """A name to save is not in the namespace (or a name to restore not in the checkpoint)."""

    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.name = name

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])

    def __reduce__(self):
        return (type(self), (self.args[0], self.name))


class NotPlainError(ResilienceError, TypeError):
    """A value is not plain data that tagged JSON can hold; the checkpoint pickles it instead."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or a value restored differently than saved (one line each)."""


# -- the installation key ----------------------------------------------------------------------------


class KeyPermissionError(ResilienceError, PermissionError):
    """The installation key file is readable by other users."""


class KeyFileError(ResilienceError, ValueError):
    """The key file exists but is not a key this package wrote (wrong size, not a file)."""


# -- runs and their journals -------------------------------------------------------------------------


class RunLockedError(ResilienceError, RuntimeError):
    """Another live process holds the run directory."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid

    def __reduce__(self):
        return (type(self), (self.args[0], self.pid))


class JournalError(ResilienceError, ValueError):
    """The journal file is damaged, foreign, or from a newer version of this package."""


class JournalUntrustedError(JournalError):
    """The journal is well formed but not signed by this installation's key (another machine, a
    new Colab VM, a lost key, or an edit): its replay cells are not executed unless trusted."""


class UnsafeDirectoryError(ResilienceError, PermissionError):
    """A run root or run folder another user could control: a symbolic link, a folder owned by
    someone else or writable by others, or a pseudo-filesystem such as ``/proc``; or one that
    cannot be made (a file in its path, no permission). Nothing is written there."""


class JournalRolledBackError(JournalError):
    """A signed journal that is not its folder's (moved from another run) or older than the newest
    this installation signed for that folder (an old copy put back): nothing in it runs."""


class JournalNotFoundError(ResilienceError, FileNotFoundError):
    """The run directory has no journal."""


class RunStoppedError(ResilienceError, RuntimeError):
    """A run cannot go on: its restart budget is spent, its journal is unusable, or this IPython
    cannot be restarted. The message says which, and what to do."""


class RetryNotExactError(ResilienceError, RuntimeError):
    """An in-process retry cannot repeat what the failed attempt did: a ``resume_range`` loop goes
    on over an iterator an earlier attempt drew from (made outside the cell), whose items up to
    the safe point are gone. The run goes on in a restarted kernel instead, where the set-up cells
    make the iterator afresh. ``label``: the reason, in a few words."""

    def __init__(self, message: str, label: str):
        super().__init__(message)
        self.label = label

    def __reduce__(self):
        return (type(self), (self.args[0], self.label))


class NotLoadedError(ResilienceError, RuntimeError):
    """The extension is not loaded in this IPython (``%load_ext colab_resilience``)."""


class UnsafeCheckpointError(ResilienceError, RuntimeError):
    """``checkpoint()`` was called where a resumed run could not continue exactly."""


class OptionError(ResilienceError, ValueError):
    """A magic's option does not fit the notebook (an unknown variable, a shrink that is not an
    integer); shown to the user as a usage error."""


# -- supervised execution ----------------------------------------------------------------------------


class NotebookInputError(ResilienceError, ValueError):
    """The notebook, a parameter or the kernel name is unusable (exit code 2)."""
