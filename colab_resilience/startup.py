"""Run by the startup file that :mod:`colab_resilience.restart` installs while a run is pending.

It loads the extension into the new kernel only while a run under ``root`` is pending, and
remembers that root, so that the interrupted cell, run again, finds its run. Anything printed
here is never seen (a kernel's start-up output reaches no client): the visible work happens in
the first cell executed after the restart.
"""

from __future__ import annotations

from pathlib import Path


def load_if_pending(shell, root: str) -> bool:
    """Not in a kernel a supervisor started (``colab-resilience run``, an isolated worker), which
    may share the profile: it loads the extension itself, with the run directory it was given."""
    from .journal import pending_runs
    from .restart import supervised

    if shell is None or supervised() or not pending_runs(Path(root)):
        return False
    from . import load_ipython_extension
    from .session import session_of

    load_ipython_extension(shell)
    session_of(shell).settings.run_dir = str(root)
    return True
