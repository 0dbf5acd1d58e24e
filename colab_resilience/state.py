"""Checkpoints: write, verify, load, and restore in place.

Layout of a run directory (created 0700, every file 0600)::

    run_dir/
      LATEST                  "ckpt-000007": the pointer, replaced atomically last
      ckpt-000007/manifest.json
      ckpt-000006/manifest.json
      blobs/<hash>            content-addressed blobs, shared by the manifests that name them

A save (:meth:`CheckpointStore.save`) first turns every requested value into a blob in memory
(nothing is written if a name is missing; a value that cannot be saved is listed, not written).
Each blob is hashed in 8 MiB chunks on a thread pool (``blake3`` releases the GIL; the pool starts
on a value as soon as it is prepared, while the next one is) and written to ``blobs/.tmp-*`` while
the pool hashes ahead; once every blob is written they are ``fsync``-ed together (in parallel:
the disk writes one back while the next is written) and renamed to ``blobs/<hash>``.
**A blob whose hash is already in the store is not written again.** While its chunks match the
previous save of the same name, nothing is written at all, and a chunk known unchanged since this
process last hashed it is not hashed again. Where the kernel can track writes (:mod:`.writes`,
Linux 6.7+), the whole pages of a tensor's or array's own memory are write-protected when they
are hashed, and a later save asks the kernel whether any was written since: nothing is read at all
but the small values and the partial pages at the ends of large ones (1.9 MiB of 580 MiB in the
benchmark). A chunk found written is hashed and left unprotected while it keeps changing (training
rewrites its weights every epoch: a write fault per page per epoch would be a tax on every step);
once it is found unchanged it is protected again. Elsewhere, and for memory the kernel cannot
vouch for (copies made for the save, CUDA tensors, pinned or shared memory, file mappings), a
chunk's fast in-process fingerprint (xxh3-128) is compared with the one it had: an unchanged value
then costs one fingerprint pass, at memory speed. Checkpoints reference shared blobs instead of
hard links because Google Drive mounts (where Colab users keep checkpoints) have no hard links. The manifest is then
written into ``.tmp-ckpt-*/``, flushed with the folder, renamed to ``ckpt-NNNNNN/``, and ``LATEST``
is replaced (temp + fsync + ``os.replace`` + fsync of the folder): a crash at any moment leaves
the previous checkpoint whole. The newest ``keep`` checkpoints (default 2) are kept; blobs no kept
manifest names are removed. A side effect of sharing: one damaged shared blob damages every
checkpoint that names it; a blob found damaged is set aside so the next save writes it afresh.

The manifest lists each name with its kind, Python type, blob format, size and hash, plus the
Python/torch/NumPy versions, a format version, the creation time, the user's ``meta`` and the
skipped names. It is signed with HMAC-SHA256 under the installation key (:mod:`.signing`); the
hash is ``blake3-tree-8MiB``: BLAKE3 over the concatenated BLAKE3 digests of the blob's 8 MiB
chunks, parallel over chunks. BLAKE3 rather than SHA-256: on a CPU without SHA extensions (many
cloud VMs) SHA-256 runs at about 0.4 GB/s per core and verifying a checkpoint took 3x as long as
reading it; BLAKE3 runs at 3-4 GB/s per core on any x86-64 or ARM CPU with SIMD.

Loading verifies every blob before anything is restored. Safetensors blobs of 4 MiB or more are
mapped (private, copy-on-write) rather than read: the hash reads the page cache in place, and the
restore copies each byte once, into the module's own parameters or, for everything else, into
fresh memory, after which no file stays mapped. Pickles and small blobs are read into memory.

Kinds, decided per value at save time:

- ``state_dict``: anything with ``state_dict()`` and ``load_state_dict()`` (``nn.Module``,
  optimizers, LR schedulers, ``GradScaler``). Restored **in place** into the object of that name
  that exists at restore time (rebuilt by the set-up cells); if there is none, restoring says so.
- ``tensor``, ``ndarray``, ``tree`` (containers holding tensors or arrays): the tensors go to a
  safetensors file (written directly from tensor memory, no copy; readable by
  ``safetensors.safe_open``), the structure to tagged JSON in its ``__metadata__``. Every torch
  dtype is kept (dtypes safetensors has no name for are stored as raw ``U8`` bytes, the real dtype
  in the structure); CUDA tensors come back on their device, or on the CPU with a warning. Tensors
  that are the same view of one storage come back as one tensor; different views of one storage
  (``{"a": t, "b": t[::2]}``) come back as views of one storage.
- ``value``: plain values (``None``, bool, int, float incl. nan/inf, complex, str, bytes, and
  lists, tuples, dicts, sets, frozensets of them, NumPy scalars) as tagged JSON: tuples stay
  tuples, int keys stay ints, a list of 64 or more floats (a loss history) is packed as binary
  doubles; nothing is executed when read.
- ``pickle``: anything else, pickled. It is unpickled only after the manifest's signature and the
  blob's hash have been checked; a manifest another installation signed (or nobody) is refused
  unless the caller passes ``trust=True``.

Values that cannot be saved (generators, open files, sockets, locks, threads, modules, live
iterators, values pickle refuses) are reported by name with the reason; the rest is saved.
Random-number states (Python, NumPy if imported, torch CPU and every initialised CUDA device if
torch is imported) go with every checkpoint and are restored with it.

    store = CheckpointStore(run_dir)
    report = store.save(globals(), ["model", "opt", "history"], meta={"epoch": 3})
    ckpt = store.load()                     # newest verified checkpoint
    ckpt.restore(globals())                 # in place; RNG states too
"""

from __future__ import annotations

import base64
import collections
import ctypes
import difflib
import io
import itertools
import json
import math
import mmap
import os
import pickle
import platform
import re
import secrets
import shutil
import socket
import struct
import sys
import threading
import time
import types
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Sequence

import blake3
import xxhash

from . import signing, writes
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    NoCheckpointError,
    UntrustedCheckpointError,
)
from .journal import atomic_temp_prefix, atomic_write, fsync_dir, make_private_dir, read_limited, write_all

FORMAT = "colab_resilience.checkpoint"
FORMAT_VERSION = 1
HASH_ALGORITHM = "blake3-tree-8MiB"
CHUNK = 8 << 20
TRASH = ".trash-"  # blobs no kept checkpoint names, renamed on the way to being unlinked
LATEST = "LATEST"
MANIFEST = "manifest.json"
BLOBS = "blobs"
RNG_NAME = "__rng__"
ST_META_KEY = "colab_resilience"
_CKPT_RE = re.compile(r"ckpt-(\d{6,})")
_HASH_RE = re.compile(r"[0-9a-f]{64}")
_MAX_MANIFEST = 256 << 20
_MAX_ST_HEADER = 256 << 20
_MAP_AT_LEAST = 4 << 20  # smaller safetensors blobs are read: mapping costs more than it saves
_TRACK_AT_LEAST = 64 << 10  # smaller pieces of live memory are fingerprinted, not write-tracked
_HEADER_ALIGN = 4096
_WORKERS = max(1, min(4, os.cpu_count() or 1))
_pool_lock = threading.Lock()
_pool_of: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool)
_store_tokens = itertools.count(1)


