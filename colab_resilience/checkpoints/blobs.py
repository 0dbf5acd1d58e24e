"""Blob files: ``blobs/<hash>``, written durably, read back verified, shared by the manifests.

A blob's file name is its hash, so a blob already in the folder is never written again, and
checkpoints share blobs by naming them (not by hard links: Google Drive mounts, where Colab users
keep checkpoints, have none). One damaged shared blob therefore damages every checkpoint naming
it; a blob found damaged is set aside (``<hash>.damaged``) so the next save writes it afresh.

Writing (:func:`write`): a blob goes to ``.tmp-*`` from its first chunk that differs from the last
save, and stays there, in :class:`PendingBlobs`, until every blob of the save is written. Each is
``fsync``-ed and closed on the pool as soon as it is written (the disk writes one back while the
next is written, and a save of many names does not keep a descriptor per blob); once all are
flushed they are renamed to their hashes. Every error path closes every descriptor and removes
every temporary file: a failed save (a full disk) holds no space afterwards.

Blobs of ``DIRECT_AT_LEAST`` bytes or more are written with ``O_DIRECT`` where the folder's file
system takes it (probed once per device, :func:`direct_io`), through a ``BOUNCE``-byte aligned
buffer reused from save to save (:class:`BlobFile`); the last block is padded, then the file is
truncated to the blob's size. Written through the page cache, every byte of a checkpoint is copied
into page-cache pages the kernel must first find: on a VM that hands free memory back to its host
(free page reporting, as on this project's test machines) that cost 1.2 s of kernel time per
577 MiB written, on the core training needed (``benchmarks/background_save.py``); and the
checkpoint evicts whatever the page cache held (the training's data). A direct write costs a copy
into the bounce buffer and waits on the device instead. Writes made while training waits for
them but does not wait for their flush (a background save's values that did not fit in staging
memory) stay buffered: there the page cache lets training go on before the device has the bytes.

Reading (:func:`read`): every byte is hashed before a blob is used. Safetensors blobs of
``MAP_AT_LEAST`` bytes or more are mapped (private, copy-on-write) rather than read: the hash reads
the page cache in place, and the restore copies each byte once. Pickles and small blobs are read,
each chunk by one worker.

Blobs no kept checkpoint names are renamed ``.trash-<hash>`` (no later save can reuse them) and
unlinked in the background (:func:`trash`, :func:`empty_trash`).
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from collections import deque
from concurrent.futures import Executor, Future, wait
from pathlib import Path
from typing import Iterable

from ..errors import CheckpointCorruptError
from ..fsutil import O_CLOEXEC, write_all
from .hashing import CHUNK, combine, digest

BLOBS = "blobs"  # the folder, inside the run directory
TEMP = ".tmp-"
TRASH = ".trash-"  # blobs no kept checkpoint names, renamed on the way to being unlinked
MAP_AT_LEAST = 4 << 20  # smaller safetensors blobs are read: mapping costs more than it saves
MAX_OPEN = 64  # written blobs whose flush (and descriptor) may be outstanding at once
DIRECT_IO = True  # write large blobs with O_DIRECT where the file system takes it (off: benchmarks)
DIRECT_AT_LEAST = 1 << 20  # smaller blobs are written through the page cache
BOUNCE = 4 << 20  # the aligned buffer a direct write copies through
ALIGN = 4096  # offset, length and address alignment O_DIRECT may require (the page size covers all)
O_DIRECT = getattr(os, "O_DIRECT", 0)

_direct_lock = threading.Lock()
_direct_ok: dict[int, bool] = {}  # st_dev -> whether O_DIRECT writes work there
_bounces: list = []  # free bounce buffers (NumPy views of anonymous mappings), kept for the next save


def direct_io(folder: Path) -> bool:
    """Whether blobs in ``folder`` can be written with ``O_DIRECT``: probed once per device by
    writing one aligned block to a temporary file there (file systems that refuse the flag, such
    as tmpfs before Linux 6.6 and some FUSE mounts, answer no)."""
    if not (DIRECT_IO and O_DIRECT):
        return False
    dev = os.stat(folder).st_dev
    with _direct_lock:
        known = _direct_ok.get(dev)
    if known is not None:
        return known
    tmp = str(folder / f"{TEMP}{secrets.token_hex(8)}")
    ok = False
    block = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_DIRECT, 0o600)
        try:
            ok = os.write(fd, block) == ALIGN
            os.ftruncate(fd, 1)
        finally:
            os.close(fd)
    except OSError:
        ok = False
    finally:
        block.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass
    with _direct_lock:
        _direct_ok[dev] = ok
    return ok


def _take_bounce():
    import numpy as np

    with _direct_lock:
        if _bounces:
            return _bounces.pop()
    return np.frombuffer(mmap.mmap(-1, BOUNCE), dtype=np.uint8)  # page-aligned


def _give_back_bounce(buf) -> None:
    with _direct_lock:
        _bounces.append(buf)


class BlobFile:
    """One blob file being written: straight to its descriptor, or (``direct``, an ``O_DIRECT``
    descriptor) through an aligned bounce buffer, whole blocks at a time; :meth:`finish` writes
    the padded last block and truncates the file to the bytes written."""

    __slots__ = ("fd", "bounce", "fill", "size")

    def __init__(self, fd: int, direct: bool):
        self.fd, self.fill, self.size = fd, 0, 0
        self.bounce = _take_bounce() if direct else None

    def write(self, data) -> None:
        if self.bounce is None:
            write_all(self.fd, data)
            return
        import numpy as np

        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        pos = 0
        while pos < src.size:
            take = min(BOUNCE - self.fill, src.size - pos)
            np.copyto(self.bounce[self.fill : self.fill + take], src[pos : pos + take])  # releases the GIL
            self.fill += take
            pos += take
            if self.fill == BOUNCE:
                write_all(self.fd, memoryview(self.bounce))
                self.size += self.fill
                self.fill = 0

    def finish(self) -> None:
        """Write what the bounce buffer holds (padded to a whole block), then cut the padding."""
        if self.bounce is None:
            return
        if self.fill:
            padded = -(-self.fill // ALIGN) * ALIGN
            self.bounce[self.fill : padded] = 0
            write_all(self.fd, memoryview(self.bounce)[:padded])
            self.size += self.fill
            self.fill = 0
            os.ftruncate(self.fd, self.size)
        self.release()

    def release(self) -> None:
        """Give the bounce buffer back (for the next blob), whatever became of this one."""
        bounce, self.bounce = self.bounce, None
        if bounce is not None:
            _give_back_bounce(bounce)


class _Pending:
    """One temporary blob file: its path, its descriptor, and the worker flushing it."""

    __slots__ = ("tmp", "fd", "file", "final", "flushing")

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.fd = -1
        self.file: BlobFile | None = None
        self.final: Path | None = None
        self.flushing: Future | None = None  # owns (and closes) ``fd`` once submitted


class PendingBlobs:
    """The temporary blob files of one save: each flushed and closed as soon as it is written,
    renamed into place together at the commit.

    Every descriptor and temporary file is this object's from the moment the file is created
    (:meth:`create`). A written blob (:meth:`written`) is fsync-ed and closed on the pool while
    the next one is written, so at most ``MAX_OPEN`` blob files are open at once, however many
    names a save holds (each kept until the commit, 34,000 small blobs ran out of descriptors).
    :meth:`commit` waits for those flushes, then renames each blob to its hash. Leaving the
    ``with`` block without a commit (an error, a full disk, Ctrl-C) closes every descriptor and
    removes every temporary file that is left: a failed save holds no disk space afterwards.
    """

    def __init__(self, pool: Executor):
        self._pool = pool
        self._writing: _Pending | None = None  # created, being written
        self._items: deque[_Pending] = deque()  # written: flushing or flushed, to be renamed
        self._unflushed: deque[_Pending] = deque()  # those whose flush may still hold a descriptor

    def create(self, folder: Path, direct: bool = False) -> BlobFile:
        """A new temporary blob file in ``folder``, open for writing (the one being written);
        ``direct``: with ``O_DIRECT`` (the caller checked :func:`direct_io`)."""
        if self._writing is not None:
            self.discard()
        item = self._writing = _Pending(str(folder / f"{TEMP}{secrets.token_hex(8)}"))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | (O_DIRECT if direct else 0)
        item.fd = os.open(item.tmp, flags, 0o600)
        item.file = BlobFile(item.fd, direct)
        return item.file

    def discard(self) -> None:
        """Close and remove the file being written (its blob is already in the folder, or
        writing it failed)."""
        item, self._writing = self._writing, None
        if item is not None:
            _release(item)

    def written(self, final: Path) -> None:
        """The file being written is complete, to be renamed to ``final``: flush and close it on
        the pool; wait for the oldest flush while more than ``MAX_OPEN`` are under way."""
        item = self._writing
        assert item is not None
        item.final = final
        if item.file is not None:
            item.file.finish()
        self._items.append(item)
        self._writing = None
        try:
            item.flushing = self._pool.submit(_flush_and_close, item.fd)
        except RuntimeError:  # no new work at interpreter shutdown: flush it here
            fd, item.fd = item.fd, -1
            _flush_and_close(fd)
            return
        self._unflushed.append(item)
        while len(self._unflushed) > MAX_OPEN:
            self._unflushed.popleft().flushing.result()  # an fsync error fails the save

    def commit(self) -> None:
        """Wait until every blob is on disk, then rename each to its hash."""
        for item in self._unflushed:
            item.flushing.result()
        self._unflushed.clear()
        while self._items:
            item = self._items[0]
            os.replace(item.tmp, item.final)
            self._items.popleft()

    def __enter__(self) -> PendingBlobs:
        return self

    def __exit__(self, *exc) -> None:
        items = list(self._items)
        if self._writing is not None:
            items.append(self._writing)
        self._writing = None
        self._items.clear()
        self._unflushed.clear()
        for item in items:
            _release(item, wait_for_flush=False)
        # a flush already running closes its descriptor itself: wait, so that nothing of this
        # save is open (or holds disk space) once the save has failed
        wait([item.flushing for item in items if item.flushing is not None])


def _flush_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _release(item: _Pending, wait_for_flush: bool = True) -> None:
    """Close ``item``'s descriptor (unless its flush runs, which closes it) and remove its file."""
    if item.file is not None:
        item.file.release()
    if item.flushing is None or item.flushing.cancel():
        fd, item.fd = item.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    elif wait_for_flush:
        wait([item.flushing])
    try:
        os.unlink(item.tmp)
    except OSError:  # never created (the open failed), or the folder is gone
        pass


