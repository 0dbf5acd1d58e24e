"""What a run directory keeps: the newest checkpoints and the blobs they name, nothing a kill left.

After every save the newest ``keep`` checkpoints (and the one ``LATEST`` names) are kept; older
checkpoint folders are removed, and the blobs no kept manifest names are moved to the trash (see
:mod:`.blobs`). A checkpoint folder is removed by renaming it to ``.tmp-ckpt-gone-*`` first, so
that a kill in the middle leaves a temporary folder, never a checkpoint without its manifest.

At the start of every save, what a writer killed mid-save left (temporary checkpoint folders,
``LATEST`` and blob files) is removed: only one writer uses a run directory at a time (the run
lock), so every temporary file then is a leftover, and a run killed again and again does not fill
the disk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import CheckpointCorruptError
from ..fsutil import atomic_temp_prefix
from . import blobs, manifest
from .manifest import LATEST, MANIFEST, TEMP_PREFIX


def remove_leftovers(run_dir: Path) -> None:
    """Remove the temporary checkpoint folders, ``LATEST`` files and blobs of killed writers."""
    if not run_dir.is_dir():
        return
    blobs.remove_temporary(run_dir / blobs.BLOBS)
    for n in os.listdir(run_dir):
        if n.startswith(TEMP_PREFIX):
            shutil.rmtree(run_dir / n, ignore_errors=True)
        elif n.startswith(atomic_temp_prefix(LATEST)):  # a kill between writing LATEST and its rename
            try:
                os.unlink(run_dir / n)
            except OSError:
                pass


def collect_garbage(run_dir: Path, keep: int, keep_first: bool = False) -> None:
    """Keep the newest ``keep`` checkpoints (and what LATEST names, and with ``keep_first`` the
    oldest); trash unreferenced blobs. The trash is for the caller to empty
    (:func:`.blobs.empty_trash`)."""
    ids = manifest.checkpoint_ids(run_dir)
    kept = set(ids[:keep]) | ({ids[-1]} if keep_first and ids else set())
    latest = manifest.latest_id(run_dir)
    if latest:
        kept.add(latest)
    # A checkpoint folder without a manifest is what a removal interrupted by a kill left (a
    # new checkpoint appears whole, by one rename); checkpoint_ids() does not list it.
    for cid in [n for n in os.listdir(run_dir) if manifest.is_checkpoint_id(n)]:
        if cid not in kept:
            gone = run_dir / f"{TEMP_PREFIX}gone-{cid}"
            try:
                os.rename(run_dir / cid, gone)
            except FileNotFoundError:
                continue
            except OSError:
                gone = run_dir / cid  # e.g. an earlier .tmp-ckpt-gone- of the same id
            shutil.rmtree(gone, ignore_errors=True)
    remove_leftovers(run_dir)
    referenced: set[str] = set()
    for cid in kept:
        try:
            referenced |= manifest.read(run_dir / cid / MANIFEST).blob_hashes()
        except CheckpointCorruptError:
            continue  # a damaged manifest keeps nothing alive
    blobs.trash(run_dir / blobs.BLOBS, referenced)