def _pool() -> ThreadPoolExecutor:
    """The threads that hash, read, flush and unlink for every store of this process, made once
    (again after a fork). A pool per save would start threads at every safe point; and each
    thread alive at once costs a stack and, from glibc, a malloc arena (64 MiB of address space,
    never returned), which under an address-space cap (``RLIMIT_AS``) is memory the training
    loses: hence at most 4, and the same ones all along."""
    global _pool_of
    with _pool_lock:
        if _pool_of is None or _pool_of[0] != os.getpid():
            _pool_of = (os.getpid(), ThreadPoolExecutor(_WORKERS, thread_name_prefix="colab_resilience-io"))
        return _pool_of[1]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or a value restored differently than saved (one line each)."""


class MissingNameError(CheckpointError, KeyError):
    """A name to save is not in the namespace (or a name to restore not in the checkpoint)."""

    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.name = name

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])

    def __reduce__(self):
        return (type(self), (self.args[0], self.name))


@dataclass
class SaveReport:
    """What one :meth:`CheckpointStore.save` did."""

    checkpoint_id: str
    names: list[str]
    skipped: dict[str, str]  # name -> one-line message
    bytes_written: int
    bytes_reused: int
    seconds: float
    # bytes of the saved values read to hash them or to see whether they changed (a byte both
    # fingerprinted and hashed counts twice); the rest was known unchanged without reading it
    # (write tracking, see colab_resilience.writes)
    bytes_read: int = 0
    meta: dict = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)

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


# -- plain values as tagged JSON --------------------------------------------------------------------


class _NotPlain(Exception):
    pass


class _Unsaveable(Exception):
    pass


def _type_name(value: Any) -> str:
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}"


def _b64(data) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


class _Encoder:
    """Plain values to JSON with one-key ``{"$tag": ...}`` objects for what JSON lacks.

    Tensors and arrays become ``{"$T": i}`` leaves (when allowed); anything else raises
    :class:`_NotPlain`, and the value is pickled instead.
    """

    def __init__(self, leaves: bool):
        self.allow_leaves = leaves
        self.leaves: list[Any] = []
        self._leaf_ids: dict[Any, int] = {}
        self._active: set[int] = set()
        self._seen: set[int] = set()
        self.torch = sys.modules.get("torch")
        self.np = sys.modules.get("numpy")

    def encode(self, x: Any) -> Any:
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return {"$i": hex(x)} if x.bit_length() > 8000 else x
        if t is float:
            return x if math.isfinite(x) else {"$f": struct.pack("<d", x).hex()}
        if t is complex:
            return {"$c": [self.encode(x.real), self.encode(x.imag)]}
        if t is bytes:
            return {"$b": _b64(x)}
        if t is bytearray:
            return {"$ba": _b64(x)}
        if t in (list, tuple, dict, set, frozenset, collections.OrderedDict):
            return self._container(x, t)
        torch, np = self.torch, self.np
        if torch is not None and isinstance(x, torch.Tensor):
            return self._leaf(x)
        if np is not None:
            if t is np.ndarray:
                return self._leaf(x)
            if isinstance(x, np.generic):
                dt = x.dtype
                if dt.hasobject or dt.fields is not None or np.dtype(dt.str) != dt:
                    raise _NotPlain
                return {"$np": [dt.str, _b64(np.asarray(x).tobytes())]}
        raise _NotPlain

    def _container(self, x, t):
        i = id(x)
        if i in self._active:
            raise _NotPlain  # it contains itself: pickle keeps the cycle
        if t not in (tuple, frozenset):
            if i in self._seen:
                raise _NotPlain  # the same mutable container twice: pickle keeps the aliasing
            self._seen.add(i)
        self._active.add(i)
        try:
            enc = self.encode
            if t is list:
                if len(x) >= 64 and set(map(type, x)) == {float}:  # a history of losses: binary
                    return {"$lf": _b64(struct.pack(f"<{len(x)}d", *x))}
                return list(x) if _json_scalars(x) else [enc(v) for v in x]
            if t is tuple:
                return {"$t": list(x) if _json_scalars(x) else [enc(v) for v in x]}
            if t is set:
                return {"$s": [enc(v) for v in x]}
            if t is frozenset:
                return {"$fs": [enc(v) for v in x]}
            if t is dict:
                if all(type(k) is str and not k.startswith("$") for k in x):
                    return {k: enc(v) for k, v in x.items()}
                return {"$d": [[enc(k), enc(v)] for k, v in x.items()]}
            meta = getattr(x, "_metadata", None)  # module state_dicts carry version info here
            return {"$od": [[[enc(k), enc(v)] for k, v in x.items()], enc(meta)]}
        finally:
            self._active.discard(i)

    def _leaf(self, x) -> dict:
        if not self.allow_leaves:
            raise _NotPlain
        torch = self.torch
        key: Any = id(x)
        if torch is not None and isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, torch.nn.Parameter):
                raise _NotPlain  # subclasses (FakeTensor, DTensor...) carry more than data
            if x.layout is not torch.strided or x.is_quantized or x.device.type == "meta":
                raise _NotPlain
            if x.numel():  # the same view of the same storage is one tensor
                key = (
                    "v", x.device.type, x.device.index, x.untyped_storage().data_ptr(),
                    x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype,
                )
        else:
            if x.dtype.hasobject or x.dtype.fields is not None or self.np.dtype(x.dtype.str) != x.dtype:
                raise _NotPlain
        idx = self._leaf_ids.get(key)
        if idx is None:
            idx = self._leaf_ids[key] = len(self.leaves)
            self.leaves.append(x)
        return {"$T": idx}


def _json_scalars(items) -> bool:
    """True when every item is JSON as it is (a long history of losses: one pass, no recursion)."""
    for v in items:
        t = type(v)
        if t is float:
            if v - v != 0.0:  # inf or nan
                return False
        elif t is int:
            if v.bit_length() > 8000:
                return False
        elif not (t is str or t is bool or v is None):
            return False
    return True


def _decode(x: Any, leaves: Sequence[Any]) -> Any:
    if isinstance(x, list):
        if not any(type(v) is list or type(v) is dict for v in x):
            return list(x)  # scalars decode to themselves (a fresh list: no aliasing across restores)
        return [_decode(v, leaves) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) == 1:
        (tag, v), = x.items()
        if tag.startswith("$"):
            if tag == "$t":
                return tuple(_decode(e, leaves) for e in v)
            if tag == "$d":
                return {_decode(k, leaves): _decode(e, leaves) for k, e in v}
            if tag == "$s":
                return {_decode(e, leaves) for e in v}
            if tag == "$fs":
                return frozenset(_decode(e, leaves) for e in v)
            if tag == "$f":
                return struct.unpack("<d", bytes.fromhex(v))[0]
            if tag == "$lf":
                data = base64.b64decode(v, validate=True)
                return list(struct.unpack(f"<{len(data) // 8}d", data))  # struct.error unless n*8 bytes
            if tag == "$c":
                return complex(_decode(v[0], leaves), _decode(v[1], leaves))
            if tag == "$b":
                return base64.b64decode(v, validate=True)
            if tag == "$ba":
                return bytearray(base64.b64decode(v, validate=True))
            if tag == "$i":
                return int(v, 16)
            if tag == "$T":
                if type(v) is not int or not 0 <= v < len(leaves):
                    raise ValueError("a tensor reference points nowhere")
                return leaves[v]
            if tag == "$np":
                import numpy as np

                return np.frombuffer(base64.b64decode(v[1], validate=True), dtype=np.dtype(v[0]))[0]
            if tag == "$od":
                items, meta = v
                od = collections.OrderedDict((_decode(k, leaves), _decode(e, leaves)) for k, e in items)
                meta = _decode(meta, leaves)
                if meta is not None:
                    od._metadata = meta  # type: ignore[attr-defined]
                return od
            raise ValueError(f"unknown tag {tag!r}")
    return {k: _decode(v, leaves) for k, v in x.items()}


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


# -- safetensors, written from tensor memory and read into one buffer -------------------------------

_TORCH_ST = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
_NUMPY_ST = {
    "float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
}
_ST_SIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "C64": 8, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}


def _memory(t) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (and without NumPy)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _cpu_contiguous(t):
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


class _Payload:
    """A blob as a list of memory segments plus the objects that keep that memory alive.

    ``live[i]`` is ``(address, owner)`` where segment ``i`` is the memory of a value in the
    namespace itself (not a copy made for the save): private memory of this process that only its
    ``owner`` (a torch storage, or the NumPy array owning the data) uses; such memory can be
    write-tracked between saves (:mod:`.writes`)."""

    def __init__(self, segments: list, keep: list | None = None, live: list | None = None):
        self.segments = [memoryview(s).cast("B") for s in segments]
        self.size = sum(s.nbytes for s in self.segments)
        self.keep = keep or []
        self.live: list[tuple[int, Any] | None] = live or [None] * len(self.segments)


def _live_storage(x, c) -> tuple[int, Any] | None:
    """(address, storage) when ``c`` (what the save reads for tensor ``x``) is ``x``'s own CPU
    memory, which only this process's CPU writes: not a copy, not shared memory, not pinned
    (a device writes pinned memory by DMA, which no page table sees)."""
    if x.device.type != "cpu" or not c.numel():
        return None
    storage = x.untyped_storage()
    if c.untyped_storage() is not storage or storage.is_shared():
        return None
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized() and x.is_pinned():  # no pinned memory before CUDA is up
        return None
    return c.data_ptr(), storage


def _live_array(x, c) -> tuple[int, Any] | None:
    """(address, owning array) when ``c`` (what the save reads for array ``x``) is ``x``'s own
    memory, allocated by NumPy (not a copy, not a file mapping, not another object's buffer)."""
    np = sys.modules["numpy"]

    def root(a):
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    owner = root(x)
    if not c.nbytes or root(c) is not owner or owner.base is not None or not owner.flags.owndata:
        return None
    return c.ctypes.data, owner


def _safetensors_payload(tree: Any, leaves: list) -> _Payload:
    """A safetensors file for ``leaves``; ``tree`` and each leaf's description go to metadata."""
    torch = sys.modules.get("torch")
    entries: list[tuple] = []  # key, st dtype, shape, mem, align, live (see _Payload)
    keep: list = []
    descs: list[dict | None] = [None] * len(leaves)

    def add(obj_mem, st_dtype, shape, align, live) -> str:
        key = str(len(entries))
        entries.append((key, st_dtype, shape, obj_mem, align, live))
        return key

    # different views of one storage: save the storage span once, restore views of it
    if torch is not None:
        groups: dict[tuple, list[int]] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and x.numel():
                groups.setdefault(
                    (x.device.type, x.device.index, x.untyped_storage().data_ptr()), []
                ).append(i)
        for members in groups.values():
            if len(members) < 2:
                continue
            ts = [leaves[i] for i in members]
            if len({t.dtype for t in ts}) != 1 or any(s < 0 for t in ts for s in t.stride()):
                continue
            lo = min(t.storage_offset() for t in ts)
            hi = max(t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 for t in ts)
            if (hi - lo) > 2 * sum(t.numel() for t in ts):
                continue  # mostly gaps: cheaper to save the views apart
            base = ts[0]
            span = torch.empty(0, dtype=base.dtype, device=base.device)
            span.set_(base.untyped_storage(), lo, (hi - lo,), (1,))
            c = _cpu_contiguous(span)
            live = _live_storage(span, c)
            span = c
            keep.append(span)
            dname = str(base.dtype).removeprefix("torch.")
            st = _TORCH_ST.get(dname)
            key = add(_memory(span), st or "U8", [hi - lo] if st else [span.numel() * span.element_size()],
                      min(span.element_size(), 8), live)
            for i, t in zip(members, ts):
                descs[i] = {
                    "lib": "torch", "dtype": dname, "shape": list(t.shape), "span": key,
                    "stride": list(t.stride()), "offset": t.storage_offset() - lo,
                    "device": str(t.device), "requires_grad": bool(t.requires_grad),
                    "parameter": type(t) is not torch.Tensor,
                }

    for i, x in enumerate(leaves):
        if descs[i] is not None:
            continue
        if torch is not None and isinstance(x, torch.Tensor):
            c = _cpu_contiguous(x)
            keep.append(c)
            dname = str(x.dtype).removeprefix("torch.")
            st = _TORCH_ST.get(dname)
            nbytes = c.numel() * c.element_size()
            key = add(_memory(c), st or "U8", list(c.shape) if st else [nbytes], min(c.element_size(), 8),
                      _live_storage(x, c))
            descs[i] = {
                "lib": "torch", "dtype": dname, "shape": list(x.shape), "key": key,
                "device": str(x.device), "requires_grad": bool(x.requires_grad),
                "parameter": type(x) is not torch.Tensor,
            }
        else:
            import numpy as np

            order = "F" if (x.flags.f_contiguous and not x.flags.c_contiguous and x.ndim > 1) else "C"
            c = np.ascontiguousarray(x.T if order == "F" else x)
            keep.append(c)
            st = _NUMPY_ST.get(x.dtype.name) if x.dtype.isnative else None
            mem = memoryview(c.reshape(-1).view(np.uint8)) if c.nbytes else memoryview(b"")
            key = add(mem, st or "U8", list(c.shape) if st else [c.nbytes], min(max(c.itemsize, 1), 8),
                      _live_array(x, c))
            descs[i] = {"lib": "numpy", "dtype": x.dtype.str, "shape": list(x.shape), "key": key, "order": order}

    entries.sort(key=lambda e: (-e[4], int(e[0])))  # aligned offsets: 8-byte items first
    header: dict[str, Any] = {
        "__metadata__": {ST_META_KEY: json.dumps({"tree": tree, "leaves": descs}, separators=(",", ":"), allow_nan=False)}
    }
    offset = 0
    for key, st, shape, mem, _, _ in entries:
        header[key] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + mem.nbytes]}
        offset += mem.nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    # data of more than a chunk starts at a 4 KiB boundary (safetensors allows trailing spaces in
    # the header): a header a few bytes longer than at the last save (an optimizer's learning
    # rate, printed with more digits) then leaves every chunk boundary where it was, and unchanged
    # data is still recognised chunk for chunk. Smaller data starts 8-aligned, as safetensors does.
    hbytes += b" " * (-(8 + len(hbytes)) % (_HEADER_ALIGN if offset >= CHUNK else 8))
    return _Payload(
        [struct.pack("<Q", len(hbytes)) + hbytes] + [e[3] for e in entries], keep, [None] + [e[5] for e in entries]
    )


