"""The notebook's own Python modules, by the digest of their files.

A set-up cell that imports code from a file beside the notebook (``from model import Net``, a
``utils.py`` of a cloned repository on ``sys.path``) makes what the run trains with from that
file, and the notebook's fingerprints of its functions do not see it (they are the notebook's
code, ``__main__``'s, only). Edited between a death and the resume (a fix, a ``git pull``), the
replay imports the new code and the resumed run trains on with it, after epochs that ran on the
old: the result is that of neither run uninterrupted. A run records the files of the modules
imported as it begins, and of those imported since at each checkpoint (:func:`local_modules`: a
cell's own ``from steps import train_step``); a kernel that resumes it after a restart compares
them on disk (:func:`changed`) and says in one line which changed (:func:`message`), as it does
for a set-up cell edited since the run began.

A module of the notebook is one whose file is Python source outside the standard library and
the installed packages (:func:`.standby.installed_roots`, and any ``site-packages`` or
``dist-packages`` folder), and not this package. Files are read, never executed.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from contextlib import suppress
from typing import Mapping

from .standby import installed_roots

MODULES = 200  # the most files a run records: a notebook's own modules are a handful
MAX_BYTES = 16 << 20  # a larger file is no module of a notebook's; it is left out


def local_modules() -> dict[str, str]:
    """The imported modules of the notebook (see the module's text): their files' real paths and
    the SHA-256 of each file's bytes."""
    roots = (*installed_roots(), os.path.join(os.path.dirname(os.path.realpath(__file__)), ""))  # and this package
    found: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name == "__main__" or not isinstance(path, str) or not path.endswith(".py"):
            continue
        if _library(path, roots):  # most are, by the path they were imported by: no realpath to take
            continue
        real = os.path.realpath(path)
        if _library(real, roots) or real in found:
            continue
        digest = file_digest(real)
        if digest is not None:
            found[real] = digest
            if len(found) >= MODULES:
                break
    return found


def _library(path: str, roots: tuple[str, ...]) -> bool:
    parts = path.split(os.sep)
    return path.startswith(roots) or "site-packages" in parts or "dist-packages" in parts


def file_digest(path: str) -> str | None:
    """The SHA-256 of the regular file ``path``; None where it is not one, cannot be read, or is
    larger than :data:`MAX_BYTES`."""
    try:  # without blocking on a FIFO put in a module's place
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    return hashlib.sha256(data).hexdigest() if len(data) <= MAX_BYTES else None


def changed(recorded: Mapping[str, str]) -> list[str]:
    """Of the files ``recorded`` (:func:`local_modules`, as the run recorded them), those whose
    bytes differ now (one that is gone is not: the import fails, saying so)."""
    return sorted(p for p, digest in recorded.items() if (now := file_digest(p)) is not None and now != digest)


def message(run_id: str, paths: list[str]) -> str:
    """The line a resume says of the notebook's module files edited since the run began."""
    def shown(path: str) -> str:
        with suppress(ValueError):  # another drive
            relative = os.path.relpath(path)
            if not relative.startswith(os.pardir):
                return relative
        return path

    files = ", ".join(map(shown, paths[:4])) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    it = "it" if len(paths) == 1 else "them"
    return (f"colab_resilience: {files} changed on disk since run {run_id} began: the resumed run goes on with "
            f"the code now in {it}, so what it did before ran on the old code and the result is not that of either "
            f"run uninterrupted; to start over, %resilience reset {run_id} and run this cell again")
