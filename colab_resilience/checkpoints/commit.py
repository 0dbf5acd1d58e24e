"""A save between its two halves: :class:`Snapshot` (what :meth:`CheckpointStore.snapshot` took
while training waited) and :class:`Commit` (its blobs being written, then the manifest and
``LATEST``, by :meth:`CheckpointStore.persist`)."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Executor, wait
from typing import TYPE_CHECKING, Any, Iterable

from ..fsutil import fsync_dir, private_temp_dir, write_new
from . import blobs, manifest, values
from .hashing import HashJob
from .manifest import MANIFEST, TEMP_PREFIX, Entry, Manifest, ManifestFile

if TYPE_CHECKING:
    from .store import CheckpointStore


class Snapshot:
    """A save between its two halves (:meth:`CheckpointStore.snapshot`, :meth:`CheckpointStore.persist`):
    the prepared values (their live bytes staged), the hash jobs started, the blobs written
    through during the stall."""

    def __init__(self, prepared: list[values.Prepared], skipped: dict[str, str], meta: dict | None,
                 meta_enc: Any, start: float):
        self.prepared, self.skipped = prepared, skipped
        self.meta, self.meta_enc, self.start = meta, meta_enc, start
        self.commit: Commit | None = None
        self.later: list[tuple[int, values.Prepared, HashJob]] = []
        self.stall = 0.0  # seconds the snapshot kept training waiting
        self.staged = 0  # bytes of the payloads left to the persist
        self.written_through = 0  # bytes written from live memory during the stall

    def _jobs(self) -> list[HashJob]:
        return ([] if self.commit is None else self.commit.jobs) + [job for _, _, job in self.later]

    @property
    def bytes_read(self) -> int:
        return sum(job.bytes_read for job in self._jobs())

    def abandon(self, started: Iterable[HashJob] = ()) -> None:
        """After an error: nothing of this save (nor the hash jobs ``started`` for it) left
        queued or running on the pool, no descriptor or temporary file left open."""
        futures = [f for job in [*self._jobs(), *started] for f in job.futures]
        for f in futures:
            f.cancel()
        wait(futures)
        if self.commit is not None:
            self.commit.pending.__exit__(None, None, None)
        self.release()

    def release(self) -> None:
        """Drop the payloads (the staged copies stay in the staging arena, for the next save)."""
        self.later = []
        for p in self.prepared:
            p.payload.segments, p.payload.keep = [], []


class Commit:
    """The blobs of one save being written, then the manifest and ``LATEST``."""

    def __init__(self, store: CheckpointStore, previous: str | None, pool: Executor):
        self.store, self.previous = store, previous
        self.pending = blobs.PendingBlobs(pool)
        self.entries: dict[int, Entry] = {}
        self.jobs: list[HashJob] = []
        self.written = self.reused = 0

    def write(self, index: int, p: values.Prepared, job: HashJob, *, direct: bool = True) -> None:
        """Write ``p``'s blob (``direct``: with ``O_DIRECT`` where it can be, see :mod:`.blobs`)."""
        self.jobs.append(job)
        blob_hash, was_written = blobs.write(
            self.store.blob_dir, job.chunks, job.digests(), job.previous, p.payload.size, self.pending,
            direct=direct,
        )
        self.written += p.payload.size if was_written else 0
        self.reused += 0 if was_written else p.payload.size
        self.entries[index] = Entry(p.name, p.kind, p.type_name, p.format, blob_hash, p.payload.size)

    def finish(self, snap: Snapshot) -> tuple[str, int, int]:
        """Flush and rename the blobs, write the manifest, point ``LATEST`` at it: (id, bytes
        written, bytes reused)."""
        store = self.store
        self.pending.commit()
        fsync_dir(store.blob_dir)
        entries = [self.entries[i] for i in sorted(self.entries)]
        checkpoint_id = store._next_id()
        body = Manifest(checkpoint_id, entries[:-1], entries[-1], meta=snap.meta_enc, skipped=snap.skipped,
                        run_id=store.run_id).to_body()
        data = ManifestFile.sign(body, store.key).to_bytes()
        tmp_dir = private_temp_dir(store.run_dir, TEMP_PREFIX)
        try:
            write_new(tmp_dir / MANIFEST, data)
            fsync_dir(tmp_dir)
            os.rename(tmp_dir, store.run_dir / checkpoint_id)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        fsync_dir(store.run_dir)
        manifest.write_latest(store.run_dir, checkpoint_id)
        return checkpoint_id, self.written + len(data), self.reused