def _parse_safetensors(buf) -> tuple[Any, list[dict], dict[str, tuple[int, int]]]:
    """Check a safetensors buffer; return (tree, leaf descriptions, key -> absolute byte range)."""
    size = len(buf)
    if size < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > min(size - 8, _MAX_ST_HEADER):
        raise ValueError("safetensors header length is out of range")
    header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not an object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(ST_META_KEY), str):
        raise ValueError("not a colab_resilience safetensors file")
    structure = json.loads(meta[ST_META_KEY])
    ranges: dict[str, tuple[int, int]] = {}
    base = 8 + n
    for key, info in header.items():
        a, b = info["data_offsets"]
        count = 1
        for d in info["shape"]:
            if type(d) is not int or d < 0:
                raise ValueError("bad shape")
            count *= d
        if type(a) is not int or type(b) is not int or not 0 <= a <= b <= size - base:
            raise ValueError(f"tensor {key!r} lies outside the file")
        if count * _ST_SIZE[info["dtype"]] != b - a:
            raise ValueError(f"tensor {key!r} has the wrong length")
        ranges[key] = (base + a, base + b)
    if not isinstance(structure, dict) or not isinstance(structure.get("leaves"), list):
        raise ValueError("no structure in the safetensors metadata")
    return structure.get("tree"), structure["leaves"], ranges