def write(folder: Path, chunks: list[list[memoryview]], digests: Iterable[bytes], previous: list[bytes],
          size: int, pending: PendingBlobs, *, direct: bool = False) -> tuple[str, bool]:
    """Write the blob made of ``chunks`` unless ``folder`` holds it: (hash, written?).

    ``digests`` yields each chunk's digest in order (as the pool computes them); ``previous`` are
    the digests of the same name's chunks at the last save: while they match, nothing is written
    (the blob is most likely there already). A written blob is left in ``pending``, which owns
    the temporary file and its descriptor from the moment it is created, errors included.
    ``direct``: write it with ``O_DIRECT`` if it is large enough and the folder takes it.
    """
    seen: list[bytes] = []
    out: BlobFile | None = None
    direct = direct and size >= DIRECT_AT_LEAST and direct_io(folder)

    def start_writing(upto: int) -> BlobFile:
        new = pending.create(folder, direct)
        for c in chunks[:upto]:
            for piece in c:
                new.write(piece)
        return new

    try:
        for i, d in enumerate(digests):
            seen.append(d)
            if out is not None:
                for piece in chunks[i]:
                    out.write(piece)
            elif i >= len(previous) or previous[i] != d:
                out = start_writing(i + 1)  # this chunk changed: write from the start
        blob_hash = combine(seen)
        final = folder / blob_hash
        if present(final, size):
            pending.discard()
            return blob_hash, False
        if out is None:
            start_writing(len(chunks))
    except BaseException:
        pending.discard()
        raise
    pending.written(final)
    return blob_hash, True


