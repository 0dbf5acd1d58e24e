"""Run by the startup file that :mod:`colab_resilience.runs` installs before a restart.

It loads the extension into the new kernel only while a run under ``root`` is pending, and
remembers that root, so that the interrupted cell, run again, finds its run. Anything printed
here is never seen (a kernel's start-up output reaches no client): the visible work happens in
the first cell executed after the restart.
"""

from __future__ import annotations

from pathlib import Path


def load_if_pending(shell, root: str) -> bool:
    from .runs import pending_runs

    if shell is None or not pending_runs(Path(root)):
        return False
    from . import _magics_of, load_ipython_extension

    load_ipython_extension(shell)
    _magics_of(shell).run_dir = str(root)
    return True