def _materialize_leaves(buf, descs: list[dict], ranges: dict[str, tuple[int, int]]) -> list[Any]:
    """Zero-copy tensors and arrays over ``buf`` (a NumPy uint8 array), on the CPU."""
    import numpy as np

    leaves: list[Any] = []
    spans: dict[str, Any] = {}
    for d in descs:
        if not isinstance(d, dict):
            raise ValueError("bad leaf description")
        shape = [int(s) for s in d["shape"]]
        count = math.prod(shape)
        if d["lib"] == "numpy":
            dtype = np.dtype(d["dtype"])
            a, b = ranges[d["key"]]
            if count * dtype.itemsize != b - a:
                raise ValueError("an array has the wrong length")
            arr = buf[a:b].view(dtype)
            arr = arr.reshape(shape[::-1]).T if d.get("order") == "F" else arr.reshape(shape)
            leaves.append(arr)
            continue
        import torch

        dtype = getattr(torch, d["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError("unknown dtype")
        if "span" in d:
            key = d["span"]
            if key not in spans:
                a, b = ranges[key]
                spans[key] = torch.from_numpy(buf[a:b]).view(dtype)
            span = spans[key]
            stride = [int(s) for s in d["stride"]]
            off = int(d["offset"])
            end = off + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if count else off
            if off < 0 or any(s < 0 for s in stride) or end > span.numel():
                raise ValueError("a view lies outside its storage")
            leaves.append(span.as_strided(shape, stride, off))
            continue
        a, b = ranges[d["key"]]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if count * itemsize != b - a:
            raise ValueError("a tensor has the wrong length")
        if count == 0:
            leaves.append(torch.empty(shape, dtype=dtype))
        else:
            leaves.append(torch.from_numpy(buf[a:b]).view(dtype).reshape(shape))
    return leaves


# -- what cannot be saved ---------------------------------------------------------------------------


def _unsaveable_reason(value: Any) -> str | None:
    if isinstance(value, (types.GeneratorType, types.AsyncGeneratorType)):
        return "a generator's position inside its code cannot be stored"
    if isinstance(value, types.CoroutineType):
        return "a coroutine's position inside its code cannot be stored"
    if isinstance(value, io.IOBase):
        return "an open file or stream belongs to this process"
    if isinstance(value, socket.socket):
        return "a socket is a live connection"
    if isinstance(value, mmap.mmap):
        return "a memory map belongs to this process"
    if isinstance(value, (type(threading.Lock()), type(threading.RLock()), threading.Condition,
                          threading.Semaphore, threading.Event)):
        return "a lock or synchronisation primitive belongs to running threads"
    if isinstance(value, threading.Thread):
        return "a thread is running code in this process"
    if isinstance(value, types.ModuleType):
        return "a module is imported again, not saved; import it in a %%replay cell"
    if isinstance(value, (types.FrameType, types.TracebackType)):
        return "a frame belongs to running code"
    tp = type(value)
    if hasattr(tp, "__next__") and hasattr(tp, "__iter__"):
        try:
            if iter(value) is value:
                return "a live iterator has no stable state"
        except Exception:
            pass
    return None


def _unsaveable_message(name: str, value: Any, reason: str) -> str:
    return (
        f"colab_resilience: cannot save {name!r}: {type(value).__name__} objects cannot be "
        f"checkpointed ({reason}); recreate it in a %%replay cell or leave it out of --save"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# -- random-number states ---------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """The random-number states: Python, NumPy (if imported), torch CPU and initialised CUDA."""
    import random

    state: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state(legacy=True)
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned (CUDA states for the devices that exist)."""
    import random

    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "torch" in state or "cuda" in state:
        import torch

        if "torch" in state:
            torch.set_rng_state(state["torch"].contiguous())
        cuda = state.get("cuda") or []
        if cuda:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            for i, s in enumerate(cuda[:count]):
                torch.cuda.set_rng_state(s.contiguous(), i)
            if len(cuda) > count:
                warnings.warn(
                    f"colab_resilience: the checkpoint holds random states of {len(cuda)} CUDA "
                    f"devices; this machine has {count}; the others were not restored",
                    CheckpointWarning,
                    stacklevel=3,
                )


# -- hashing ----------------------------------------------------------------------------------------


def _chunk_spans(segments: list[memoryview]) -> list[list[tuple[int, int, int]]]:
    """The blob cut into ``CHUNK``-byte chunks: each a list of (segment, offset, length)."""
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = CHUNK
    for i, seg in enumerate(segments):
        pos = 0
        while pos < seg.nbytes:
            take = min(room, seg.nbytes - pos)
            current.append((i, pos, take))
            pos += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], CHUNK
    if current:
        chunks.append(current)
    return chunks


def _chunks(segments: list[memoryview]) -> list[list[memoryview]]:
    return [[segments[i][pos : pos + n] for i, pos, n in spans] for spans in _chunk_spans(segments)]


def _split_chunk(payload: _Payload, spans: list[tuple[int, int, int]]):
    """A chunk's pieces, and which of them can be write-tracked: (pieces, loose pieces, tracked
    page ranges, layout, owners). A piece of live memory contributes its whole pages to the
    tracked ranges and its partial pages at either end to the loose pieces (they may share a page
    with other memory); every other piece is loose. Loose pieces are fingerprinted each save."""
    pieces, loose, ranges, layout, owners = [], [], [], [], []
    for i, pos, n in spans:
        piece = payload.segments[i][pos : pos + n]
        pieces.append(piece)
        live = payload.live[i]
        if live is not None:
            a = live[0] + pos
            lo, hi = -(-a // writes.PAGE) * writes.PAGE, (a + n) // writes.PAGE * writes.PAGE
            if hi - lo >= _TRACK_AT_LEAST:
                ranges.append((lo, hi))
                layout.append((a, n))
                owners.append(live[1])
                if lo > a:
                    loose.append(piece[: lo - a])
                if a + n > hi:
                    loose.append(piece[hi - a :])
                continue
        loose.append(piece)
        layout.append((None, n))
    return pieces, loose, ranges, tuple(layout), owners


def _digest(pieces) -> bytes:
    h = blake3.blake3()
    for p in pieces:
        h.update(p)
    return h.digest()


def _read_and_digest(fd: int, dest: memoryview, offset: int) -> bytes:
    """Fill ``dest`` from ``fd`` at ``offset`` (EOFError if the file ends first); its digest."""
    done = 0
    while done < dest.nbytes:
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n <= 0:
            raise EOFError
        done += n
    return _digest([dest])


def _fingerprint(pieces) -> bytes:
    """A fast fingerprint (xxh3-128 of each piece), only for "did this chunk change since this
    process hashed it?": never stored, never trusted from disk; what a manifest records is always
    the BLAKE3. One-shot digests, not a streaming hasher: only they release the GIL (the streaming
    one held it, and two workers fingerprinted at the speed of one)."""
    if len(pieces) == 1:
        return xxhash.xxh3_128_digest(pieces[0])
    return b"".join(xxhash.xxh3_128_digest(p) for p in pieces)


def _digest_unless_unchanged(pieces, loose, previous: tuple[bytes, bytes] | None) -> tuple[bytes, bytes, int]:
    """(fingerprint of ``loose``, digest of ``pieces``, bytes read) of a chunk. The digest is
    reused when the fingerprint is the one ``previous`` recorded: ``loose`` is every piece for a
    chunk that is not write-tracked (a frozen backbone, an unchanged array: a save that changed
    nothing costs a fingerprint pass, not a hashing pass), and only the pieces the tracker does
    not cover for one whose tracked pages the caller found unwritten."""
    fp = _fingerprint(loose)
    nread = sum(p.nbytes for p in loose)
    if previous is not None and previous[0] == fp:
        return fp, previous[1], nread
    return fp, _digest(pieces), nread + sum(p.nbytes for p in pieces)


def _combine(digests: list[bytes]) -> str:
    return blake3.blake3(b"".join(digests)).hexdigest()


def tree_hash(data) -> str:
    """The ``blake3-tree-8MiB`` hash of ``data`` (for tools and tests)."""
    return _combine([_digest(c) for c in _chunks([memoryview(data).cast("B")])])


# -- the store --------------------------------------------------------------------------------------


class _PendingBlobs:
    """Blobs written to temporary files, to be flushed and renamed into place together.

    :meth:`commit` fsyncs them all on the pool (in parallel), then renames each to its hash; until
    then a blob is only a ``.tmp-*`` file. Leaving the ``with`` block without a commit (an error,
    a full disk) closes and removes what is pending.
    """

    def __init__(self):
        self._items: list[tuple[int, str, Path]] = []

    def add(self, fd: int, tmp: str, final: Path) -> None:
        self._items.append((fd, tmp, final))

    def commit(self, pool: ThreadPoolExecutor) -> None:
        for fut in [pool.submit(os.fsync, fd) for fd, _, _ in self._items]:
            fut.result()
        while self._items:
            fd, tmp, final = self._items[0]
            self._items[0] = (-1, tmp, final)
            os.close(fd)
            os.replace(tmp, final)
            self._items.pop(0)

    def __enter__(self) -> "_PendingBlobs":
        return self

    def __exit__(self, *exc) -> None:
        for fd, tmp, _ in self._items:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self._items.clear()


@dataclass
class _Prepared:
    name: str
    kind: str
    type_name: str
    fmt: str  # "st", "json", "pickle"
    payload: _Payload


@dataclass(eq=False)
class _ChunkMemo:
    """What a store remembers of one chunk of a saved name, to skip it at the next save.

    ``state``: ``plain`` (no write tracking: skipped when its fingerprint is unchanged),
    ``protected`` (its live pages are claimed: skipped while they are unwritten and the loose
    pieces' fingerprint is unchanged), ``hot`` (found written at the last save, so hashed and not
    tracked: a chunk that training rewrites every epoch would otherwise cost a write fault per
    page per epoch), ``candidate`` (hot, but found unchanged: claimed again at the next save)."""

    state: str
    layout: tuple | None = None
    owners: tuple = ()  # weak references to the owners of the live pieces
    claims: list | None = None
    fp: bytes = b""
    digest: bytes = b""


@dataclass
class _BlobJob:
    prepared: _Prepared
    chunks: list
    cache_key: str
    previous: list
    futures: list
    memos: list


class CheckpointStore:
    """The checkpoints of one run directory. One process writes at a time (hold a ``RunLock``)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        key: bytes | None = None,
        keep: int = 2,
        run_id: str | None = None,
        track_writes: bool = True,
    ):
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.run_dir = Path(run_dir)
        # signed into every manifest; a manifest of another run (copied in) is not loaded
        self.run_id = run_id
        self.keep = keep
        # find unchanged memory by the kernel's write tracking where it can (colab_resilience.writes);
        # False: by a fingerprint of every byte at every save
        self.track_writes = track_writes
        self._key = key
        self._trash: Future | None = None
        # per saved name: what this process knows of each chunk as it last saved it
        self._chunk_cache: dict[str, list[_ChunkMemo]] = {}
        self._token = next(_store_tokens)  # owns this store's claims on tracked memory
        self._tracker: writes.WriteTracker | None = None  # once this store has claimed memory
        self._bytes_read = 0  # by the save in progress, to hash or to see what changed
        self._private: list[tuple[int, int]] | None = None  # writes.private_memory(), once a save

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = signing.load_or_create_key()
        return self._key

    @property
    def blob_dir(self) -> Path:
        return self.run_dir / BLOBS

    # -- listing --

    def checkpoint_ids(self) -> list[str]:
        """Complete checkpoints on disk, newest first (damaged ones included)."""
        try:
            names = os.listdir(self.run_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = [n for n in names if _CKPT_RE.fullmatch(n) and (self.run_dir / n / MANIFEST).is_file()]
        return sorted(found, key=lambda n: int(n[5:]), reverse=True)

    def latest_id(self) -> str | None:
        """The id ``LATEST`` points to (or the newest complete checkpoint); None if there is none."""
        try:
            text = (self.run_dir / LATEST).read_text("ascii").strip()
            if _CKPT_RE.fullmatch(text) and (self.run_dir / text / MANIFEST).is_file():
                return text
        except (OSError, UnicodeDecodeError):
            pass
        ids = self.checkpoint_ids()
        return ids[0] if ids else None

    def _next_id(self) -> str:
        numbers = [int(n[5:]) for n in self.checkpoint_ids()]
        try:
            text = (self.run_dir / LATEST).read_text("ascii").strip()
            if _CKPT_RE.fullmatch(text):
                numbers.append(int(text[5:]))
        except (OSError, UnicodeDecodeError):
            pass
        return f"ckpt-{max(numbers, default=0) + 1:06d}"

    # -- saving --

    def _prepare(self, name: str, value: Any) -> _Prepared:
        sd_fn = getattr(value, "state_dict", None)
        if callable(sd_fn) and callable(getattr(value, "load_state_dict", None)) and not isinstance(value, type):
            try:
                sd = sd_fn()
            except Exception as e:
                raise _Unsaveable(f"its state_dict() failed: {_first_line(e)}") from None
            return self._encode_value(name, "state_dict", _type_name(value), sd)
        reason = _unsaveable_reason(value)
        if reason:
            raise _Unsaveable(reason)
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        if torch is not None and isinstance(value, torch.Tensor):
            kind = "tensor"
        elif np is not None and isinstance(value, np.ndarray):
            kind = "ndarray"
        else:
            kind = "value"
        return self._encode_value(name, kind, _type_name(value), value)

    def _encode_value(self, name: str, kind: str, type_name: str, value: Any) -> _Prepared:
        enc = _Encoder(leaves=True)
        try:
            tree = enc.encode(value)
        except (_NotPlain, RecursionError):
            try:
                data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                raise _Unsaveable(f"pickle failed: {_first_line(e)}") from None
            return _Prepared(name, kind if kind == "state_dict" else "pickle", type_name, "pickle", _Payload([data]))
        if enc.leaves:
            if kind == "value":
                kind = "tree"
            return _Prepared(name, kind, type_name, "st", _safetensors_payload(tree, enc.leaves))
        return _Prepared(name, kind, type_name, "json", _Payload([_json_bytes(tree)]))

    def save(
        self, namespace: Mapping[str, Any], names: Sequence[str], *, meta: dict | None = None
    ) -> SaveReport:
        """Checkpoint ``names`` from ``namespace`` (with the RNG states); see the module docstring.

        Raises :class:`MissingNameError` (nothing written) if a name is not defined, and
        :class:`CheckpointError` if the checkpoint could not be written (the previous one stays).
        """
        start = time.perf_counter()
        self._bytes_read = 0
        self._private = None
        if isinstance(names, str):
            names = [names]
        names = list(dict.fromkeys(names))
        for name in names:
            if name not in namespace:
                raise MissingNameError(_missing_message(name, namespace, "save"), name)
        rng = capture_rng()
        meta_enc: Any = None
        if meta is not None:
            try:
                meta_enc = _Encoder(leaves=False).encode(dict(meta))
            except (_NotPlain, RecursionError):
                raise CheckpointError(
                    "colab_resilience: checkpoint meta must hold plain values (numbers, strings, "
                    "lists, dicts); nothing was written"
                ) from None
        prepared: list[_Prepared] = []
        skipped: dict[str, str] = {}
        # the workers fingerprint and hash each value while the next one is being prepared
        pool = _pool()
        jobs: list[_BlobJob] = []
        try:
            for name in names:
                value = namespace[name]
                try:
                    prepared.append(self._prepare(name, value))
                except _Unsaveable as e:
                    skipped[name] = _unsaveable_message(name, value, str(e))
                    continue
                jobs.append(self._start_blob(prepared[-1], pool))
            jobs.append(self._start_blob(self._encode_value(RNG_NAME, "rng", "dict", rng), pool))
            return self._commit(jobs, pool, prepared, skipped, meta, meta_enc, start)
        finally:  # after an error: nothing of this save left queued or running on the pool
            futures = [f for job in jobs for f in job.futures]
            for f in futures:
                f.cancel()
            wait(futures)
            self._release_unused_claims()

    def _commit(self, jobs: list["_BlobJob"], pool: ThreadPoolExecutor, prepared: list[_Prepared],
                skipped: dict[str, str], meta: dict | None, meta_enc: Any, start: float) -> SaveReport:
        """The writing half of :meth:`save`: blobs, manifest, ``LATEST``, old checkpoints."""
        previous = self.latest_id()
        tmp_dir: Path | None = None
        written = reused = 0
        try:
            make_private_dir(self.run_dir)
            make_private_dir(self.blob_dir)
            self._remove_leftovers()
            self._empty_trash()  # what a killed writer trashed but did not unlink yet, meanwhile
            checkpoint_id = self._next_id()
            entries = []
            with _PendingBlobs() as pending:
                for job in jobs:
                    p = job.prepared
                    digest, w = self._write_blob(job, pending)
                    written += p.payload.size if w else 0
                    reused += 0 if w else p.payload.size
                    entry = {
                        "name": p.name, "kind": p.kind, "type": p.type_name, "format": p.fmt,
                        "hash": digest, "size": p.payload.size,
                    }
                    entries.append(entry)
                pending.commit(pool)
            fsync_dir(self.blob_dir)
            body = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "checkpoint_id": checkpoint_id,
                "created": time.time(),
                "created_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "hash_algorithm": HASH_ALGORITHM,
                "versions": _versions(),
                "meta": meta_enc,
                "entries": entries[:-1],
                "rng": entries[-1],
                "skipped": skipped,
            }
            if self.run_id is not None:
                body["run_id"] = self.run_id
            manifest = json.dumps(
                {"body": body, "hmac": signing.sign(self.key, _canonical(body))}, indent=1, allow_nan=False
            ).encode()
            tmp_dir = Path(_mkdtemp(self.run_dir, ".tmp-ckpt-"))
            fd = os.open(tmp_dir / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                write_all(fd, manifest)
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(tmp_dir)
            os.rename(tmp_dir, self.run_dir / checkpoint_id)
            tmp_dir = None
            fsync_dir(self.run_dir)
            atomic_write(self.run_dir / LATEST, (checkpoint_id + "\n").encode())
            written += len(manifest)
        except OSError as e:
            if tmp_dir is not None:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            self._chunk_cache.clear()
            try:
                self._collect_garbage()
            except OSError:
                pass
            kept = f"checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
            where = e.filename or self.run_dir
            raise CheckpointError(
                f"colab_resilience: checkpoint not written to {where} ({e.strerror or e}); {kept}"
            ) from e
        try:
            self._collect_garbage()
        except OSError as e:
            warnings.warn(
                f"colab_resilience: could not remove old checkpoints in {self.run_dir} ({e.strerror or e})",
                CheckpointWarning,
                stacklevel=3,
            )
        return SaveReport(
            checkpoint_id=checkpoint_id,
            names=[p.name for p in prepared],
            skipped=skipped,
            bytes_written=written,
            bytes_reused=reused,
            bytes_read=self._bytes_read,
            seconds=time.perf_counter() - start,
            meta=dict(meta or {}),
            kinds={p.name: p.kind for p in prepared},
        )

    def _start_blob(self, p: _Prepared, pool: ThreadPoolExecutor) -> "_BlobJob":
        """Have the pool hash ``p``'s chunks, in order, except those known unchanged: unwritten
        since the last save by the tracker's word (nothing read but the loose pieces), or by an
        unchanged fingerprint (every byte read once, at memory speed; no hashing)."""
        cache_key = f"{p.name}\0{p.kind}\0{p.fmt}"
        previous = self._chunk_cache.pop(cache_key, None) or []
        live = self.track_writes and any(x is not None for x in p.payload.live)
        tracker = writes.tracker() if live else None
        chunks, memos, futures = [], [], []
        for i, spans in enumerate(_chunk_spans(p.payload.segments)):
            prev = previous[i] if i < len(previous) else None
            pieces, loose, ranges, layout, owners = _split_chunk(p.payload, spans)
            memo = _ChunkMemo("plain")
            if tracker is not None and ranges:
                memo = self._track(tracker, prev, ranges, layout, owners)
            if memo.state == "plain":
                loose = pieces  # fingerprinted whole
                reuse = prev if prev is not None and prev.state == "plain" else None
            elif prev is not None and memo.claims is not None and memo.claims is prev.claims:
                reuse = prev  # its pages unwritten since the last save: only the loose pieces compared
            else:
                reuse = None  # written since the last save, or claimed just now (its past unknown)
            chunks.append(pieces)
            memos.append(memo)
            futures.append(
                pool.submit(_digest_unless_unchanged, pieces, loose, (reuse.fp, reuse.digest) if reuse else None)
            )
        return _BlobJob(p, chunks, cache_key, previous, futures, memos)

    def _track(self, tracker: writes.WriteTracker, prev: _ChunkMemo | None, ranges, layout, owners) -> _ChunkMemo:
        """The memo of a chunk with live memory; claims its pages when that is worth it.

        ``prev`` is the memo of the chunk at the same index at the last save: the same memory
        unless the values were replaced (the owners differ) or the blob's layout moved (mostly the
        same memory then, a few bytes over)."""
        memo = _ChunkMemo("hot", layout, tuple(weakref.ref(o) for o in owners))
        if prev is not None and prev.claims is not None:
            clean = all(tracker.clean(c) for c in prev.claims)
            if not clean:  # written since the last save: hashed now, and tracked no more while it changes
                tracker.release(prev.claims)
                return memo
            same = (
                prev.layout == layout
                and len(prev.owners) == len(owners)
                and all(r() is o for r, o in zip(prev.owners, owners))
            )
            if same:
                memo.state, memo.claims = "protected", prev.claims
                return memo
        elif prev is not None and prev.state == "hot":
            return memo  # training rewrites it: claiming it would cost a fault per page until the next save
        # new, moved, or unchanged since it was hot: claim it (revoking old claims it overlaps)
        if self._private is None:
            self._private = writes.private_memory()
        claims = tracker.claim(ranges, self._token, self._private)
        if all(c is not None for c in claims):
            memo.state, memo.claims = "protected", claims
            if self._tracker is None:
                self._tracker = tracker
                weakref.finalize(self, tracker.retain, self._token, ())
        else:  # not private memory after all (a file mapping, shared memory): fingerprinted
            tracker.release(claims)
            memo = _ChunkMemo("plain")
        return memo

    def _release_unused_claims(self) -> None:
        """Stop tracking memory no remembered chunk relies on (renamed, freed, failed saves)."""
        if self._tracker is not None:
            keep = [c for memos in self._chunk_cache.values() for m in memos if m.claims for c in m.claims]
            self._tracker.retain(self._token, keep)

    def _write_blob(self, job: "_BlobJob", pending: "_PendingBlobs") -> tuple[str, bool]:
        """Write a blob unless the store already holds it: (hash, written?). A written blob is
        left in ``pending``, not yet flushed nor renamed: a save's blobs are flushed together, so
        the disk writes one back while the next is written."""
        p, chunks, cache_key, previous, futures = job.prepared, job.chunks, job.cache_key, job.previous, job.futures
        hashed: list[_ChunkMemo] = []
        digests: list[bytes] = []
        fd = -1
        tmp: str | None = None

        def start_writing(upto: int) -> int:
            nonlocal tmp
            tmp = str(self.blob_dir / f".tmp-{secrets.token_hex(8)}")
            new_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            for c in chunks[:upto]:
                for piece in c:
                    write_all(new_fd, piece)
            return new_fd

        try:
            for i, fut in enumerate(futures):
                memo = job.memos[i]
                memo.fp, d, nread = fut.result()
                memo.digest = d
                self._bytes_read += nread
                hashed.append(memo)
                digests.append(d)
                changed = i >= len(previous) or previous[i].digest != d
                if memo.state == "hot" and not changed:
                    memo.state = "candidate"
                if fd >= 0:
                    for piece in chunks[i]:
                        write_all(fd, piece)
                elif changed:
                    fd = start_writing(i + 1)  # this chunk changed: write from the start
            digest = _combine(digests)
            final = self.blob_dir / digest
            if _blob_present(final, p.payload.size):
                return digest, False
            if fd < 0:
                fd = start_writing(len(chunks))
            pending.add(fd, tmp, final)  # it closes or removes them from now on
            fd, tmp = -1, None
            return digest, True
        finally:
            for fut in futures:
                fut.cancel()
            if fd >= 0:
                os.close(fd)
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            if len(hashed) == len(chunks):
                self._chunk_cache[cache_key] = hashed

    # -- housekeeping --

    def _remove_leftovers(self) -> None:
        """Remove what a writer killed mid-save left: temporary checkpoint folders, LATEST and
        blob files. Only one writer uses a run directory at a time (the run lock), so at the start
        of a save every temporary file is a leftover; removing them then, not only after the save,
        keeps a run that is killed again and again from filling the disk."""
        if not self.run_dir.is_dir():
            return
        try:
            blob_names = os.listdir(self.blob_dir)
        except OSError:
            blob_names = []
        for n in blob_names:
            if n.startswith(".tmp-"):
                try:
                    os.unlink(self.blob_dir / n)
                except OSError:
                    pass
        for n in os.listdir(self.run_dir):
            if n.startswith(".tmp-ckpt-"):
                shutil.rmtree(self.run_dir / n, ignore_errors=True)
            elif n.startswith(atomic_temp_prefix(LATEST)):  # a kill between writing LATEST and its rename
                try:
                    os.unlink(self.run_dir / n)
                except OSError:
                    pass

    def _collect_garbage(self) -> None:
        """Keep the newest ``keep`` checkpoints (and what LATEST names); drop unreferenced blobs."""
        ids = self.checkpoint_ids()
        kept = set(ids[: self.keep])
        latest = self.latest_id()
        if latest:
            kept.add(latest)
        # A checkpoint folder without a manifest is what a removal interrupted by a kill left (a
        # new checkpoint appears whole, by one rename); checkpoint_ids() does not list it.
        names = [n for n in os.listdir(self.run_dir) if _CKPT_RE.fullmatch(n)]
        for cid in names:
            if cid not in kept:
                # out of sight in one rename, so a kill in the middle leaves only a .tmp- folder
                gone = self.run_dir / f".tmp-ckpt-gone-{cid}"
                try:
                    os.rename(self.run_dir / cid, gone)
                except FileNotFoundError:
                    continue
                except OSError:
                    gone = self.run_dir / cid  # e.g. an earlier .tmp-ckpt-gone- of the same id
                shutil.rmtree(gone, ignore_errors=True)
        self._remove_leftovers()
        referenced: set[str] = set()
        for cid in kept:
            try:
                body = json.loads((self.run_dir / cid / MANIFEST).read_bytes())["body"]
                for e in list(body["entries"]) + [body["rng"]]:
                    referenced.add(e["hash"])
            except Exception:
                continue  # a damaged manifest keeps nothing alive
        try:
            blob_names = os.listdir(self.blob_dir)
        except FileNotFoundError:
            return
        for n in blob_names:
            if n not in referenced and not n.startswith(TRASH):
                try:  # a rename now (no later save can find the blob), the unlink off the safe point
                    os.rename(self.blob_dir / n, self.blob_dir / (TRASH + n))
                except FileNotFoundError:
                    pass
        self._empty_trash()

    def wait(self) -> None:
        """Wait until the blobs removed by the last save are unlinked (background work)."""
        if self._trash is not None:
            self._trash.result()

    def _empty_trash(self) -> None:
        """Unlink the trashed blobs in the background (on the pool): freeing hundreds of MiB takes
        a filesystem 0.1-0.5 s, which a training loop should not wait for at every safe point. What
        a kernel leaving for a restart leaves behind is emptied after the next save."""
        if self._trash is not None and not self._trash.done():
            return

        def empty(folder: Path) -> None:
            try:
                names = [n for n in os.listdir(folder) if n.startswith(TRASH)]
            except OSError:
                return
            for n in names:
                try:
                    os.unlink(folder / n)
                except OSError:
                    pass

        self._trash = _pool().submit(empty, self.blob_dir)

    def clear(self) -> None:
        """Remove every checkpoint and blob of this run (``%resilience reset``)."""
        for cid in self.checkpoint_ids():
            shutil.rmtree(self.run_dir / cid, ignore_errors=True)
        shutil.rmtree(self.blob_dir, ignore_errors=True)
        try:
            os.unlink(self.run_dir / LATEST)
        except FileNotFoundError:
            pass
        self._remove_leftovers()
        self._chunk_cache.clear()
        self._release_unused_claims()

    def adopt(self) -> list[str]:
        """Re-sign every well-formed checkpoint manifest with this installation's key; return their
        ids. For a run the user vouched for (``%resilience resume --trust``) after it was written
        under another key. Blob hashes are still verified by every load."""
        adopted = []
        for cid in self.checkpoint_ids():
            path = self.run_dir / cid / MANIFEST
            try:
                with open(path, "rb") as f:
                    doc = json.loads(read_limited(f, _MAX_MANIFEST))
                body = doc["body"]
                if not isinstance(body, dict) or body.get("format") != FORMAT:
                    continue
                if signing.verify(self.key, _canonical(body), doc.get("hmac")):
                    continue
                data = json.dumps(
                    {"body": body, "hmac": signing.sign(self.key, _canonical(body))}, indent=1, allow_nan=False
                ).encode()
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                continue  # unreadable: loading will skip it as damaged
            atomic_write(path, data)
            adopted.append(cid)
        return adopted

    # -- loading --

    def load(self, *, trust: bool = False) -> Checkpoint:
        """The newest checkpoint that verifies; older ones are tried after a warning.

        Raises :class:`NoCheckpointError` when none is loadable, or
        :class:`UntrustedCheckpointError` when the only loadable ones are not signed by this
        installation (pass ``trust=True`` to load them anyway).
        """
        ids = self.checkpoint_ids()
        latest = self.latest_id()
        if latest in ids:
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
        path = self.run_dir / cid / MANIFEST
        try:
            with open(path, "rb") as f:
                raw = read_limited(f, _MAX_MANIFEST)
            if len(raw) > _MAX_MANIFEST:
                raise ValueError("larger than any manifest this package writes")
            doc = json.loads(raw, parse_constant=_no_constant)
            body = doc["body"]
            sig = doc.get("hmac")
            ok_shape = isinstance(body, dict) and body.get("format") == FORMAT
            signed = ok_shape and signing.verify(self.key, _canonical(body), sig)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointCorruptError(f"manifest unreadable: {_first_line(e)}") from None
        if not ok_shape:
            raise CheckpointCorruptError("manifest is not a colab_resilience manifest")
        if not signed and not trust:
            raise UntrustedCheckpointError(
                f"colab_resilience: checkpoint {cid} is not signed by this installation's key "
                "(written elsewhere, or edited); load(trust=True) would accept it"
            )
        try:
            if body.get("checkpoint_id") != cid:  # an older manifest copied over a newer one
                raise CheckpointCorruptError(f"its manifest is that of {body.get('checkpoint_id')!r}")
            if self.run_id is not None and body.get("run_id", self.run_id) != self.run_id:
                raise CheckpointCorruptError(
                    f"its manifest belongs to run {body.get('run_id')!r}, not {self.run_id!r} (copied from another run)"
                )
            version = body["format_version"]
            if type(version) is not int or version > FORMAT_VERSION:
                raise CheckpointCorruptError(f"format version {version!r} is newer than this package reads")
            if body.get("hash_algorithm") != HASH_ALGORITHM:
                raise CheckpointCorruptError(f"unknown hash {body.get('hash_algorithm')!r}")
            entries = [_check_entry(e) for e in body["entries"]]
            rng_entry = _check_entry(body["rng"])
            meta = _decode(body.get("meta"), [])
            pool = _pool()
            loaded = {e["name"]: self._read_entry(e, pool) for e in entries}
            rng = self._read_entry(rng_entry, pool)
        except CheckpointCorruptError:
            raise
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error, RecursionError) as e:
            raise CheckpointCorruptError(_first_line(e)) from None
        return Checkpoint(self, cid, body, loaded, rng, meta)

    def _read_blob(self, digest: str, size: int, pool: ThreadPoolExecutor, *, map_file: bool = False):
        """The verified bytes of a blob as a NumPy uint8 array, hashed chunk by chunk on the pool.

        With ``map_file`` (safetensors blobs of at least ``_MAP_AT_LEAST`` bytes) the file is mapped
        copy-on-write instead of read: hashing reads the page cache in place, and restoring copies
        each byte once, straight into the module's own tensors (read-then-copy touched every byte
        three times and zero-filled a fresh buffer as large as the blob). The mapping is private
        and writable, so whatever keeps a tensor of it can write to it; :meth:`_Loaded.take` copies
        it out for everything but modules. Pickles are always read into private memory: bytes that
        will be unpickled must be the bytes that were verified. Where mapping fails (a FUSE mount
        without mmap), the blob is read.
        """
        import numpy as np

        path = self.blob_dir / digest
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"blob {digest[:12]} is missing") from None
        with f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                self._set_aside(path)
                raise CheckpointCorruptError(
                    f"blob {digest[:12]} holds {actual} bytes, the manifest says {size} (truncated?)"
                )
            fd = f.fileno()
            buf = None
            if map_file and size >= _MAP_AT_LEAST:
                try:
                    buf = np.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_COPY), dtype=np.uint8)
                except (OSError, ValueError):
                    buf = None
            if buf is not None:
                view = memoryview(buf)
                futures = [pool.submit(_digest, [view[start : start + CHUNK]]) for start in range(0, size, CHUNK)]
            else:
                buf = np.empty(size, dtype=np.uint8)
                view = memoryview(buf)
                # Each chunk is read (pread: no shared file position) and hashed by one worker:
                # copying from the page cache is CPU work too, so reading in one thread left a core idle.
                futures = [
                    pool.submit(_read_and_digest, fd, view[start : min(start + CHUNK, size)], start)
                    for start in range(0, size, CHUNK)
                ]
            try:
                digests = [fu.result() for fu in futures]
            except EOFError:
                raise CheckpointCorruptError(f"blob {digest[:12]} ended early") from None
        if _combine(digests) != digest:
            self._set_aside(path)
            raise CheckpointCorruptError(f"blob {digest[:12]} does not match its hash (altered or damaged)")
        return buf

    def _set_aside(self, path: Path) -> None:
        """A damaged blob is renamed so the next save writes that content afresh."""
        try:
            os.replace(path, path.with_name(path.name + ".damaged"))
        except OSError:
            pass

    def _read_entry(self, e: dict, pool: ThreadPoolExecutor) -> _Loaded:
        loaded = _Loaded(self, e)
        loaded.fill(self._read_blob(e["hash"], e["size"], pool, map_file=e["format"] == "st"))
        return loaded