def present(path: Path, size: int) -> bool:
    """Whether the blob file ``path`` exists with ``size`` bytes."""
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def read(folder: Path, blob_hash: str, size: int, pool: Executor, *, map_file: bool = False):
    """The verified bytes of a blob as a NumPy uint8 array, hashed chunk by chunk on the pool;
    CheckpointCorruptError if it is missing, of another size, or does not match its hash.

    With ``map_file`` (safetensors blobs of at least ``MAP_AT_LEAST`` bytes) the file is mapped
    copy-on-write instead of read: hashing reads the page cache in place, and restoring copies
    each byte once, straight into the module's own tensors (reading, then copying, touches every
    byte more than once and first zero-fills a fresh buffer as large as the blob). The mapping is
    private and writable, so whatever keeps a tensor of it can write to it; the restore copies it
    out for everything but modules. Pickles are always read into private memory: bytes that will
    be unpickled must be the bytes that were verified. Where mapping fails (a FUSE mount without
    mmap), the blob is read.
    """
    import numpy as np

    path = folder / blob_hash
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"blob {blob_hash[:12]} is missing") from None
    with f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            set_aside(path)
            raise CheckpointCorruptError(
                f"blob {blob_hash[:12]} holds {actual} bytes, the manifest says {size} (truncated?)"
            )
        fd = f.fileno()
        buf = None
        if map_file and size >= MAP_AT_LEAST:
            try:
                buf = np.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_COPY), dtype=np.uint8)
            except (OSError, ValueError):
                buf = None
        if buf is not None:
            view = memoryview(buf)
            futures = [pool.submit(digest, [view[start : start + CHUNK]]) for start in range(0, size, CHUNK)]
        else:
            buf = np.empty(size, dtype=np.uint8)
            view = memoryview(buf)
            # Each chunk is read (pread: no shared file position) and hashed by one worker:
            # copying from the page cache is CPU work too, so reading in one thread left a core idle.
            futures = [
                pool.submit(_read_and_digest, fd, view[start : min(start + CHUNK, size)], start)
                for start in range(0, size, CHUNK)
            ]
        wait(futures)  # every worker done with the file before it is closed, errors or not
        digests = [fu.result() for fu in futures]
        if None in digests:
            raise CheckpointCorruptError(f"blob {blob_hash[:12]} ended early")
    if combine(digests) != blob_hash:
        set_aside(path)
        raise CheckpointCorruptError(f"blob {blob_hash[:12]} does not match its hash (altered or damaged)")
    return buf


