"""The checkpoint store of one run directory: save, load, and keep the folder tidy.

A save (:meth:`CheckpointStore.save`) prepares every value (:mod:`.values`), has the pool
fingerprint and hash each one's chunks while the next is prepared (:mod:`.hashing`), writes the
blobs the folder lacks (:mod:`.blobs`), then writes the signed manifest (:mod:`.manifest`) into
``.tmp-ckpt-*/``, renames that folder to ``ckpt-NNNNNN/`` and replaces ``LATEST``. Old
checkpoints and the blobs only they named are removed afterwards; what a killed writer left is
removed at the start of the next save. A load (:meth:`CheckpointStore.load`) verifies the newest
checkpoint whole, and falls back to older ones with a warning each.

One process writes a run directory at a time (the run lock); any number may read it.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from .. import signing
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWarning,
    MissingNameError,
    NoCheckpointError,
    NotPlainError,
    UnsaveableValueError,
    UntrustedCheckpointError,
)
from ..fsutil import atomic_write, make_private_dir
from . import blobs, cleanup, codec, hashing, manifest, values
from .hashing import HashJob
from .manifest import LATEST, MANIFEST, Manifest, ManifestFile
from .restore import Checkpoint, LoadedBlob
from .commit import Commit, Snapshot
from .rng import capture_rng
from .staging import Staging

RNG_NAME = "__rng__"


@dataclass
class SaveReport:
    """What one :meth:`CheckpointStore.save` did."""

    checkpoint_id: str
    names: list[str]
    skipped: dict[str, str]  # name -> one-line message
    bytes_written: int
    bytes_reused: int
    seconds: float
    # bytes of the saved values read to fingerprint or hash them (a byte both counts twice)
    bytes_read: int = 0
    meta: dict = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    stall: float = 0.0  # seconds training waited for the snapshot (all of ``seconds`` when synchronous)
    staged: int = 0  # bytes copied aside and written after training went on
    written_through: int = 0  # bytes written from live memory while training waited

    def summary(self) -> str:
        mib = 1 << 20
        line = (
            f"colab_resilience: saved {', '.join(self.names) or 'nothing'} as {self.checkpoint_id} "
            f"({self.bytes_written / mib:.1f} MiB written, {self.bytes_reused / mib:.1f} MiB "
            f"unchanged, {self.seconds:.2f} s)"
        )
        if self.skipped:
            line += f"; not saved: {', '.join(self.skipped)}"
        return line


class CheckpointStore:
    """The checkpoints of one run directory. One process writes at a time (hold a ``RunLock``)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        key: bytes | None = None,
        keep: int = 2,
        keep_first: bool = False,
        run_id: str | None = None,
    ):
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.run_dir = Path(run_dir)
        # signed into every manifest; a manifest of another run (copied in) is not loaded
        self.run_id = run_id
        self.keep = keep
        # the oldest checkpoint is kept too (a run that saves no values goes back to its start)
        self.keep_first = keep_first
        self._key = key
        self._trash: Future | None = None
        # per saved blob: (fingerprint, digest) of each chunk as this process last saved it (no
        # fingerprint for a chunk found changed: see hashing.digest_unless_unchanged)
        self._chunk_memory: dict[str, list[tuple[bytes | None, bytes]]] = {}

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = signing.load_or_create_key()
        return self._key

    @property
    def blob_dir(self) -> Path:
        return self.run_dir / blobs.BLOBS

    def checkpoint_ids(self) -> list[str]:
        """Complete checkpoints on disk, newest first (damaged ones included)."""
        return manifest.checkpoint_ids(self.run_dir)

    def latest_id(self) -> str | None:
        """The id ``LATEST`` points to (or the newest complete checkpoint); None if there is none."""
        return manifest.latest_id(self.run_dir)

    def latest_names(self) -> list[str]:
        """The names the newest checkpoint holds, from its manifest alone (nothing is verified or
        loaded: for a message or a check that a load does again); [] if there is none or it is
        unreadable."""
        cid = self.latest_id()
        if cid is None:
            return []
        try:
            return [e.name for e in Manifest.from_body(manifest.read(self.run_dir / cid / MANIFEST).body, cid).entries]
        except (CheckpointCorruptError, ValueError, TypeError):
            return []

    def latest_meta(self) -> dict:
        """The ``meta`` of the newest checkpoint, from its manifest alone where this installation
        signed it (no value is loaded); {} if there is none, or it is unreadable or not signed here.
        For what a message says of a checkpoint that the journal may not have recorded yet (a kill
        between ``LATEST`` and the journal's write)."""
        cid = self.latest_id()
        if cid is None:
            return {}
        try:
            doc = manifest.read(self.run_dir / cid / MANIFEST)
            if not doc.verify(self.key):
                return {}
            meta = codec.decode(Manifest.from_body(doc.body, cid).meta, [])
        except (CheckpointCorruptError, ValueError, TypeError, KeyError, RecursionError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def _next_id(self) -> str:
        return manifest.next_id(self.run_dir)

    # -- saving --

    def save(
        self, namespace: Mapping[str, Any], names: Sequence[str], *, meta: dict | None = None,
        strict: bool = False,
    ) -> SaveReport:
        """Checkpoint ``names`` from ``namespace`` (with the RNG states); see the package docstring.

        Raises :class:`MissingNameError` (nothing written) if a name is not defined, and
        :class:`CheckpointError` if the checkpoint could not be written (the previous one stays).
        A value that cannot be saved is left out and listed in the report, or with ``strict``
        raises its :class:`UnsaveableValueError` before anything is written.
        """
        return self.persist(self.snapshot(namespace, names, meta=meta, strict=strict))

    def snapshot(
        self, namespace: Mapping[str, Any], names: Sequence[str], *, meta: dict | None = None,
        strict: bool = False, staging: Staging | None = None, whole: Collection[str] = (),
    ) -> Snapshot:
        """The first half of a save, taken while training waits: every value prepared, the RNG
        states captured, the live bytes copied into ``staging`` where they fit, and the values
        that do not fit written through (their files flushed later). What is left
        (:meth:`persist`) reads nothing the training may write, and may run on another thread;
        one persist at a time per store. ``whole``: modules saved whole, not by their state dict
        (see :func:`.values.prepare`). Raises what :meth:`save` raises."""
        start = time.perf_counter()
        if isinstance(names, str):
            names = [names]
        names = list(dict.fromkeys(names))
        for name in names:
            if name not in namespace:
                raise MissingNameError(values.missing_name_message(name, namespace, "save"), name)
        rng = capture_rng()
        meta_enc: Any = None
        if meta is not None:
            try:
                meta_enc = codec.Encoder(leaves=False).encode(dict(meta))
            except (NotPlainError, RecursionError):
                raise CheckpointError(
                    "colab_resilience: checkpoint meta must hold plain values (numbers, strings, "
                    "lists, dicts); nothing was written"
                ) from None
        skipped: dict[str, str] = {}
        prepared: list[values.Prepared] = []
        pool = hashing.pool()
        snap = Snapshot(prepared, skipped, meta, meta_enc, start)
        # without staging the pool hashes each value while the next one is prepared; with it,
        # only once its bytes are copied
        hashing_now: dict[int, HashJob] = {}
        device_copy = staging.device_copy if staging is not None else None
        if staging is not None:
            staging.begin()
        shared = values.Shared(namespace, names)
        try:
            try:
                for name in names:
                    try:
                        p = values.prepare(name, namespace[name], device_copy, shared, whole=name in whole)
                        values.no_cycle(p, prepared, namespace)
                    except UnsaveableValueError as e:
                        if strict:
                            raise
                        skipped[name] = str(e)
                        continue
                    prepared.append(p)
                    if staging is None:
                        hashing_now[len(prepared) - 1] = self._hash_job(prepared[-1], pool)
            finally:
                if staging is not None:
                    staging.device_copies_done()
            prepared.append(values.encode(RNG_NAME, "rng", "dict", rng))
            payloads = [p.payload for p in prepared]
            staged = staging.stage(payloads, pool) if staging is not None else [not p.live_bytes for p in payloads]
            jobs = [hashing_now.pop(i, None) or self._hash_job(p, pool) for i, p in enumerate(prepared)]
            snap.later = [(i, p, jobs[i]) for i, p in enumerate(prepared) if staged[i]]
            snap.staged = sum(p.payload.size for i, p in enumerate(prepared) if staged[i])
            # the values that did not fit are written from their own memory now; the rest is
            # hashed and written while training goes on. A synchronous save writes directly (it
            # waits for the flush anyway); one in the background writes these through the page
            # cache, so training goes on before the device has them
            for i, p in enumerate(prepared):
                if not staged[i]:
                    if snap.commit is None:
                        snap.commit = self._begin_commit(pool)
                    snap.commit.write(i, p, jobs[i], direct=staging is None)
                    snap.written_through += p.payload.size
        except OSError as e:
            snap.abandon(hashing_now.values())
            raise self._failed(e, snap.commit.previous if snap.commit else None) from e
        except BaseException:
            snap.abandon(hashing_now.values())
            raise
        snap.stall = time.perf_counter() - start
        return snap

    def persist(self, snap: Snapshot) -> SaveReport:
        """The second half of a save: hash and write what the snapshot holds, flush, commit
        (``LATEST`` names the checkpoint once every file of it is on disk). Raises
        :class:`CheckpointError` when it cannot be written (the previous checkpoint stays)."""
        try:
            if snap.commit is None:
                snap.commit = self._begin_commit(hashing.pool())
            for i, p, job in snap.later:
                snap.commit.write(i, p, job)
            checkpoint_id, written, reused = snap.commit.finish(snap)
        except OSError as e:
            snap.abandon()
            raise self._failed(e, snap.commit.previous if snap.commit else self.latest_id()) from e
        except BaseException:
            snap.abandon()
            raise
        snap.release()
        try:
            self._collect_garbage()
        except OSError as e:
            warnings.warn(
                f"colab_resilience: could not remove old checkpoints in {self.run_dir} ({e.strerror or e})",
                CheckpointWarning,
                stacklevel=3,
            )
        saved = snap.prepared[:-1]
        return SaveReport(
            checkpoint_id=checkpoint_id,
            names=[p.name for p in saved],
            skipped=snap.skipped,
            bytes_written=written,
            bytes_reused=reused,
            bytes_read=snap.bytes_read,
            seconds=time.perf_counter() - snap.start,
            meta=dict(snap.meta or {}),
            kinds={p.name: p.kind for p in saved},
            stall=snap.stall,
            staged=snap.staged,
            written_through=snap.written_through,
        )

    def _hash_job(self, p: values.Prepared, pool: Executor) -> HashJob:
        """Have the pool fingerprint ``p``'s chunks, and hash those that changed since the last save."""
        return HashJob(p.payload.segments, pool, self._chunk_memory, f"{p.name}\0{p.kind}\0{p.format}")

    def _begin_commit(self, pool: Executor) -> Commit:
        previous = self.latest_id()
        try:
            make_private_dir(self.run_dir)
            make_private_dir(self.blob_dir)
            cleanup.remove_leftovers(self.run_dir)
            self._empty_trash()  # what a killed writer trashed but did not unlink yet, meanwhile
        except OSError as e:
            raise self._failed(e, previous) from e
        return Commit(self, previous, pool)

    def _failed(self, e: OSError, previous: str | None) -> CheckpointError:
        """The one-line error of a save that could not be written; what it left is cleaned up."""
        self._chunk_memory.clear()
        try:
            self._collect_garbage()
        except OSError:
            pass
        kept = f"checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
        where = e.filename or self.run_dir
        return CheckpointError(f"colab_resilience: checkpoint not written to {where} ({e.strerror or e}); {kept}")

    # -- housekeeping --

    def _collect_garbage(self) -> None:
        cleanup.collect_garbage(self.run_dir, self.keep, self.keep_first)
        self._empty_trash()

    def wait(self) -> None:
        """Wait until the blobs removed by the last save are unlinked (background work)."""
        if self._trash is not None:
            self._trash.result()

    def _empty_trash(self) -> None:
        """Unlink the trashed blobs in the background (on the pool): freeing a large file takes a
        file system a while, which a training loop should not wait for at every safe point. What
        a kernel leaving for a restart leaves behind is emptied after the next save."""
        if self._trash is not None and not self._trash.done():
            return
        self._trash = hashing.pool().submit(blobs.empty_trash, self.blob_dir)

    def clear(self) -> None:
        """Remove every checkpoint and blob of this run (``%resilience reset``)."""
        for cid in self.checkpoint_ids():
            shutil.rmtree(self.run_dir / cid, ignore_errors=True)
        shutil.rmtree(self.blob_dir, ignore_errors=True)
        try:
            os.unlink(self.run_dir / LATEST)
        except FileNotFoundError:
            pass
        cleanup.remove_leftovers(self.run_dir)
        self._chunk_memory.clear()

    def adopt(self, run_id: str | None = None) -> list[str]:
        """Re-sign every well-formed checkpoint manifest with this installation's key; return their
        ids. For a run the user vouched for (``%resilience resume --trust``, ``colab-resilience
        resume --trust``) after it was written under another key; with ``run_id``, the manifests that name
        a run name that one (the run goes on under the id this key gives its cell). Blob hashes are
        still verified by every load."""
        adopted = []
        for cid in self.checkpoint_ids():
            path = self.run_dir / cid / MANIFEST
            try:
                doc = manifest.read(path)
                body = doc.body
                if run_id is not None and body.get("run_id", run_id) != run_id:
                    body = {**body, "run_id": run_id}
                if body is doc.body and doc.verify(self.key):
                    continue
                data = ManifestFile.sign(body, self.key).to_bytes()
            except (OSError, ValueError, TypeError, RecursionError):  # CheckpointCorruptError too
                continue  # unreadable: loading will skip it as damaged
            atomic_write(path, data)
            adopted.append(cid)
        return adopted

    # -- loading --

    def load(self, *, trust: bool = False, oldest: bool = False) -> Checkpoint:
        """The newest checkpoint that verifies; older ones are tried after a warning. With
        ``oldest``, only the oldest one (kept with ``keep_first``).

        Raises :class:`NoCheckpointError` when none is loadable, or
        :class:`UntrustedCheckpointError` when the only loadable ones are not signed by this
        installation (pass ``trust=True`` to load them anyway).
        """
        ids = self.checkpoint_ids()
        latest = self.latest_id()
        if oldest:
            ids = ids[-1:]
        elif latest in ids:
            ids.remove(latest)
            ids.insert(0, latest)
        if not ids:
            raise NoCheckpointError(f"colab_resilience: no checkpoint in {self.run_dir} yet; nothing to restore")
        untrusted: list[str] = []
        reasons: list[str] = []
        for i, cid in enumerate(ids):
            then = "trying the previous one" if i + 1 < len(ids) else "no older checkpoint is left"
            try:
                return self._load_one(cid, trust)
            except UntrustedCheckpointError as e:
                untrusted.append(cid)
                reasons.append(f"{cid}: not signed here")
                warnings.warn(f"{e}; {then}", CheckpointWarning, stacklevel=2)
            except CheckpointCorruptError as e:
                reasons.append(f"{cid}: {e.args[0]}")
                warnings.warn(
                    f"colab_resilience: checkpoint {cid} is damaged ({e.args[0]}); {then}",
                    CheckpointWarning,
                    stacklevel=2,
                )
        if untrusted:
            raise UntrustedCheckpointError(
                f"colab_resilience: checkpoint {untrusted[0]} in {self.run_dir} was not signed by "
                f"this installation's key ({signing.key_path()}); if you wrote it yourself (another "
                "machine, a lost key), load it with trust=True (`%resilience resume --trust`)"
            )
        raise NoCheckpointError(
            f"colab_resilience: no loadable checkpoint in {self.run_dir} ({'; '.join(reasons)})"
        )

    def _load_one(self, cid: str, trust: bool) -> Checkpoint:
        """Checkpoint ``cid``, every blob verified; CheckpointCorruptError or UntrustedCheckpointError."""
        doc = manifest.read(self.run_dir / cid / MANIFEST)
        try:
            signed = doc.verify(self.key)
        except (OSError, ValueError, TypeError, RecursionError) as e:  # an unreadable key, too
            raise CheckpointCorruptError(f"manifest unreadable: {values.first_line(e)}") from None
        if not signed and not trust:
            raise UntrustedCheckpointError(
                f"colab_resilience: checkpoint {cid} is not signed by this installation's key "
                "(written elsewhere, or edited); load(trust=True) would accept it"
            )
        m = Manifest.from_body(doc.body, cid, self.run_id)
        try:
            meta = codec.decode(m.meta, [])
            pool = hashing.pool()
            loaded = {e.name: LoadedBlob(self.blob_dir, e).read(pool) for e in m.entries}
            rng = LoadedBlob(self.blob_dir, m.rng).read(pool)
        except CheckpointCorruptError:
            raise
        except (OSError, *codec.MALFORMED) as e:
            raise CheckpointCorruptError(values.first_line(e)) from None
        return Checkpoint(self, m, loaded, rng, meta)