def _is_mapped(buf) -> bool:
    """Whether a NumPy array from :meth:`CheckpointStore._read_blob` lies over a file mapping."""
    base = buf.base
    return isinstance(getattr(base, "obj", base), mmap.mmap)


def _private_copy(buf):
    """A copy of a (mapped) uint8 array in fresh memory, chunks copied on the pool: first-touch
    page faults and copying are both CPU work, and one thread left the other cores idle."""
    import numpy as np

    own = np.empty_like(buf)
    futures = [_pool().submit(np.copyto, own[a : a + CHUNK], buf[a : a + CHUNK]) for a in range(0, buf.size, CHUNK)]
    for fu in futures:
        fu.result()
    return own


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number this package writes")


def _check_entry(e: Any) -> dict:
    if not isinstance(e, dict):
        raise CheckpointCorruptError("an entry is not an object")
    for k, t in (("name", str), ("kind", str), ("type", str), ("format", str), ("hash", str), ("size", int)):
        if not isinstance(e.get(k), t):
            raise CheckpointCorruptError(f"an entry's {k} is missing or wrong")
    if not _HASH_RE.fullmatch(e["hash"]) or e["size"] < 0 or e["format"] not in ("st", "json", "pickle"):
        raise CheckpointCorruptError(f"entry {e['name']!r} is malformed")
    return e