def _read_and_digest(fd: int, dest: memoryview, offset: int) -> bytes | None:
    """Fill ``dest`` from ``fd`` at ``offset``; its digest, or None if the file ends first."""
    done = 0
    while done < dest.nbytes:
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n <= 0:
            return None
        done += n
    return digest([dest])


def is_mapped(buf) -> bool:
    """Whether a NumPy array from :func:`read` lies over a file mapping."""
    base = buf.base
    return isinstance(getattr(base, "obj", base), mmap.mmap)


def set_aside(path: Path) -> None:
    """Rename a damaged blob, so that the next save writes that content afresh."""
    try:
        os.replace(path, path.with_name(path.name + ".damaged"))
    except OSError:
        pass


def remove_temporary(folder: Path) -> None:
    """Remove the ``.tmp-*`` blobs a writer killed mid-save left."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for n in names:
        if n.startswith(TEMP):
            try:
                os.unlink(folder / n)
            except OSError:
                pass


def trash(folder: Path, referenced: set[str]) -> None:
    """Rename every blob not in ``referenced`` to ``.trash-<hash>``: no later save can find it,
    and unlinking it (:func:`empty_trash`) can wait."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for n in names:
        if n not in referenced and not n.startswith(TRASH):
            try:
                os.rename(folder / n, folder / (TRASH + n))
            except FileNotFoundError:
                pass


def empty_trash(folder: Path) -> None:
    """Unlink the trashed blobs."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(TRASH)]
    except OSError:
        return
    for n in names:
        try:
            os.unlink(folder / n)
        except OSError:
            pass
