"""Hashing blobs: chunks, the BLAKE3 tree hash, the fingerprint of unchanged chunks, the threads.

A blob is hashed in ``CHUNK``-byte chunks so that every chunk can be hashed on its own thread. Its
hash (``blake3-tree-8MiB``, what a manifest records and every load checks) is BLAKE3 over the
concatenated BLAKE3 digests of its chunks. BLAKE3 rather than SHA-256: on CPUs without SHA
extensions (many cloud VMs) SHA-256 is slower than reading the checkpoint, while BLAKE3 runs on the
SIMD units of any x86-64 or ARM CPU.

A save remembers each chunk's fast fingerprint (xxh3-128) next to its digest: a chunk whose
fingerprint is unchanged keeps its digest and is not hashed again, so a save that changed nothing
costs one pass at memory speed. A chunk that had changed at the last save (the weights and the
optimizer's state of a training, at every safe point) is hashed straight away, without the
fingerprint pass that would only find it changed again: one pass over its bytes, not two; where
its digest then shows it unchanged, it is fingerprinted again, and the next save takes the cheap
path. The fingerprint only answers "is this chunk what this process last hashed?": it is never
stored, nor trusted from disk.

A :class:`HashJob` hashes one blob that way, on the threads of :func:`pool` (which also read,
flush and unlink for every store of the process); ``blake3`` and the one-shot ``xxhash`` digests
release the GIL, so the threads run in parallel.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Iterator

import blake3
import xxhash

from .. import memory

CHUNK = 8 << 20
HASH_ALGORITHM = "blake3-tree-8MiB"
_WORKERS = max(1, min(4, os.cpu_count() or 1))
_pool_lock = threading.Lock()
_pool_of: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool)


def pool() -> Executor:
    """The threads that hash, read, flush and unlink for every store of this process, made once
    (again after a fork). A pool per save would start threads at every safe point; and each
    thread alive at once costs a stack and, from glibc, a malloc arena of address space that is
    never returned, which under an address-space cap (``RLIMIT_AS``) is memory the training
    loses: hence at most 4, and the same ones all along. Under such a cap, or a data-size one
    (``RLIMIT_DATA`` counts the stacks), with no pool made yet, the work is done on the calling
    thread instead (:data:`INLINE`): two threads took 144 MiB of a capped address space at the
    first save, which an iteration near the cap then lacked (a pool made before the cap was set
    is already inside what the cap left, and is kept)."""
    global _pool_of
    with _pool_lock:
        if _pool_of is None or _pool_of[0] != os.getpid():
            if memory.limited():
                return INLINE
            _pool_of = (os.getpid(), ThreadPoolExecutor(_WORKERS, thread_name_prefix="colab_resilience-io"))
        return _pool_of[1]


class _Inline(Executor):
    """An executor that runs each task when it is submitted, on the submitting thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except Exception as e:  # held for the caller's .result(), as a pool's future holds it
            f.set_exception(e)
        return f


INLINE = _Inline()


def chunks(segments: list[memoryview]) -> list[list[memoryview]]:
    """The blob made of ``segments`` cut into ``CHUNK``-byte chunks, each a list of pieces (views
    of the segments, no copy)."""
    out: list[list[memoryview]] = []
    current: list[memoryview] = []
    room = CHUNK
    for seg in segments:
        pos = 0
        while pos < seg.nbytes:
            take = min(room, seg.nbytes - pos)
            current.append(seg[pos : pos + take])
            pos += take
            room -= take
            if room == 0:
                out.append(current)
                current, room = [], CHUNK
    if current:
        out.append(current)
    return out


def digest(pieces) -> bytes:
    """The BLAKE3 digest of one chunk given as pieces."""
    h = blake3.blake3()
    for p in pieces:
        h.update(p)
    return h.digest()


def fingerprint(pieces) -> bytes:
    """The xxh3-128 of each piece. One-shot digests, not a streaming hasher: only they release
    the GIL (the streaming one held it, and two workers fingerprinted at the speed of one)."""
    if len(pieces) == 1:
        return xxhash.xxh3_128_digest(pieces[0])
    return b"".join(xxhash.xxh3_128_digest(p) for p in pieces)


def digest_unless_unchanged(pieces, previous: tuple[bytes | None, bytes] | None) -> tuple[bytes | None, bytes, int]:
    """(fingerprint, digest, bytes read) of a chunk, given ``previous``, its (fingerprint, digest)
    at the last save. The digest is ``previous``'s when the fingerprint is unchanged (a frozen
    backbone, an unchanged array): then the chunk is read once, not hashed. The fingerprint is
    None for a chunk found changed: at the next save it is hashed without being fingerprinted."""
    nread = sum(p.nbytes for p in pieces)
    if previous is not None and previous[0] is None:  # changed at the last save: most likely again
        d = digest(pieces)
        if d != previous[1]:
            return None, d, nread
        return fingerprint(pieces), d, 2 * nread  # unchanged after all: the cheap path next time
    fp = fingerprint(pieces)
    if previous is not None and previous[0] == fp:
        return fp, previous[1], nread
    return (fp if previous is None else None), digest(pieces), 2 * nread


def combine(digests: list[bytes]) -> str:
    """The blob's hash (hex) from its chunks' digests, in order."""
    return blake3.blake3(b"".join(digests)).hexdigest()


def tree_hash(data) -> str:
    """The ``blake3-tree-8MiB`` hash of ``data`` (for tools and tests)."""
    return combine([digest(c) for c in chunks([memoryview(data).cast("B")])])


class HashJob:
    """The pool fingerprinting (and where changed, hashing) the chunks of one blob, in order.

    ``memory`` maps a blob's ``key`` (its name, kind and format) to the (fingerprint, digest) of
    each of its chunks as this process last saved it: what the job starts from, and what it leaves
    there once every digest is out (a blob not hashed to the end, in a failed save, is forgotten).
    """

    def __init__(self, segments: list[memoryview], pool: Executor,
                 memory: dict[str, list[tuple[bytes | None, bytes]]], key: str):
        previous = memory.pop(key, None) or []
        self.chunks = chunks(segments)
        self.previous = [d for _, d in previous]  # the digest of each chunk at the last save
        self.bytes_read = 0  # to fingerprint or hash (a byte read for both counts twice)
        self._memory, self._key = memory, key
        self.futures: list[Future] = [
            pool.submit(digest_unless_unchanged, c, previous[i] if i < len(previous) else None)
            for i, c in enumerate(self.chunks)
        ]

    def digests(self) -> Iterator[bytes]:
        """Each chunk's digest, in order, as the pool computes it."""
        hashed = []
        for fut in self.futures:
            fp, d, nread = fut.result()
            self.bytes_read += nread
            hashed.append((fp, d))
            yield d
        self._memory[self._key] = hashed