def _blob_present(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def _mkdtemp(parent: Path, prefix: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir=parent)  # mode 0700


def _versions() -> dict[str, str]:
    v = {"python": platform.python_version()}
    for mod in ("torch", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = str(getattr(m, "__version__", "?"))
    return v


def _user_names(namespace: Mapping[str, Any]) -> list[str]:
    hidden = {"In", "Out", "exit", "quit", "get_ipython", "open", "resume_range", "checkpoint"}
    return sorted(
        n for n, v in namespace.items()
        if isinstance(n, str) and not n.startswith("_") and n not in hidden and not isinstance(v, types.ModuleType)
    )


def _missing_message(name: str, namespace: Mapping[str, Any], verb: str) -> str:
    names = _user_names(namespace)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    shown = ", ".join(names[:15]) + (", ..." if len(names) > 15 else "")
    return (
        f"colab_resilience: cannot {verb} {name!r}: no variable of that name{hint}; "
        f"defined: {shown or 'nothing'}; nothing was written"
    )


class _Loaded:
    """One verified blob of a checkpoint, decoded lazily into fresh values at each restore."""

    def __init__(self, store: CheckpointStore, entry: dict):
        self.store = store
        self.entry = entry
        self.name: str = entry["name"]
        self.kind: str = entry["kind"]
        self.type_name: str = entry["type"]
        self.fmt: str = entry["format"]
        self._buf = None
        self._decoded: tuple | None = None

    def fill(self, buf) -> None:
        """Check ``buf`` decodes (a damaged structure means a damaged checkpoint)."""
        try:
            if self.fmt == "st":
                tree, descs, ranges = _parse_safetensors(buf)
                leaves = _materialize_leaves(buf, descs, ranges)
                _decode(tree, leaves)
                self._decoded = (tree, descs, leaves)
            elif self.fmt == "json":
                self._decoded = (json.loads(bytes(buf)), [], [])
                _decode(self._decoded[0], [])
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error, RecursionError) as e:
            raise CheckpointCorruptError(f"{self.name!r} does not decode: {_first_line(e)}") from None
        self._buf = buf

    def take(self, *, private: bool = True) -> tuple:
        """(tree, descs, leaves) or the pickle bytes; the buffer is handed out once, then re-read.

        A mapped blob (see :meth:`CheckpointStore._read_blob`) is copied into private memory first,
        unless ``private`` is false: the caller copies the leaves itself (``Module.load_state_dict``
        copies into the parameters) and nothing keeps the file mapped afterwards.
        """
        if self._buf is None:  # handed out before: the caller may have changed those tensors
            self.fill(self.store._read_blob(self.entry["hash"], self.entry["size"], _pool(),
                                            map_file=self.fmt == "st"))
        buf, decoded = self._buf, self._decoded
        self._buf = self._decoded = None
        if self.fmt == "pickle":
            return (bytes(buf),)
        if private and _is_mapped(buf):
            own = _private_copy(buf)  # whole, so views of one storage stay views of one storage
            tree, descs, ranges = _parse_safetensors(own)
            return tree, descs, _materialize_leaves(own, descs, ranges)
        return decoded


class Checkpoint:
    """A verified checkpoint in memory; :meth:`restore` puts it into a namespace."""

    def __init__(self, store: CheckpointStore, checkpoint_id: str, body: dict, entries: dict[str, _Loaded],
                 rng: _Loaded, meta: Any):
        self.store = store
        self.checkpoint_id = checkpoint_id
        self.names: list[str] = list(entries)
        self.meta: dict = meta if isinstance(meta, dict) else {}
        self.created: float = body.get("created", 0.0)
        self.versions: dict = body.get("versions", {})
        self.skipped: dict = body.get("skipped", {})
        self.kinds: dict[str, str] = {n: e.kind for n, e in entries.items()}
        self._entries = entries
        self._rng = rng

    def __repr__(self) -> str:
        return f"<Checkpoint {self.checkpoint_id}: {', '.join(self.names)}>"

    def restore(
        self,
        namespace: MutableMapping[str, Any],
        names: Sequence[str] | None = None,
        *,
        rng: bool = True,
        strict: bool = True,
    ) -> list[str]:
        """Restore ``names`` (default: all) into ``namespace``; return the names restored.

        Objects saved by ``state_dict()`` are loaded in place into the object of that name in
        ``namespace``. If one is missing or of another type, or a name is not in this checkpoint,
        nothing is restored and :class:`CheckpointError` says so in one line (with
        ``strict=False``: a :class:`CheckpointWarning` each, and the rest is restored).
        """
        wanted = self.names if names is None else list(dict.fromkeys([names] if isinstance(names, str) else names))
        problems: dict[str, str] = {}
        for n in wanted:
            e = self._entries.get(n)
            if e is None:
                close = difflib.get_close_matches(n, self.names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems[n] = (
                    f"colab_resilience: {n!r} is not in checkpoint {self.checkpoint_id}{hint}; "
                    f"it holds: {', '.join(self.names) or 'nothing'}"
                )
            elif e.kind == "state_dict":
                short = e.type_name.rsplit(".", 1)[-1]
                if n not in namespace:
                    problems[n] = (
                        f"colab_resilience: cannot restore {n!r} in place: no variable {n!r} exists "
                        f"now (it was a {short}); run the cell that builds it (a %%replay cell) first"
                    )
                elif not callable(getattr(namespace[n], "load_state_dict", None)):
                    problems[n] = (
                        f"colab_resilience: cannot restore {n!r} in place: it now holds a "
                        f"{type(namespace[n]).__name__}, which has no load_state_dict (it was a {short})"
                    )
                elif _type_name(namespace[n]) != e.type_name:
                    problems[n] = (
                        f"colab_resilience: cannot restore {n!r} in place: it was saved from a "
                        f"{e.type_name} and now holds a {_type_name(namespace[n])}"
                    )
        if problems and strict:
            raise CheckpointError(next(iter(problems.values())) + (
                f" (and {len(problems) - 1} more problem(s): {', '.join(list(problems)[1:])})"
                if len(problems) > 1 else ""
            ))
        for message in problems.values():
            warnings.warn(message, CheckpointWarning, stacklevel=2)
        restored = []
        for n in wanted:
            if n in problems:
                continue
            try:
                self._restore_one(self._entries[n], namespace)
            except CheckpointError as err:
                if strict:
                    raise
                warnings.warn(str(err), CheckpointWarning, stacklevel=2)
                continue
            restored.append(n)
        if rng:
            restore_rng(self._value(self._rng, place=False))
        return restored

    def _value(self, e: _Loaded, place: bool, *, private: bool = True) -> Any:
        got = e.take(private=private)
        if e.fmt == "pickle":
            try:
                return pickle.loads(got[0])
            except Exception as err:
                raise CheckpointError(
                    f"colab_resilience: cannot restore {e.name!r}: unpickling failed ({_first_line(err)}); "
                    "define its class (in a %%replay cell) before restoring"
                ) from None
        tree, descs, leaves = got
        if place and leaves:
            leaves = _place_leaves(e.name, descs, leaves)
        return _decode(tree, leaves)

    def _restore_one(self, e: _Loaded, namespace: MutableMapping[str, Any]) -> None:
        if e.kind == "state_dict":
            target = namespace[e.name]
            torch = sys.modules.get("torch")
            # a module copies what it is given into its own tensors; an optimizer keeps them
            copies = torch is not None and isinstance(target, torch.nn.Module)
            value = self._value(e, place=False, private=not copies)
            try:
                result = target.load_state_dict(value)
            except Exception as err:
                raise CheckpointError(
                    f"colab_resilience: cannot restore {e.name!r} in place: load_state_dict failed "
                    f"({_first_line(err)})"
                ) from None
            missing = getattr(result, "missing_keys", None)
            if missing or getattr(result, "unexpected_keys", None):
                warnings.warn(
                    f"colab_resilience: {e.name!r} restored with missing keys {missing} and "
                    f"unexpected keys {result.unexpected_keys}",
                    CheckpointWarning,
                    stacklevel=3,
                )
            return
        namespace[e.name] = self._value(e, place=True)


def _place_leaves(name: str, descs: list[dict], leaves: list[Any]) -> list[Any]:
    """Tensors back onto their device (CPU with a warning where it is gone); grads and Parameters."""
    torch = sys.modules.get("torch")
    if torch is None:
        return leaves
    out = list(leaves)
    moved_spans: dict[tuple, Any] = {}
    gone: set[str] = set()
    for i, (d, t) in enumerate(zip(descs, leaves)):
        if d.get("lib") != "torch":
            continue
        device = d.get("device", "cpu")
        if device != "cpu":
            target = _device_if_present(torch, device)
            if target is None:
                gone.add(device)
            elif "span" in d:
                # move the shared storage once, then take the views on the device
                key = (d["span"], device)
                if key not in moved_spans:
                    storage = t.untyped_storage()
                    whole = torch.empty(0, dtype=t.dtype)
                    whole.set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
                    moved_spans[key] = whole.to(target)
                t = moved_spans[key].as_strided(t.shape, t.stride(), t.storage_offset())
            else:
                t = t.to(target)
        if d.get("parameter"):
            t = torch.nn.Parameter(t, requires_grad=bool(d.get("requires_grad")))
        elif d.get("requires_grad") and (t.is_floating_point() or t.is_complex()):
            t = t.requires_grad_(True)
        out[i] = t
    if gone:
        warnings.warn(
            f"colab_resilience: {name!r} was saved on {', '.join(sorted(gone))}, which this machine "
            "does not have; restored on the CPU",
            CheckpointWarning,
            stacklevel=4,
        )
    # identical leaves were one object when saved; keep them one object
    return out


def _device_if_present(torch, device: str):
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return None
    if dev.type == "cuda":
        if torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
            return dev
        return None
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    try:
        return dev if callable(available) and available() else None
    except Exception:
        return None
