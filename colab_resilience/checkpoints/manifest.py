"""What describes a checkpoint: its signed manifest, and the ids and ``LATEST`` pointer that find it.

``ckpt-NNNNNN/manifest.json`` is ``{"body": ..., "hmac": ...}``. The body (:class:`Manifest`)
lists each saved name as an :class:`Entry` (kind, Python type, blob format, size, hash) plus the
random-number states' entry, the Python/torch/NumPy versions, the format version, the hash
algorithm, the creation time, the user's ``meta`` (tagged JSON), the names not saved and why, and
the run id. The HMAC-SHA256 under the installation key (:mod:`colab_resilience.signing`) covers
the body's canonical JSON: a manifest another installation wrote, or an edited one, does not
verify, and nothing it names is unpickled unless the caller trusts it.

:func:`read` is the one way a manifest file is read (size limit, strict JSON, the format's name);
:meth:`Manifest.from_body` then checks everything a load relies on and raises
:class:`~colab_resilience.errors.CheckpointCorruptError` saying what is wrong.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import signing
from ..errors import CheckpointCorruptError
from ..fsutil import atomic_write, canonical_json, read_limited, strict_json
from .codec import MALFORMED
from .hashing import HASH_ALGORITHM
from .values import first_line

FORMAT = "colab_resilience.checkpoint"  # on disk: unchanged since format version 1
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "LATEST"
TEMP_PREFIX = ".tmp-ckpt-"  # a checkpoint folder being written (or removed)
BLOB_FORMATS = ("st", "json", "pickle")
_CKPT_RE = re.compile(r"ckpt-(\d{6,})")
_HASH_RE = re.compile(r"[0-9a-f]{64}")
_MAX_MANIFEST = 256 << 20


@dataclass(frozen=True)
class Entry:
    """One blob of a checkpoint: the value saved as ``name``."""

    name: str
    kind: str  # state_dict, tensor, ndarray, tree, value, pickle, rng
    type_name: str  # module.QualifiedName of the saved value's type
    format: str  # one of BLOB_FORMATS
    hash: str  # blake3-tree-8MiB, hex: also the blob's file name
    size: int

    def to_json(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, "type": self.type_name, "format": self.format,
            "hash": self.hash, "size": self.size,
        }

    @classmethod
    def from_json(cls, e: Any) -> Entry:
        if not isinstance(e, dict):
            raise CheckpointCorruptError("an entry is not an object")
        for k, t in (("name", str), ("kind", str), ("type", str), ("format", str), ("hash", str), ("size", int)):
            if not isinstance(e.get(k), t):
                raise CheckpointCorruptError(f"an entry's {k} is missing or wrong")
        if not _HASH_RE.fullmatch(e["hash"]) or e["size"] < 0 or e["format"] not in BLOB_FORMATS:
            raise CheckpointCorruptError(f"entry {e['name']!r} is malformed")
        return cls(e["name"], e["kind"], e["type"], e["format"], e["hash"], e["size"])


@dataclass
class Manifest:
    """The body of a manifest file (what the signature covers)."""

    checkpoint_id: str
    entries: list[Entry]
    rng: Entry
    meta: Any = None  # tagged JSON of the user's meta dict
    skipped: dict = field(default_factory=dict)  # name -> one-line message
    run_id: str | None = None
    created: float = field(default_factory=time.time)
    created_iso: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    versions: dict = field(default_factory=lambda: library_versions())
    format_version: int = FORMAT_VERSION
    hash_algorithm: str = HASH_ALGORITHM

    def to_body(self) -> dict:
        body = {
            "format": FORMAT,
            "format_version": self.format_version,
            "checkpoint_id": self.checkpoint_id,
            "created": self.created,
            "created_iso": self.created_iso,
            "hash_algorithm": self.hash_algorithm,
            "versions": self.versions,
            "meta": self.meta,
            "entries": [e.to_json() for e in self.entries],
            "rng": self.rng.to_json(),
            "skipped": self.skipped,
        }
        if self.run_id is not None:
            body["run_id"] = self.run_id
        return body

    @classmethod
    def from_body(cls, body: dict, checkpoint_id: str, run_id: str | None = None) -> Manifest:
        """The manifest of checkpoint ``checkpoint_id`` (of run ``run_id``, if given) from a body
        :func:`read` returned; CheckpointCorruptError unless it is one this package can load."""
        try:
            return cls._from_body(body, checkpoint_id, run_id)
        except CheckpointCorruptError:
            raise
        except MALFORMED as e:
            raise CheckpointCorruptError(first_line(e)) from None

    @classmethod
    def _from_body(cls, body: dict, checkpoint_id: str, run_id: str | None) -> Manifest:
        if body.get("checkpoint_id") != checkpoint_id:  # an older manifest copied over a newer one
            raise CheckpointCorruptError(f"its manifest is that of {body.get('checkpoint_id')!r}")
        if run_id is not None and body.get("run_id", run_id) != run_id:
            raise CheckpointCorruptError(
                f"its manifest belongs to run {body.get('run_id')!r}, not {run_id!r} (copied from another run)"
            )
        version = body["format_version"]
        if type(version) is not int or version > FORMAT_VERSION:
            raise CheckpointCorruptError(f"format version {version!r} is newer than this package reads")
        if body.get("hash_algorithm") != HASH_ALGORITHM:
            raise CheckpointCorruptError(f"unknown hash {body.get('hash_algorithm')!r}")
        entries = [Entry.from_json(e) for e in body["entries"]]
        rng = Entry.from_json(body["rng"])
        return cls(
            checkpoint_id=checkpoint_id, entries=entries, rng=rng, meta=body.get("meta"),
            skipped=body.get("skipped", {}), run_id=body.get("run_id"), created=body.get("created", 0.0),
            created_iso=body.get("created_iso", ""), versions=body.get("versions", {}),
            format_version=version, hash_algorithm=HASH_ALGORITHM,
        )


@dataclass(frozen=True)
class ManifestFile:
    """A manifest file as read: its body and signature, neither trusted yet."""

    body: dict
    hmac: Any

    @classmethod
    def sign(cls, body: dict, key: bytes) -> ManifestFile:
        return cls(body, signing.sign(key, canonical_json(body)))

    def verify(self, key: bytes) -> bool:
        """Whether the body is signed by ``key`` (ValueError if it cannot be put in canonical form)."""
        return signing.verify(key, canonical_json(self.body), self.hmac)

    def to_bytes(self) -> bytes:
        return json.dumps({"body": self.body, "hmac": self.hmac}, indent=1, allow_nan=False).encode()

    def blob_hashes(self) -> set[str]:
        """The blobs the body names, whatever else it holds (a manifest of a newer format keeps its
        blobs too); CheckpointCorruptError if its entries are malformed."""
        try:
            return {Entry.from_json(e).hash for e in [*self.body["entries"], self.body["rng"]]}
        except (KeyError, TypeError) as e:
            raise CheckpointCorruptError(first_line(e)) from None


def read(path: Path) -> ManifestFile:
    """The manifest file at ``path``; CheckpointCorruptError if it cannot be read, is larger than
    any manifest this package writes, is not strict JSON, or is not a checkpoint manifest."""
    try:
        with open(path, "rb") as f:
            raw = read_limited(f, _MAX_MANIFEST)
        if len(raw) > _MAX_MANIFEST:
            raise ValueError("larger than any manifest this package writes")
        doc = strict_json(raw)
        body = doc["body"]
        sig = doc.get("hmac")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointCorruptError(f"manifest unreadable: {first_line(e)}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointCorruptError("manifest is not a colab_resilience manifest")
    return ManifestFile(body, sig)


def library_versions() -> dict[str, str]:
    """Python's version, and torch's and NumPy's where they are imported."""
    v = {"python": platform.python_version()}
    for mod in ("torch", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = str(getattr(m, "__version__", "?"))
    return v


# -- checkpoint ids and LATEST ----------------------------------------------------------------------


def is_checkpoint_id(name: str) -> bool:
    """Whether ``name`` has the form of a checkpoint folder's name (``ckpt-NNNNNN``)."""
    return _CKPT_RE.fullmatch(name) is not None


def checkpoint_ids(run_dir: Path) -> list[str]:
    """Complete checkpoints in ``run_dir`` (those with a manifest), newest first."""
    try:
        names = os.listdir(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [n for n in names if is_checkpoint_id(n) and (run_dir / n / MANIFEST).is_file()]
    return sorted(found, key=lambda n: int(n[5:]), reverse=True)


def _read_latest(run_dir: Path) -> str | None:
    """The checkpoint id ``LATEST`` holds, if it holds one (the checkpoint may not exist)."""
    try:
        text = (run_dir / LATEST).read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if is_checkpoint_id(text) else None


def latest_id(run_dir: Path) -> str | None:
    """The id ``LATEST`` points to (or the newest complete checkpoint); None if there is none."""
    text = _read_latest(run_dir)
    if text is not None and (run_dir / text / MANIFEST).is_file():
        return text
    ids = checkpoint_ids(run_dir)
    return ids[0] if ids else None


def next_id(run_dir: Path) -> str:
    """The id of the next checkpoint: after every one on disk and the one ``LATEST`` names."""
    numbers = [int(n[5:]) for n in checkpoint_ids(run_dir)]
    latest = _read_latest(run_dir)
    if latest is not None:
        numbers.append(int(latest[5:]))
    return f"ckpt-{max(numbers, default=0) + 1:06d}"


def write_latest(run_dir: Path, checkpoint_id: str) -> None:
    """Point ``LATEST`` at ``checkpoint_id`` (atomically and durably)."""
    atomic_write(run_dir / LATEST, (checkpoint_id + "\n").encode())
