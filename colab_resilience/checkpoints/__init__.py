"""Checkpoints: write, verify, load, and restore in place.

    store = CheckpointStore(run_dir)
    report = store.save(globals(), ["model", "opt", "history"], meta={"epoch": 3})
    ckpt = store.load()                     # newest verified checkpoint
    ckpt.restore(globals())                 # in place; RNG states too

Layout of a run's checkpoint folder (created 0700, every file 0600)::

    run_dir/
      LATEST                  "ckpt-000007": the pointer, replaced atomically last
      ckpt-000007/manifest.json
      ckpt-000006/manifest.json
      blobs/<hash>            content-addressed blobs, shared by the manifests that name them

**A save** turns every requested value into a blob in memory (:mod:`.values`; nothing is written
if a name is missing, and a value that cannot be saved is listed with the reason, not written),
and the random-number states (:mod:`.rng`) into one more. Each blob is hashed in 8 MiB chunks on a
small thread pool while the next value is prepared (:mod:`.hashing`). **A blob whose hash is
already in the store is not written again**, and a chunk whose fingerprint is what it was at
this process's last save of that name is not hashed again: a save that changed nothing reads
every byte once and writes only the manifest. New blobs are written to temporary files, each
flushed and closed on the pool as soon as it is written (a save of many names does not hold a
descriptor per blob), and renamed to their hashes together (:mod:`.blobs`); then the signed
manifest is written into a temporary folder that is renamed to ``ckpt-NNNNNN/``, and ``LATEST``
is replaced. Each step is flushed to disk before the next, so a crash at any moment leaves the
previous checkpoint whole.
The newest ``keep`` checkpoints (default 2) are kept; blobs no kept manifest names are removed
(:mod:`.cleanup`).

**Kinds of values**, decided per value at save time:

- ``state_dict``: anything with ``state_dict()`` and ``load_state_dict()`` (``nn.Module``,
  optimizers, LR schedulers, ``GradScaler``): restored **in place** into the object of that name
  that exists at restore time (rebuilt by the set-up cells); if there is none, restoring says so.
- ``tensor``, ``ndarray``, ``tree`` (containers holding tensors or arrays): a standard safetensors
  file written straight from tensor memory, the structure in its metadata (:mod:`.tensorfile`).
  Every torch dtype is kept; CUDA tensors come back on their device, or on the CPU with a warning;
  views of one storage come back as views of one storage.
- ``value``: plain values (``None``, bool, int, float incl. nan/inf, complex, str, bytes, and
  lists, tuples, dicts, sets, frozensets of them, NumPy scalars) as tagged JSON (:mod:`.codec`):
  tuples stay tuples, int keys stay ints; nothing is executed when read.
- ``pickle``: anything else, pickled (nested tensors with their sizes, strides and offsets;
  NumPy masked arrays with their mask exactly, ``nomask`` included).

A value that cannot be saved is one line naming it, its type and why, whatever inspecting it
raised; running out of memory while preparing a value is not one of those: it propagates as the
out-of-memory error it is.

**Trust.** The manifest (:mod:`.manifest`) lists each name with its kind, type, blob format, size
and hash (``blake3-tree-8MiB``), and is signed with HMAC-SHA256 under the installation key
(:mod:`colab_resilience.signing`). Loading verifies the signature and every blob's hash before
anything is restored, and falls back to the previous checkpoint, with a one-line warning, when
one is damaged. A pickle is unpickled only after both checks; a manifest another installation
signed (or nobody) is refused unless the caller passes ``trust=True``. Restoring is described in
:mod:`.restore`.
"""

from __future__ import annotations

from ..errors import CheckpointWarning, MissingNameError
from .blobs import TRASH
from .hashing import CHUNK, HASH_ALGORITHM, tree_hash
from .manifest import FORMAT_VERSION
from .restore import Checkpoint
from .rng import capture_rng, restore_rng
from .store import CheckpointStore, SaveReport

__all__ = [
    "CHUNK",
    "FORMAT_VERSION",
    "HASH_ALGORITHM",
    "TRASH",
    "Checkpoint",
    "CheckpointStore",
    "CheckpointWarning",
    "MissingNameError",
    "SaveReport",
    "capture_rng",
    "restore_rng",
    "tree_hash",
]
