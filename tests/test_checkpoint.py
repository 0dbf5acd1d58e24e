"""Checkpoints with real files, real tensors and real faults (no mocks of the file system)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import pickle
import random
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from colab_resilience import signing
from colab_resilience.checkpoints import (
    CHUNK,
    FORMAT_VERSION,
    HASH_ALGORITHM,
    TRASH,
    CheckpointStore,
    CheckpointWarning,
    MissingNameError,
    blobs,
    capture_rng,
    hashing,
    restore_rng,
    tree_hash,
)
from colab_resilience.errors import (
    CheckpointError,
    NoCheckpointError,
    UntrustedCheckpointError,
)
from colab_resilience.fsutil import canonical_json
from harness import child_env
from payloads import EvilPayload, Opaque, raw, roundtrip

KEY = bytes(range(32))


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "run", key=KEY)


def manifest(store, cid=None):
    cid = cid or store.latest_id()
    return json.loads((store.run_dir / cid / "manifest.json").read_text())


def entry(store, name, cid=None):
    body = manifest(store, cid)["body"]
    return next(e for e in body["entries"] + [body["rng"]] if e["name"] == name)


def blob_path(store, name, cid=None):
    return store.blob_dir / entry(store, name, cid)["hash"]


# -- format -----------------------------------------------------------------------------------------


def test_layout_permissions_and_manifest(store):
    """A save writes owner-only blobs named by their hash, a signed manifest that names the format,
    the versions and each entry's kind, size and hash, and LATEST; loading gives back the values
    and the meta."""
    t = torch.arange(6.0)
    report = store.save({"t": t, "n": 3}, ["t", "n"], meta={"epoch": 2, "pair": (1, 2)})
    run = store.run_dir
    assert report.checkpoint_id == "ckpt-000001" == store.latest_id()
    assert (run / "LATEST").read_text().strip() == "ckpt-000001"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE(store.blob_dir.stat().st_mode) == 0o700
    for p in store.blob_dir.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    doc = manifest(store)
    body = doc["body"]
    assert body["format_version"] == FORMAT_VERSION and body["created"] > 0
    assert body["format"] == "colab_resilience.checkpoint"  # what checkpoints already on disk say
    assert body["versions"]["python"] and body["versions"]["torch"] == torch.__version__
    assert body["versions"]["numpy"] == np.__version__
    assert [(e["name"], e["kind"]) for e in body["entries"]] == [("t", "tensor"), ("n", "value")]
    for e in body["entries"]:
        data = (store.blob_dir / e["hash"]).read_bytes()
        assert e["size"] == len(data) and e["hash"] == tree_hash(data)
    assert signing.verify(KEY, canonical_json(body), doc["hmac"])
    ckpt = store.load()
    assert ckpt.meta == {"epoch": 2, "pair": (1, 2)}
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


def test_tree_hash_matches_a_plain_definition():
    """The blob hash is BLAKE3 over the BLAKE3 digests of 8 MiB chunks, as its name says."""
    data = os.urandom(CHUNK * 2 + 123)
    from blake3 import blake3

    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    expected = blake3(b"".join(blake3(c).digest() for c in chunks)).hexdigest()
    assert HASH_ALGORITHM == "blake3-tree-8MiB"
    assert tree_hash(data) == expected


def test_keeps_the_last_two_and_collects_unreferenced_blobs(store):
    """Only the last two checkpoints are kept; blobs no kept checkpoint names are set aside at once
    and removed in the background."""
    for i in range(5):
        store.save({"t": torch.full((100,), float(i)), "i": i}, ["t", "i"])
    assert store.checkpoint_ids() == ["ckpt-000005", "ckpt-000004"]
    referenced = set()
    for cid in store.checkpoint_ids():
        body = manifest(store, cid)["body"]
        referenced |= {e["hash"] for e in body["entries"]} | {body["rng"]["hash"]}
    # old blobs are renamed at once (no save can reuse them) and unlinked in the background
    assert {p.name for p in store.blob_dir.iterdir() if not p.name.startswith(TRASH)} == referenced
    store.wait()
    assert {p.name for p in store.blob_dir.iterdir()} == referenced
    assert store.load().checkpoint_id == "ckpt-000005"


def test_keep_first_keeps_the_oldest_checkpoint_too_and_loads_it(tmp_path):
    """A run that saves no values goes back to its first checkpoint after a restart: that one is
    kept beside the last two, with its blobs, and ``load(oldest=True)`` gives it (not the latest)."""
    store = CheckpointStore(tmp_path / "run", key=KEY, keep_first=True)
    for i in range(5):
        store.save({"i": i}, ["i"], meta={"n": i})
    assert store.checkpoint_ids() == ["ckpt-000005", "ckpt-000004", "ckpt-000001"]
    store.wait()
    first, ns = store.load(oldest=True), {}
    first.restore(ns, ["i"])
    assert (first.checkpoint_id, first.meta, ns) == ("ckpt-000001", {"n": 0}, {"i": 0})
    assert store.load().checkpoint_id == "ckpt-000005"


def test_a_checkpoint_removal_cut_short_by_a_kill_is_finished_by_the_next_save(store):
    """A kill inside the removal of an old checkpoint can leave its folder without a manifest
    (invisible to checkpoint_ids); the next save removes it, and removal now starts with a rename."""
    for i in range(3):
        store.save({"t": torch.full((10,), float(i))}, ["t"])
    (store.run_dir / "ckpt-000001").mkdir()  # what rmtree leaves when killed after the manifest
    (store.run_dir / "ckpt-000001" / "stray").write_bytes(b"x")
    (store.run_dir / ".LATEST.tmp-123-abcd").write_bytes(b"ckpt-000004")  # killed before its rename
    store.save({"t": torch.ones(10)}, ["t"])
    store.wait()
    names = sorted(p.name for p in store.run_dir.iterdir() if p.name.startswith(("ckpt-", ".")))
    assert names == ["ckpt-000003", "ckpt-000004"]


def test_trash_left_by_a_kernel_that_left_is_emptied_by_the_next_save(store):
    """Blobs set aside by a kernel that left before removing them are removed by the next save."""
    store.save({"t": torch.zeros(10)}, ["t"])
    (store.blob_dir / (TRASH + "0" * 64)).write_bytes(b"x" * 1000)  # os._exit mid-unlink
    store.save({"t": torch.ones(10)}, ["t"])
    store.wait()
    assert not [p for p in store.blob_dir.iterdir() if p.name.startswith(".")]
    back: dict = {}
    store.load().restore(back, rng=False)
    assert raw(back["t"]) == raw(torch.ones(10))


def test_tensor_blobs_are_standard_safetensors(store):
    """Tensors and modules are written as standard safetensors files, readable without the package."""
    import safetensors.torch

    t = torch.randn(4, 5)
    store.save({"t": t, "m": torch.nn.Linear(3, 2)}, ["t", "m"])
    loaded = safetensors.torch.load_file(str(blob_path(store, "t")))
    assert [raw(v) for v in loaded.values()] == [raw(t)]
    assert len(safetensors.torch.load_file(str(blob_path(store, "m")))) == 2


# -- kinds, byte for byte -------------------------------------------------------------------------

PLAIN = [
    0, -(2**70), 2**40000, 1.5, -0.0, float("inf"), float("-inf"), 1e-310, complex(1, -2),
    complex(float("inf"), 0), "text ünïcode", b"\x00\xff", bytearray(b"ab"), None, True, False,
    [1, [2, [3]]], (1, (2,), ()), {"a": 1, 2: "b", (3, 4): [5], None: None, "$x": 1},
    {1, "a", (2, 3)}, frozenset({1, 2}), {"nested": {"deep": [(1.25, None), {7: {8}}]}},
    OrderedDict([("b", 1), ("a", 2)]), np.float64(2.5), np.int32(-7), np.bool_(True), [],
    {}, (), "",
    [float(i) / 7 for i in range(100)] + [-0.0, 1e-310, float("inf")],  # a loss history: packed
    [0.5] * 63 + [1],  # not all floats: element by element
]


@pytest.mark.parametrize("value", PLAIN, ids=[type(v).__name__ + str(i) for i, v in enumerate(PLAIN)])
def test_plain_values_round_trip_exactly(store, value):
    """Plain values come back with the same type and value, stored as JSON, never pickled."""
    back = roundtrip(store, value)
    assert type(back) is type(value)
    assert pickle.dumps(back) == pickle.dumps(value)
    assert entry(store, "x")["kind"] == "value"
    json.loads(blob_path(store, "x").read_bytes())  # by value: JSON, not pickle


def test_nan_round_trips_as_nan(store):
    """NaN, alone or inside a complex number, comes back as NaN."""
    back = roundtrip(store, [float("nan"), complex(float("nan"), 1)])
    assert math.isnan(back[0]) and math.isnan(back[1].real) and back[1].imag == 1
    nan = float("nan")
    back = roundtrip(store, [nan] * 64)
    assert len(back) == 64 and all(math.isnan(v) for v in back)


def test_each_restore_hands_out_a_fresh_list(store):
    """Two restores of one checkpoint give lists that do not share state."""
    store.save({"h": [1.0] * 100, "s": ["a"] * 3}, ["h", "s"])
    ckpt = store.load()
    first: dict = {}
    second: dict = {}
    ckpt.restore(first, rng=False)
    ckpt.restore(second, rng=False)
    first["h"].append(2.0)
    first["s"].append("b")
    assert second["h"] == [1.0] * 100 and second["s"] == ["a"] * 3


@settings(max_examples=40, deadline=None)
@given(
    hs.recursive(
        hs.none() | hs.booleans() | hs.integers() | hs.floats(allow_nan=False) | hs.text() | hs.binary(),
        lambda kids: hs.lists(kids, max_size=4)
        | hs.tuples(kids, kids)
        | hs.dictionaries(hs.integers() | hs.text(), kids, max_size=4),
        max_leaves=20,
    )
)
def test_plain_values_property(value):
    """Any nesting of plain values comes back equal, with the same repr."""
    with tempfile.TemporaryDirectory() as d:
        back = roundtrip(CheckpointStore(d, key=KEY), value)
        assert back == value and repr(back) == repr(value)


DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.uint16,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_of_every_dtype_round_trip_byte_for_byte(store, dtype):
    """Tensors of every dtype, transposed, strided, scalar or empty, come back byte for byte with
    their dtype and shape."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g, dtype=torch.float64) * 100
    if dtype.is_complex:
        t = torch.complex(base, -base).to(dtype)
    else:
        t = base.to(dtype)
    values = {"plain": t, "transposed": t.T, "strided": t[::2, 1:], "scalar": t[0, 0], "empty": t[:0]}
    back = roundtrip(store, values)
    for k, v in values.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert raw(back[k]) == raw(v), k


def test_tensors_come_back_laid_out_in_memory_as_they_were(store):
    """A tensor in channels_last (2-D and 3-D images), a transpose and a permutation come back with
    their strides, as do a Parameter's; what is not dense (an expanded view, every other row) comes
    back row-major, its values the same."""
    g = torch.Generator().manual_seed(0)
    dense = {
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "channels_last_3d": torch.randn(2, 3, 2, 4, 5, generator=g).to(memory_format=torch.channels_last_3d),
        "transposed": torch.randn(4, 6, generator=g).t(),
        "permuted": torch.randn(3, 4, 5, generator=g).permute(2, 0, 1),
        "one_channel": torch.randn(2, 1, 3, 3, generator=g).to(memory_format=torch.channels_last),
        "parameter": torch.nn.Parameter(torch.randn(8, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)),
    }
    sparse = {"expanded": torch.randn(3, 1, generator=g).expand(3, 4), "every_other": torch.randn(6, 4, generator=g)[::2]}
    back = roundtrip(store, {**dense, **sparse})
    for k, v in dense.items():
        assert back[k].stride() == v.stride() and torch.equal(back[k], v), k
    assert back["parameter"].is_contiguous(memory_format=torch.channels_last)
    assert isinstance(back["parameter"], torch.nn.Parameter)
    for k, v in sparse.items():
        assert back[k].is_contiguous() and torch.equal(back[k], v), k


def test_restored_tensors_and_arrays_lie_in_memory_of_their_own(store):
    """What a restore hands out is not a view into the checkpoint's memory: each tensor has an
    allocation of its own, aligned as the allocator aligns (a dot product sums an unaligned start
    in another order), views of one storage share one copy, and an array owns its data."""
    shared = torch.arange(12.0)
    value = {"odd": torch.randn(3), "next": torch.randn(5, dtype=torch.float64), "scalar": torch.tensor(2.0),
             "a": shared, "b": shared[2:], "array": np.arange(7, dtype=np.float32)}
    back = roundtrip(store, value)
    for k in ("odd", "next", "scalar"):
        assert back[k].data_ptr() % 64 == 0 and back[k].untyped_storage().nbytes() == value[k].nbytes, k
    assert back["b"].untyped_storage().data_ptr() == back["a"].untyped_storage().data_ptr() and back["b"].storage_offset() == 2
    assert back["a"].untyped_storage().nbytes() == 48 and back["a"].data_ptr() % 64 == 0
    assert back["array"].base is None and back["array"].flags.owndata


def test_parameters_and_requires_grad_survive(store):
    """A Parameter comes back a Parameter; requires_grad is kept for leaves and plain tensors."""
    p = torch.nn.Parameter(torch.randn(3))
    leaf = torch.randn(2, requires_grad=True)
    back = roundtrip(store, {"p": p, "leaf": leaf, "plain": torch.ones(2)})
    assert isinstance(back["p"], torch.nn.Parameter) and back["p"].requires_grad
    assert back["leaf"].requires_grad and not back["plain"].requires_grad
    assert raw(back["p"]) == raw(p)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        np.arange(10, dtype=np.int64)[::3],
        np.array([1 + 2j, 3 - 4j], dtype=np.complex128),
        np.array(["ab", "cde"]),
        np.arange(4, dtype=">i4"),
        np.array(True),
        np.zeros((0, 3), dtype=np.uint16),
        np.array(["2024-01-01"], dtype="datetime64[ns]"),
    ],
    ids=lambda a: f"{a.dtype}-{a.shape}",
)
def test_numpy_arrays_round_trip_exactly(store, array):
    """NumPy arrays come back with their dtype, shape, bytes and memory order."""
    back = roundtrip(store, array)
    assert entry(store, "x")["kind"] == "ndarray"
    assert type(back) is np.ndarray and back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes(order="A") == array.tobytes(order="A")
    if array.flags.c_contiguous or array.flags.f_contiguous:  # strided arrays come back compact
        assert back.flags.f_contiguous == array.flags.f_contiguous
    assert pickle.dumps(back) == pickle.dumps(array)


def test_object_arrays_fall_back_to_signed_pickle(store):
    """An object array cannot be raw bytes: it is pickled (and signed)."""
    a = np.array([{"a": 1}, None], dtype=object)
    back = roundtrip(store, a)
    assert entry(store, "x")["kind"] == "pickle"
    assert pickle.dumps(back) == pickle.dumps(a)


def test_tied_tensors_share_storage_again(store):
    """Tensors that shared a storage share one again after a restore (writes go through), and the
    storage is written once."""
    t = torch.arange(20.0)
    value = {"a": t, "b": t[::2], "c": t, "d": t.view(4, 5)[1:, 2:], "other": torch.ones(3)}
    back = roundtrip(store, value)
    assert back["a"] is back["c"]
    ptr = back["a"].untyped_storage().data_ptr()
    assert back["b"].untyped_storage().data_ptr() == ptr == back["d"].untyped_storage().data_ptr()
    assert back["b"].stride() == (2,) and back["d"].stride() == (5, 1)
    for k in value:
        assert torch.equal(back[k], value[k])
    back["a"][8] = -1  # writes through, as before the save
    assert back["b"][4] == -1 and back["d"][0, 1] == -1
    size = blob_path(store, "x").stat().st_size
    assert size < 20 * 4 + 3 * 4 + 2048  # the storage was written once


def test_tied_module_weights_stored_once_and_restored_in_place(store):
    """A module's tied weights are stored once and stay tied when restored in place."""
    def build():
        m = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
        m[1].weight = m[0].weight
        return m

    torch.manual_seed(1)
    m = build()
    store.save({"m": m}, ["m"])
    assert blob_path(store, "m").stat().st_size < 50 * 8 * 4 + 1024
    torch.manual_seed(2)
    fresh = build()
    store.load().restore({"m": fresh})
    assert fresh[1].weight is fresh[0].weight
    assert raw(fresh[0].weight) == raw(m[0].weight)


def test_cuda_tensor_restores_on_cpu_with_one_warning_when_no_gpu(store):
    """A checkpoint that recorded cuda:0 (re-signed with the real key) loads here on the CPU."""
    t = torch.randn(4, 4)
    tied = torch.arange(8.0)
    store.save({"x": {"t": t, "a": tied, "b": tied[::2]}}, ["x"])
    rewrite_blob(store, "x", lambda s: s.replace(b'\\"device\\":\\"cpu\\"', b'\\"device\\":\\"cuda:0\\"'))
    ns: dict = {}
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the fallback path is not taken")
    with pytest.warns(CheckpointWarning, match=r"'x' was saved on cuda:0.*restored on the CPU") as rec:
        store.load().restore(ns)
    assert len(rec) == 1
    assert ns["x"]["t"].device.type == "cpu" and raw(ns["x"]["t"]) == raw(t)
    assert ns["x"]["b"].untyped_storage().data_ptr() == ns["x"]["a"].untyped_storage().data_ptr()
    # in memory of their own, as any CPU tensor (a tensor bound for a GPU this machine has is left
    # to its move there, which copies it)
    assert ns["x"]["t"].data_ptr() % 64 == 0 and ns["x"]["t"].untyped_storage().nbytes() == t.nbytes
    assert ns["x"]["a"].untyped_storage().nbytes() == tied.nbytes


def rewrite_blob(store, name, change):
    """Change a blob's bytes, store it under its new hash and re-sign the manifest (real key)."""
    cid = store.latest_id()
    path = store.run_dir / cid / "manifest.json"
    doc = json.loads(path.read_text())
    e = next(e for e in doc["body"]["entries"] if e["name"] == name)
    data = (store.blob_dir / e["hash"]).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = change(data[8 : 8 + n]).rstrip(b" ")
    header += b" " * (-(8 + len(header)) % 8)
    data = struct.pack("<Q", len(header)) + header + data[8 + n :]
    e["hash"], e["size"] = tree_hash(data), len(data)
    (store.blob_dir / e["hash"]).write_bytes(data)
    doc["hmac"] = signing.sign(store.key, canonical_json(doc["body"]))
    path.write_text(json.dumps(doc))


def test_other_objects_are_pickled_and_signed(store):
    """Other objects, cyclic ones too, are pickled (in a signed checkpoint) and come back."""
    value = Opaque([1, 2])
    back = roundtrip(store, value)
    assert entry(store, "x")["kind"] == "pickle" and back.v == [1, 2]
    cyclic: list = [1]
    cyclic.append(cyclic)
    back = roundtrip(store, cyclic)
    assert back[1] is back


# -- in place ---------------------------------------------------------------------------------------


def build_training(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return {"model": model, "opt": opt, "sched": sched, "scaler": scaler}


def train_step(ns, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    loss = torch.nn.functional.mse_loss(ns["model"](x), y)
    ns["opt"].zero_grad()
    ns["scaler"].scale(loss).backward()
    ns["scaler"].step(ns["opt"])
    ns["scaler"].update()
    ns["sched"].step()


def test_in_place_restore_then_training_is_bit_identical(store):
    """A model, optimizer, scheduler and grad scaler restored in place into freshly built objects
    train on bit-identical to the originals."""
    ns = build_training(0)
    for s in range(3):
        train_step(ns, s)
    store.save(ns, list(ns))
    assert set(store.load().kinds.values()) == {"state_dict"}
    fresh = build_training(123)  # what the replayed set-up cells rebuild after a restart
    objects = dict(fresh)
    assert store.load().restore(fresh) == list(ns)
    assert all(fresh[k] is objects[k] for k in fresh)  # in place, same objects
    assert fresh["opt"].state_dict()["param_groups"] == ns["opt"].state_dict()["param_groups"]
    assert fresh["sched"].state_dict() == ns["sched"].state_dict()
    assert fresh["scaler"].state_dict() == ns["scaler"].state_dict()
    train_step(ns, 99)
    train_step(fresh, 99)
    for a, b in zip(ns["model"].parameters(), fresh["model"].parameters()):
        assert raw(a) == raw(b)
    sa, sb = ns["opt"].state_dict()["state"], fresh["opt"].state_dict()["state"]
    assert sa.keys() == sb.keys() and all(isinstance(k, int) for k in sb)
    for k in sa:
        for f in sa[k]:
            assert raw(sa[k][f]) == raw(sb[k][f])



def test_tensors_no_state_dict_holds_go_with_it_and_back_into_the_module(store):
    """Buffers registered with ``persistent=False`` and tensor attributes (neither in
    ``state_dict()``), in a submodule and in a module inside a saved list: saved, and copied back
    into the tensors the modules hold (the same tensors: what else holds them sees the saved
    values); one whose shape changed since (a cache that grew) is replaced. ``state_dict()`` itself
    stays as torch makes it."""
    def build():
        m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        m[0].register_buffer("mu", torch.zeros(2), persistent=False)
        m[0].register_buffer("cache", torch.zeros(1), persistent=False)
        m[0].register_buffer("none", None, persistent=False)
        m[1].spread = torch.ones(2)  # a tensor attribute, not registered
        return m

    model, in_list = build(), [build()]
    model[0].mu += torch.tensor([1.5, -2.0])
    model[0].cache = torch.arange(3.0)
    in_list[0][0].mu += 7
    model[1].spread = torch.tensor([3.0, 4.0])
    store.save({"model": model, "models": in_list}, ["model", "models"])
    assert "0.mu" not in model.state_dict()
    fresh, fresh_list = build(), [build()]
    mu, listed_mu, spread = fresh[0].mu, fresh_list[0][0].mu, fresh[1].spread
    store.load().restore({"model": fresh, "models": fresh_list}, ["model", "models"], in_place=["models"])
    assert fresh[0].mu is mu and mu.tolist() == [1.5, -2.0]
    assert fresh[0].cache.tolist() == [0.0, 1.0, 2.0] and fresh[0].none is None
    assert fresh_list[0][0].mu is listed_mu and listed_mu.tolist() == [7.0, 7.0]
    assert fresh[1].spread is spread and spread.tolist() == [3.0, 4.0]
    assert list(fresh.state_dict()) == list(model.state_dict())


def test_a_generator_is_restored_in_place_where_a_data_loader_draws_from_it(store):
    """A torch.Generator handed to a shuffling DataLoader, a NumPy Generator and RandomState, a
    random.Random: restored into the ones the replayed set-up cells made (not bound to copies,
    which the DataLoader would never see), each draws what the saved one drew next; the loader's
    next epoch has the saved run's order."""
    def build():
        g = torch.Generator().manual_seed(42)
        loader = torch.utils.data.DataLoader(list(range(32)), batch_size=8, shuffle=True, generator=g)
        return {"g": g, "loader": loader, "rng": np.random.default_rng(1), "legacy": np.random.RandomState(2),
                "py": random.Random(3)}

    def order(ns):
        return [b.tolist() for b in ns["loader"]]

    ns = build()
    order(ns)  # an epoch drawn: the generator has moved on
    ns["rng"].random(3), ns["legacy"].rand(3), ns["py"].random()
    names = ["g", "rng", "legacy", "py"]
    store.save(ns, names)
    saved = ns["g"].get_state()
    fresh = build()
    objects = dict(fresh)
    assert store.load().restore(fresh, names, rng=False) == names
    assert all(fresh[n] is objects[n] for n in names)  # in place
    assert order(fresh) == order(ns)
    assert fresh["rng"].random(4).tolist() == ns["rng"].random(4).tolist()
    assert fresh["legacy"].rand(4).tolist() == ns["legacy"].rand(4).tolist()
    assert fresh["py"].random() == ns["py"].random()
    other: dict = {}
    assert store.load().restore(other, ["g"], rng=False) == ["g"]  # nothing to restore into: bound to the name
    assert isinstance(other["g"], torch.Generator) and torch.equal(other["g"].get_state(), saved)


def test_names_restored_in_place_keep_their_objects_and_what_else_holds_them_sees_the_saved_values(store):
    """The objects the set-up cells made and handed on (a history list a logger holds, a weight
    tensor made by hand that an optimizer holds, a NumPy array in a dict, a dict of lists, a deque,
    a tuple of tensors), restored with ``in_place``: each name keeps its object, with the saved
    contents, so what holds it sees them (bound to new objects, the optimizer would step a weight
    nobody reads). One that cannot take them (another shape, another type) is bound to the saved
    value; without ``in_place``, every name is bound to a new object, as before."""
    from collections import deque

    def build():
        w = torch.zeros(3, 2, requires_grad=True)
        arr = np.zeros(4)
        metrics = {"loss": [], "step": 0}
        return {"w": w, "opt": torch.optim.SGD([w], lr=0.1), "history": [], "arr": arr, "holder": {"arr": arr},
                "metrics": metrics, "losses": metrics["loss"], "recent": deque(maxlen=3),
                "pair": (torch.zeros(2), torch.ones(2)), "other": torch.zeros(5), "kind": [1]}

    ns = build()
    with torch.no_grad():
        ns["w"].copy_(torch.arange(6.0).reshape(3, 2))
        ns["pair"][0].fill_(7.0)
    ns["history"] += [1.5, 2.5]
    ns["arr"][:] = [1, 2, 3, 4]
    ns["losses"].append(0.25)
    ns["metrics"]["step"] = 9
    ns["recent"].extend([1, 2, 3, 4])
    names = ["w", "history", "arr", "metrics", "recent", "pair", "other", "kind"]
    store.save(ns, names)

    fresh = build()
    fresh["other"], fresh["kind"] = torch.zeros(6), (1,)  # cannot take a tensor of 5, a list
    kept = dict(fresh)
    fresh["w"].grad = torch.ones(3, 2)
    assert store.load().restore(fresh, names, rng=False, in_place=names) == names
    for n in ["w", "history", "arr", "metrics", "recent", "pair"]:
        assert fresh[n] is kept[n], n
    assert fresh["opt"].param_groups[0]["params"][0] is fresh["w"]
    assert fresh["w"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] and fresh["w"].requires_grad
    assert fresh["w"].grad is None  # as a tensor made afresh: a step's gradient is no safe point's state
    assert fresh["history"] == [1.5, 2.5] and fresh["holder"]["arr"].tolist() == [1, 2, 3, 4]
    assert fresh["metrics"] == {"loss": [0.25], "step": 9} and fresh["losses"] is fresh["metrics"]["loss"]
    assert list(fresh["recent"]) == [2, 3, 4] and fresh["pair"][0].tolist() == [7.0, 7.0]
    assert fresh["other"] is not kept["other"] and fresh["other"].shape == (5,) and fresh["kind"] == [1]

    again = build()
    before = dict(again)
    store.load().restore(again, names, rng=False)
    assert all(again[n] is not before[n] for n in names)
    assert again["history"] == [1.5, 2.5] and before["history"] == []


def test_a_model_whose_structure_changed_is_refused_naming_the_keys_that_differ(store):
    """A model the loop pruned in place (``weight`` became ``weight_orig`` and ``weight_mask``)
    cannot go into the one the set-up cells build: the one-line refusal names the keys saved and not
    there (its ``weight``, a tensor the pruning recomputes, is saved with it), and the shapes that
    differ (before, the line ended at "Error(s) in loading state_dict for Sequential:", what differs
    was on torch's lines below it). Nothing is changed: torch's ``load_state_dict`` copies what fits
    before it raises, and left the model half restored."""
    import torch.nn.utils.prune as prune

    pruned = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    prune.l1_unstructured(pruned[0], "weight", amount=0.5)
    store.save({"model": pruned}, ["model"])
    built = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    before = {k: v.clone() for k, v in built.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        store.load().restore({"model": built}, ["model"])
    message = str(info.value)
    assert "\n" not in message, message
    assert message == ("colab_resilience: cannot restore 'model' in place: the Sequential it holds now is not the "
                       "one saved (saved, not in it: 0.weight_orig, 0.weight_mask): the set-up cells build another "
                       "architecture, or the cell changed the model after they built it (pruning, a layer added in "
                       "place)"), message
    assert all(torch.equal(v, before[k]) for k, v in built.state_dict().items())
    wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
    store.save({"model": wider}, ["model"])
    with pytest.raises(CheckpointError, match=r"\(other shapes: 0\.weight \[16, 4\] saved, \[8, 4\] now, "
                                              r"0\.bias \[16\] saved, \[8\] now, 1\.weight \[1, 16\] saved, \[1, 8\] now\)"):
        store.load().restore({"model": built}, ["model"])
    assert all(torch.equal(v, before[k]) for k, v in built.state_dict().items())


def test_restore_into_missing_object_says_so_and_invents_nothing(store):
    """A module's state cannot be restored without a module to put it in: one line says to define it
    in a %%replay cell; nothing is invented; a module of another class or a misspelt name is
    refused."""
    store.save({"model": torch.nn.Linear(2, 2), "n": 1}, ["model", "n"])
    ckpt = store.load()
    ns: dict = {}
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(ns)
    message = str(info.value)
    assert "no variable 'model' exists now" in message and "%%replay" in message and "\n" not in message
    assert ns == {}
    with pytest.warns(CheckpointWarning, match="no variable 'model'"):
        assert ckpt.restore(ns, strict=False) == ["n"]
    assert "model" not in ns and ns["n"] == 1
    with pytest.raises(CheckpointError, match="saved from a torch.nn.modules.linear.Linear"):
        ckpt.restore({"model": torch.nn.Conv1d(2, 2, 1)}, ["model"])
    with pytest.raises(CheckpointError, match=r"'modle' is not in checkpoint .*did you mean 'model'"):
        ckpt.restore({}, ["modle"])


def test_a_refused_restore_names_each_object_missing_with_its_type_said_right(store):
    """Two objects missing: the first problem in full, the others named ("and 1 more problem(s):
    opt" before); the type with the article it is said with ("a SGD" before)."""
    model = torch.nn.Linear(2, 2)
    store.save({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}, ["model", "opt"])
    with pytest.raises(CheckpointError) as info:
        store.load().restore({})
    assert str(info.value) == (
        "colab_resilience: cannot restore 'model' in place: no variable 'model' exists now (it was a Linear); run the "
        "cell that builds it first (a %%replay cell is run again after a restart); opt cannot be restored either")
    with pytest.raises(CheckpointError) as info:
        store.load().restore({"model": model}, ["opt"])
    assert "no variable 'opt' exists now (it was an SGD)" in str(info.value), info.value


@pytest.mark.parametrize("name,said", [
    ("int", "an int"), ("AdamW", "an AdamW"), ("ndarray", "an ndarray"), ("SGD", "an SGD"), ("LSTM", "an LSTM"),
    ("MSELoss", "an MSELoss"), ("Linear", "a Linear"), ("GRU", "a GRU"), ("uint8", "a uint8"),
    ("UsageError", "a UsageError"), ("Embedding", "an Embedding"), ("list", "a list"), ("", "a"),
])
def test_a_types_name_is_said_with_its_article(name, said):
    from colab_resilience.words import a

    assert a(name) == said


def test_each_restore_hands_out_fresh_tensors(store):
    """Two restores of one checkpoint give tensors that do not share memory: a second rollback
    undoes in-place training."""
    t = torch.zeros(4)
    store.save({"t": t}, ["t"])
    ckpt = store.load()
    ns: dict = {}
    ckpt.restore(ns)
    ns["t"] += 5  # training changes the restored tensor in place
    ckpt.restore(ns)  # a second rollback from the same checkpoint
    assert torch.equal(ns["t"], torch.zeros(4))


# -- random-number states ---------------------------------------------------------------------------


def draws():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        random.gauss(0, 1),
    )


def test_rng_states_are_saved_and_restored(store):
    """The Python, NumPy and torch random states are saved with a checkpoint and restored with it."""
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()
    store.save({"n": 1}, ["n"])
    expected = draws()
    random.seed(10)
    np.random.seed(20)
    torch.manual_seed(30)
    draws()
    store.load().restore({})
    assert draws() == expected
    state = capture_rng()
    first = draws()
    restore_rng(state)
    assert draws() == first
    assert set(state) == {"python", "numpy", "torch", "torch_settings"}  # CUDA not initialised here


def test_torchs_settings_are_saved_and_restored_with_the_random_states(store):
    """torch's process-wide settings go with a checkpoint's random states and come back with them
    (tests/test_exact_resume.py: in a new kernel)."""
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_default_dtype(torch.float64)
        store.save({"n": 1}, ["n"])
        torch.use_deterministic_algorithms(False)
        torch.set_default_dtype(torch.float32)
        store.load().restore({})
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_default_dtype(torch.float32)


def test_rng_restore_can_be_skipped(store):
    """restore(rng=False) leaves the random states alone."""
    store.save({"n": 1}, ["n"])
    random.seed(5)
    expected = random.random()
    random.seed(5)
    store.load().restore({}, rng=False)
    assert random.random() == expected


# -- unchanged blobs --------------------------------------------------------------------------------


def test_unchanged_blobs_are_not_written_again(store):
    """A save writes only the blobs whose content changed since the last one; a change in one chunk
    of a tensor is found."""
    big = torch.randn(3 * CHUNK // 4)  # three chunks
    ns = {"big": big, "small": [1, 2, 3], "m": torch.nn.Linear(64, 64)}
    first = store.save(ns, list(ns))
    assert first.bytes_reused == 0 and first.bytes_written > big.numel() * 4
    stats = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in store.blob_dir.iterdir()}
    second = store.save(ns, list(ns))
    assert second.bytes_written < 4096  # the manifest only
    assert second.bytes_reused == first.bytes_written - (first.bytes_written - sum(
        e["size"] for e in manifest(store)["body"]["entries"] + [manifest(store)["body"]["rng"]]
    ))
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in store.blob_dir.iterdir()} == stats
    ns["small"].append(4)  # one value changes: only its blob is written
    third = store.save(ns, list(ns))
    assert third.bytes_written < 4096 + 200
    store.wait()
    assert len(list(store.blob_dir.iterdir())) == len(stats) + 1
    big[-1] += 1  # a change in the last chunk
    fourth = store.save(ns, ["big"])
    assert fourth.bytes_written > big.numel() * 4
    ns2: dict = {}
    store.load().restore(ns2)
    assert raw(ns2["big"]) == raw(big)


def test_unchanged_chunks_are_not_hashed_again_but_every_change_is_saved(store, monkeypatch):
    """The fast fingerprint decides only whether a chunk's hash must be computed again; changes
    that autograd's version counter does not see (``.data``, a NumPy view) are still caught, and
    the manifest always records the hash of what is really in the blob."""
    hashed_bytes = []
    real_digest = hashing.digest

    def counting_digest(pieces):
        hashed_bytes.append(sum(memoryview(p).nbytes for p in pieces))
        return real_digest(pieces)

    monkeypatch.setattr(hashing, "digest", counting_digest)
    w = torch.nn.Parameter(torch.randn(3 * CHUNK // 4))  # three chunks
    ns = {"w": w}
    store.save(ns, ["w"])
    hashed_bytes.clear()
    store.save(ns, ["w"])
    assert sum(hashed_bytes) < CHUNK  # the RNG state only; no chunk of w was hashed again
    for change in (
        lambda: w.data.__setitem__(CHUNK // 4 + 7, 42.0),  # 2nd chunk, invisible to w._version
        lambda: w.detach().numpy().__setitem__(-1, -3.0),  # last chunk, through NumPy
    ):
        change()
        hashed_bytes.clear()
        report = store.save(ns, ["w"])
        assert len(hashed_bytes) == 1 and 0 < sum(hashed_bytes) <= CHUNK  # the changed chunk only
        assert report.bytes_written > w.numel() * 4
        entry = manifest(store)["body"]["entries"][0]
        blob = (store.blob_dir / entry["hash"]).read_bytes()
        assert tree_hash(blob) == entry["hash"]
        back: dict = {}
        store.load().restore(back)
        assert raw(back["w"]) == raw(w)
        # a chunk that changed is hashed at the next save without a fingerprint (a training's
        # chunks change at every save); found unchanged, it is fingerprinted again, and hashed
        # no more while it stays so
        for hashed_again in (1, 0):
            hashed_bytes.clear()
            assert store.save(ns, ["w"]).bytes_written < 4096
            assert len(hashed_bytes) == hashed_again and sum(hashed_bytes) <= CHUNK


def test_chunks_that_change_at_every_save_are_read_once_each_save(tmp_path):
    """A training's weights change between any two safe points: after the second save, each of
    their chunks is hashed without the fingerprint pass that would only find it changed (one read
    of every byte, not two), and every change is in the checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)
    opt = torch.optim.AdamW(model.parameters())
    ns = {"model": model, "opt": opt}
    store = CheckpointStore(tmp_path / "run", key=KEY)

    def step_and_save():
        model(torch.randn(4, 2048)).square().mean().backward()
        opt.step()
        return store.save(ns, ["model", "opt"])

    first, second, third, fourth = (step_and_save() for _ in range(4))
    state = first.bytes_written
    assert first.bytes_read >= 2 * (state - 8192)  # fingerprinted and hashed
    assert second.bytes_read >= 2 * (state - 8192)  # fingerprinted, found changed, hashed
    for later in (third, fourth):  # hashed only
        assert state - 8192 <= later.bytes_read <= state + CHUNK
        assert later.bytes_written >= state - 8192
    back = {"model": torch.nn.Linear(2048, 2048), "opt": None}
    back["opt"] = torch.optim.AdamW(back["model"].parameters())
    store.load().restore(back)
    assert raw(back["model"].weight) == raw(model.weight)
    for k in ("exp_avg", "exp_avg_sq"):
        assert raw(back["opt"].state_dict()["state"][0][k]) == raw(opt.state_dict()["state"][0][k])


def training_namespace():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()
    return {"model": model, "opt": opt, "table": np.random.default_rng(0).random((512, 1024)), "note": "x"}


def adam_state(ns):
    return ns["opt"].state[ns["opt"].param_groups[0]["params"][2]]["exp_avg"]


def write_from_a_thread(a):
    t = threading.Thread(target=a.__setitem__, args=(len(a) // 2, 7.0))
    t.start()
    t.join()


CHANGES = {
    "param .data": lambda ns: ns["model"][0].weight.data.__setitem__((300, 5), 9.0),
    "param via numpy": lambda ns: ns["model"][2].weight.detach().numpy().__setitem__((1, 1), -9.0),
    "optimizer state via ctypes": lambda ns: ctypes.memset(adam_state(ns).data_ptr() + 4 * 70_001, 0x41, 1),
    "array from a thread": lambda ns: write_from_a_thread(ns["table"].reshape(-1)),
    "load_state_dict": lambda ns: ns["model"].load_state_dict(
        {k: v + 1 for k, v in ns["model"].state_dict().items()}
    ),
    "name rebound": lambda ns: ns.__setitem__("table", ns["table"] + 1),
}


@pytest.mark.parametrize("change", CHANGES, ids=str)
def test_every_change_is_in_the_next_checkpoint(tmp_path, change):
    """However a byte was changed, the fingerprint of its chunk changes and the next checkpoint
    holds it; a save after which nothing changed writes nothing but the manifest."""
    ns = training_namespace()
    names = ["model", "opt", "table", "note"]
    store = CheckpointStore(tmp_path / "run", key=KEY)
    store.save(ns, names)
    unchanged = store.save(ns, names)
    assert unchanged.bytes_written < 4096
    CHANGES[change](ns)
    report = store.save(ns, names)
    assert report.bytes_written > 4096
    back = training_namespace()
    back["model"].apply(lambda m: torch.nn.init.zeros_(m.weight) if hasattr(m, "weight") else None)
    store.load().restore(back)
    for a, b in zip(back["model"].state_dict().values(), ns["model"].state_dict().values()):
        assert raw(a) == raw(b)
    assert raw(adam_state(back)) == raw(adam_state(ns))
    assert back["table"].tobytes() == ns["table"].tobytes()
    again = store.save(ns, names)  # and nothing is written twice
    assert again.bytes_written < 4096


def test_a_save_after_which_nothing_changed_reads_every_byte_once(tmp_path):
    """A first save reads each byte twice (fingerprint and hash); a save after which nothing changed
    reads each byte once (fingerprint only)."""
    ns = training_namespace()
    names = ["model", "opt", "table", "note"]
    store = CheckpointStore(tmp_path / "run", key=KEY)
    first = store.save(ns, names)
    second = store.save(ns, names)
    assert first.bytes_read >= 2 * (first.bytes_written - 4096)  # fingerprinted and hashed
    assert first.bytes_written - 4096 <= second.bytes_read <= first.bytes_written  # fingerprinted only


@pytest.mark.kernel
def test_in_a_kernel_a_change_autograd_does_not_see_reaches_a_fresh_kernel(kernel, tmp_path):
    """In a kernel, a write through .data (invisible to autograd's version counter) is still saved,
    and a fresh kernel restores it."""
    setup = (
        "import hashlib, torch\n"
        "from colab_resilience.checkpoints import CheckpointStore\n"
        f"store = CheckpointStore({str(tmp_path / 'run')!r})\n"
        "w = torch.nn.Linear(1024, 1024)\n"
        "def digest():\n"
        "    return hashlib.sha256(w.weight.detach().numpy().tobytes()).hexdigest()\n"
    )
    kernel.ok(setup)
    kernel.ok(
        "first = store.save(globals(), ['w'])\n"
        "quiet = store.save(globals(), ['w'])\n"
        "version = w.weight._version\n"
        "w.weight.data[700, 9] = 123.0\n"
        "assert w.weight._version == version\n"
        "changed = store.save(globals(), ['w'])\n"
    )
    quiet, changed = kernel.value("[r.bytes_written for r in (quiet, changed)]")
    assert quiet < 4096 and changed > 4 << 20
    saved = kernel.value("digest()")
    kernel.restart()
    kernel.ok(setup)
    assert kernel.value("digest()") != saved
    kernel.ok("store.load().restore(globals())")
    assert kernel.value("digest()") == saved
    assert kernel.value("float(w.weight[700, 9])") == 123.0


def test_a_learning_rate_printed_longer_rehashes_one_chunk(tmp_path):
    """The optimizer's param_groups live in its blob's header; a learning rate with more digits
    must not shift the data behind it (its chunks would all look new and be hashed again): the
    data starts at a 4 KiB boundary."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(2048, 2048)
        opt = torch.optim.AdamW(model.parameters(), lr=0.001)
        model(torch.randn(4, 2048)).sum().backward()
        opt.step()
        return {"opt": opt}

    ns = build()
    store = CheckpointStore(tmp_path / "run", key=KEY)
    store.save(ns, ["opt"])
    store.save(ns, ["opt"])
    ns["opt"].param_groups[0]["lr"] = 0.0009000000000000001
    report = store.save(ns, ["opt"])
    size = entry(store, "opt")["size"]
    assert report.bytes_written > 4 * CHUNK  # the header changed: a new blob (32 MiB of state)
    # every byte fingerprinted once, and only the chunk holding the header (and the RNG) hashed
    assert size <= report.bytes_read <= size + CHUNK + (1 << 20)
    back = build()
    store.load().restore(back)
    assert back["opt"].param_groups[0]["lr"] == 0.0009000000000000001
    state, state_back = ns["opt"].state_dict()["state"][0], back["opt"].state_dict()["state"][0]
    assert all(raw(state[k]) == raw(state_back[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_a_fresh_store_reuses_blobs_already_on_disk(store):
    """A new store on a run folder reuses the blobs already there."""
    ns = {"t": torch.randn(1000)}
    store.save(ns, ["t"])
    again = CheckpointStore(store.run_dir, key=KEY).save(ns, ["t"])
    assert again.bytes_written < 4096


# -- bad input and unsaveable values ----------------------------------------------------------------


def test_missing_name_is_one_clear_line_and_writes_nothing(store):
    """Saving a name that does not exist is one line with a suggestion and the defined names;
    nothing is written."""
    ns = {"model": 1, "optimizer": 2, "_hidden": 3, "np": np}
    with pytest.raises(MissingNameError) as info:
        store.save(ns, ["modle", "optimizer"])
    message = str(info.value)
    assert "'modle'" in message and "did you mean 'model'" in message
    assert "defined: model, optimizer" in message and "_hidden" not in message
    assert "\n" not in message and isinstance(info.value, KeyError)
    assert store.latest_id() is None


def _gen():
    yield 1


def test_unsaveable_values_are_named_and_the_rest_is_saved(store, tmp_path):
    """Generators, iterators, files, locks, sockets, modules and lambdas are named as not saveable,
    with why, and the rest is saved."""
    lock = threading.Lock()
    sock = socket.socket()
    f = open(tmp_path / "f.txt", "w")
    try:
        ns = {
            "gen": _gen(),
            "it": iter([1, 2]),
            "f": f,
            "lock": lock,
            "sock": sock,
            "mod": os,
            "fn": lambda: 1,
            "inside": {"g": _gen()},
            "ok": [1, 2],
        }
        report = store.save(ns, list(ns))
    finally:
        f.close()
        sock.close()
    assert report.names == ["ok"]
    assert set(report.skipped) == set(ns) - {"ok"}
    assert report.skipped["it"] == (
        "colab_resilience: cannot save 'it': list_iterator objects cannot be checkpointed "
        "(a live iterator has no stable state); recreate it in a %%replay cell and save what it holds instead "
        "(its arrays, its state_dict()), or leave it out of --save"
    )
    assert "generator objects" in report.skipped["gen"]
    assert "open file" in report.skipped["f"]
    assert "lock" in report.skipped["lock"] and "socket" in report.skipped["sock"]
    assert "module" in report.skipped["mod"] and "pickle failed" in report.skipped["fn"]
    assert "cannot save 'inside'" in report.skipped["inside"]
    assert all("\n" not in m for m in report.skipped.values())
    assert store.load().names == ["ok"]
    assert manifest(store)["body"]["skipped"] == report.skipped


def test_meta_must_be_plain(store):
    """A checkpoint's meta must hold plain values."""
    with pytest.raises(CheckpointError, match="meta must hold plain values"):
        store.save({"a": 1}, ["a"], meta={"x": object()})


# -- damage and faults: the previous checkpoint is used, with a warning -----------------------------


def two_checkpoints(store):
    class_value = Opaque("first")
    store.save(
        {"t": torch.arange(10.0), "v": {"k": 1}, "p": class_value, "a": np.arange(3)}, ["t", "v", "p", "a"]
    )
    random.random()
    store.save(
        {"t": torch.arange(10.0) * 2, "v": {"k": 2}, "p": Opaque("second"), "a": np.arange(3) * 2},
        ["t", "v", "p", "a"],
    )
    return "ckpt-000001", "ckpt-000002"


def assert_falls_back(store, match):
    with pytest.warns(CheckpointWarning, match=match) as rec:
        ckpt = store.load()
    assert ckpt.checkpoint_id == "ckpt-000001"
    assert all("\n" not in str(w.message) for w in rec)
    ns: dict = {}
    ckpt.restore(ns)
    assert ns["v"] == {"k": 1} and ns["p"].v == "first" and torch.equal(ns["t"], torch.arange(10.0))


@pytest.mark.parametrize("name", ["t", "v", "p", "a", "__rng__"])
def test_one_flipped_byte_in_any_blob_falls_back(store, name, tmp_path):
    """One flipped byte in any kind of blob: the damaged checkpoint is skipped with a warning and
    the one before it loads."""
    two_checkpoints(store)
    path = blob_path(store, name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert_falls_back(store, r"ckpt-000002 is damaged \(blob .* does not match its hash")


def test_flipped_pickle_blob_is_never_unpickled(store, tmp_path):
    """A pickle blob replaced by a malicious pickle fails its hash and is never unpickled."""
    marker = tmp_path / "ran"
    store.save({"p": Opaque(1)}, ["p"])
    store.save({"p": Opaque(2)}, ["p"])
    evil = pickle.dumps(EvilPayload(str(marker)))
    path = blob_path(store, "p")
    path.write_bytes(evil[: path.stat().st_size].ljust(path.stat().st_size, b"."))
    with pytest.warns(CheckpointWarning):
        store.load().restore({})
    assert not marker.exists()


def test_truncated_blob_falls_back(store):
    """A truncated blob: the checkpoint before it loads."""
    two_checkpoints(store)
    path = blob_path(store, "t")
    path.write_bytes(path.read_bytes()[:-5])
    assert_falls_back(store, "truncated")


def test_missing_blob_falls_back(store):
    """A missing blob: the checkpoint before it loads."""
    two_checkpoints(store)
    blob_path(store, "v").unlink()
    assert_falls_back(store, "is missing")


@pytest.mark.parametrize("damage", [b"{ bad json", b"", b'{"body": 1}', b"[]"])
def test_bad_manifest_falls_back(store, damage):
    """A damaged manifest: the checkpoint before it loads."""
    two_checkpoints(store)
    (store.run_dir / "ckpt-000002" / "manifest.json").write_bytes(damage)
    assert_falls_back(store, "ckpt-000002 is damaged")


def test_edited_manifest_is_not_trusted(store):
    """A manifest edited without the key fails its signature: the checkpoint before it loads."""
    two_checkpoints(store)
    path = store.run_dir / "ckpt-000002" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["body"]["meta"] = {"edited": True}
    path.write_text(json.dumps(doc))
    assert_falls_back(store, "ckpt-000002 is not signed by this installation's key")


def test_manifest_from_another_installation(store, tmp_path):
    """A checkpoint signed with another key is refused (nothing unpickled), in one line that names
    trust=True; with trust it loads."""
    marker = tmp_path / "ran"
    foreign = CheckpointStore(store.run_dir, key=b"\x07" * 32)
    foreign.save({"p": EvilPayload(str(marker))}, ["p"])
    with pytest.warns(CheckpointWarning, match="not signed by this installation's key"):
        with pytest.raises(UntrustedCheckpointError) as info:
            store.load()
    message = str(info.value)
    assert "trust=True" in message and "\n" not in message
    assert not marker.exists()
    # the user trusts it explicitly: hashes are still checked, then it loads
    store.load(trust=True).restore({})
    assert marker.exists()


def test_foreign_checkpoint_falls_back_to_own(store):
    """A foreign-signed newest checkpoint is skipped for our own older one."""
    store.save({"v": {"k": 1}, "t": torch.arange(10.0), "p": Opaque("first"), "a": 1}, ["v", "t", "p", "a"])
    CheckpointStore(store.run_dir, key=b"\x07" * 32).save({"v": {"k": 2}}, ["v"])
    assert_falls_back(store, "ckpt-000002 is not signed")


def test_no_checkpoint_at_all(store):
    """No checkpoint, or none undamaged: one line that says so, naming the damaged one."""
    with pytest.raises(NoCheckpointError, match="no checkpoint in .* yet"):
        store.load()
    store.save({"a": 1}, ["a"])
    blob_path(store, "a").write_bytes(b"junk")
    with pytest.warns(CheckpointWarning, match="no older checkpoint is left"):
        with pytest.raises(NoCheckpointError) as info:
            store.load()
    assert "\n" not in str(info.value) and "ckpt-000001" in str(info.value)


def test_damaged_blob_is_set_aside_and_rewritten_by_the_next_save(store):
    """A blob found damaged is set aside, so the next save writes it again rather than reusing it."""
    ns = {"t": torch.arange(100.0)}
    store.save(ns, ["t"])
    path = blob_path(store, "t")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning), pytest.raises(NoCheckpointError):
        store.load()
    fresh = CheckpointStore(store.run_dir, key=KEY)
    assert fresh.save(ns, ["t"]).bytes_written > 400
    restored: dict = {}
    fresh.load().restore(restored)
    assert torch.equal(restored["t"], ns["t"])


FAULT_SCRIPT = """
import os, resource, signal, sys, torch
from colab_resilience.checkpoints import CheckpointStore
from colab_resilience.errors import CheckpointError
store = CheckpointStore(sys.argv[1], key=bytes(range(32)))
store.save({"t": torch.zeros(1000), "v": 1}, ["t", "v"])
{setup}
try:
    store.save({"t": torch.ones(1_000_000), "v": 2}, ["t", "v"])
except CheckpointError as e:
    print("ERROR", e)
else:
    print("SAVED")
"""


def check_fault(run_dir, out: str, errno_text: str):
    assert out.startswith("ERROR colab_resilience: checkpoint not written"), out
    assert errno_text in out and "checkpoint ckpt-000001 is intact" in out and out.count("\n") == 1
    store = CheckpointStore(run_dir, key=KEY)
    ckpt = store.load()
    assert ckpt.checkpoint_id == "ckpt-000001" and store.checkpoint_ids() == ["ckpt-000001"]
    ns: dict = {}
    ckpt.restore(ns)
    assert ns["v"] == 1 and torch.equal(ns["t"], torch.zeros(1000))
    leftovers = [p for p in store.run_dir.rglob("*") if ".tmp" in p.name]
    assert leftovers == []


def test_full_disk_during_a_write(tmp_path):
    """RLIMIT_FSIZE makes writes past 1 MiB fail with EFBIG, as a full disk fails with ENOSPC."""
    setup = (
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))"
    )
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", FAULT_SCRIPT.replace("{setup}", setup), str(run)],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    check_fault(run, proc.stdout, "File too large")


def _drop_root_file_powers():
    """In the child, before exec: root without CAP_DAC_OVERRIDE obeys permission bits."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(99)


def test_unwritable_run_directory(tmp_path):
    """chmod does not stop root, so as root the child runs without CAP_DAC_OVERRIDE (real EACCES)."""
    setup = "os.chmod(sys.argv[1], 0o500)"
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", FAULT_SCRIPT.replace("{setup}", setup), str(run)],
        env=child_env(), capture_output=True, text=True, timeout=120,
        preexec_fn=_drop_root_file_powers if os.geteuid() == 0 else None,
    )
    if proc.returncode == 99:
        pytest.skip("running as root without the right to drop CAP_DAC_OVERRIDE: cannot make a directory unwritable")
    assert proc.returncode == 0, proc.stderr
    os.chmod(run, 0o700)
    check_fault(run, proc.stdout, "Permission denied")


def test_run_directory_under_a_regular_file(tmp_path):
    """A run folder that cannot be created is one CheckpointError that says no earlier checkpoint
    exists."""
    (tmp_path / "file").write_text("x")
    store = CheckpointStore(tmp_path / "file" / "run", key=KEY)
    with pytest.raises(CheckpointError) as info:
        store.save({"a": 1}, ["a"])
    assert "Not a directory" in str(info.value) and "there is no earlier checkpoint" in str(info.value)
    with pytest.raises(NoCheckpointError):
        store.load()


@pytest.mark.parametrize("numel", [100_000, 1_000_000], ids=["page cache", "O_DIRECT"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, numel):
    """SIGKILL while a blob is being written (through the page cache, or directly: 4 MB): the last
    checkpoint loads, the next save cleans up."""
    run = tmp_path / "run"
    code = (
        "import os, signal, sys, torch\n"
        "from colab_resilience.checkpoints import CheckpointStore, blobs\n"
        "store = CheckpointStore(sys.argv[1], key=bytes(range(32)))\n"
        "store.save({'t': torch.zeros(10)}, ['t'])\n"
        "orig = blobs.write_all\n"
        "def dying(fd, data):\n"
        "    orig(fd, memoryview(data)[:4096])\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "blobs.write_all = dying\n"
        f"store.save({{'t': torch.ones({numel})}}, ['t'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(run)], env=child_env())
    assert proc.returncode == -signal.SIGKILL
    store = CheckpointStore(run, key=KEY)
    ns: dict = {}
    store.load().restore(ns)
    assert torch.equal(ns["t"], torch.zeros(10))
    store.save({"t": torch.ones(3)}, ["t"])
    store.wait()
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]


# -- across processes -------------------------------------------------------------------------------


def test_save_in_one_process_load_in_another(tmp_path):
    """What one process saves (module, AdamW state, values, arrays, meta, random states) another
    process restores exactly."""
    run = tmp_path / "run"
    home = tmp_path / "home"
    save = (
        "import sys, torch, numpy as np, random\n"
        "from colab_resilience.checkpoints import CheckpointStore\n"
        "torch.manual_seed(0); random.seed(0); np.random.seed(0)\n"
        "m = torch.nn.Linear(4, 3); opt = torch.optim.AdamW(m.parameters())\n"
        "m(torch.randn(2, 4)).sum().backward(); opt.step()\n"
        "ns = dict(m=m, opt=opt, hist=[(1, 0.5)], arr=np.arange(5.0))\n"
        "CheckpointStore(sys.argv[1]).save(ns, list(ns), meta={'epoch': 1})\n"
        "print(m.weight.detach().numpy().tobytes().hex(), random.random(), torch.rand(1).item())\n"
    )
    load = (
        "import sys, torch, random\n"
        "from colab_resilience.checkpoints import CheckpointStore\n"
        "m = torch.nn.Linear(4, 3); opt = torch.optim.AdamW(m.parameters())\n"
        "ns = dict(m=m, opt=opt)\n"
        "c = CheckpointStore(sys.argv[1]).load(); c.restore(ns)\n"
        "assert ns['hist'] == [(1, 0.5)] and c.meta == {'epoch': 1} and ns['arr'].sum() == 10\n"
        "assert len(opt.state) == 2\n"
        "print(m.weight.detach().numpy().tobytes().hex(), random.random(), torch.rand(1).item())\n"
    )
    env = child_env(COLAB_RESILIENCE_HOME=str(home))
    a = subprocess.run([sys.executable, "-c", save, str(run)], env=env, capture_output=True, text=True)
    assert a.returncode == 0, a.stderr
    b = subprocess.run([sys.executable, "-c", load, str(run)], env=env, capture_output=True, text=True)
    assert b.returncode == 0, b.stderr
    assert a.stdout == b.stdout


@pytest.mark.slow
def mapped_blob_files() -> set[str]:
    """Checkpoint blob files this process has mapped now (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[-1].strip() for line in f if "/blobs/" in line}


def test_large_blobs_are_mapped_to_verify_and_never_stay_mapped(store):
    """Safetensors blobs of MAP_AT_LEAST bytes or more are hashed through a file mapping; a
    module copies from it into its own parameters, everything else gets private memory, and once
    restored nothing keeps a blob file mapped (training writes go to memory, never to the file)."""
    n = blobs.MAP_AT_LEAST // 4 + 1024  # float32 elements: over the threshold
    torch.manual_seed(0)
    model = torch.nn.Linear(n // 64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, n // 64)).sum().backward()
    opt.step()
    t = torch.randn(n)
    ns = {"model": model, "opt": opt, "tied": {"a": t, "b": t[::2]}}
    store.save(ns, list(ns))
    ckpt = store.load()
    assert len(mapped_blob_files()) == 3  # verified in place, not read into a buffer
    torch.manual_seed(1)
    fresh = torch.nn.Linear(n // 64, 64)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    weight = fresh.weight
    back = {"model": fresh, "opt": fresh_opt}
    ckpt.restore(back)
    del ckpt
    assert mapped_blob_files() == set()  # restored values hold private memory only
    assert fresh.weight is weight and raw(fresh.weight) == raw(model.weight)
    for k, v in opt.state_dict()["state"][0].items():
        assert raw(fresh_opt.state_dict()["state"][0][k]) == raw(v)
    tied = back["tied"]
    assert tied["b"].untyped_storage().data_ptr() == tied["a"].untyped_storage().data_ptr()
    assert raw(tied["a"]) == raw(t) and raw(tied["b"]) == raw(t[::2])
    tied["a"].zero_()  # a write to the restored tensor ...
    fresh_opt.state_dict()["state"][0]["exp_avg"].zero_()
    again: dict = {"model": fresh, "opt": fresh_opt}
    store.load().restore(again)  # ... never reaches the checkpoint (it still verifies and holds t)
    assert raw(again["tied"]["a"]) == raw(t)
    assert raw(fresh_opt.state_dict()["state"][0]["exp_avg"]) == raw(opt.state_dict()["state"][0]["exp_avg"])


def test_one_flipped_byte_in_a_mapped_blob_falls_back(store):
    """A flipped byte in a blob large enough to be memory-mapped is caught too: the checkpoint
    before it loads."""
    n = blobs.MAP_AT_LEAST // 4 + 1024
    store.save({"t": torch.zeros(n)}, ["t"])
    store.save({"t": torch.ones(n)}, ["t"])
    path = blob_path(store, "t")
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - 4095)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
    with pytest.warns(CheckpointWarning, match=r"ckpt-000002 is damaged \(blob .* does not match its hash"):
        ckpt = store.load()
    assert ckpt.checkpoint_id == "ckpt-000001"
    ns: dict = {}
    ckpt.restore(ns)
    assert torch.equal(ns["t"], torch.zeros(n))


def _cached_bytes(path) -> int:
    """How many bytes of ``path`` the page cache holds (util-linux's fincore, mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.mark.parametrize("how", ["synchronous", "background", "buffered", "written through"])
def test_large_blobs_are_written_around_the_page_cache(tmp_path, monkeypatch, how):
    """A blob of 1 MiB or more goes to disk with O_DIRECT (none of it stays in the page cache),
    its odd-sized tail padded, then cut: it loads bit for bit in another store. Written through
    the page cache: with direct writes off, and for a background save's value that did not fit in
    staging memory (training waits for its write, not for its flush)."""
    from colab_resilience.checkpoints.staging import Budget, parse_budget
    from colab_resilience.saving import Saver

    if not blobs.direct_io(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT: blobs go through the page cache there")
    monkeypatch.setattr(blobs, "DIRECT_IO", how != "buffered")
    store = CheckpointStore(tmp_path / "run", key=KEY)
    t = torch.randn((3 << 20) // 4 + 13)  # not a whole number of 4 KiB blocks
    if how in ("background", "written through"):
        budget = Budget() if how == "background" else parse_budget("64KiB")
        saver = Saver(store, budget=budget, on_durable=lambda r, i: None, say=print)
        assert saver.save({"t": t}, ["t"], meta={}, info=None)
        saver.close()
        assert (saver.stats.written_through > 0) == (how == "written through")
    else:
        store.save({"t": t}, ["t"])
    path = blob_path(store, "t")
    size = path.stat().st_size
    assert size > 3 << 20 and size % 4096
    cached = _cached_bytes(path)
    if how in ("synchronous", "background"):
        assert cached == 0
    else:
        assert cached >= size
    ns: dict = {}
    CheckpointStore(tmp_path / "run", key=KEY).load().restore(ns)
    assert raw(ns["t"]) == raw(t)


def test_large_checkpoint_round_trip(tmp_path):
    """A 16-layer model and its AdamW state round-trip byte for byte; saving again unchanged writes
    almost nothing."""
    store = CheckpointStore(tmp_path / "run", key=KEY)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    store.save({"model": model, "opt": opt}, ["model", "opt"])
    again = store.save({"model": model, "opt": opt}, ["model", "opt"])
    assert again.bytes_written < 1 << 16
    fresh = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    store.load().restore({"model": fresh, "opt": fresh_opt})
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert raw(a) == raw(b)


class _Trainer:  # a class of the notebook's (its module is __main__ there; here it is set below)
    def __init__(self, model, opt):
        self.model, self.opt = model, opt


def test_the_tensors_each_saved_optimizer_steps_are_named_by_the_saved_models_parameters():
    """What a checkpoint keeps so that a resume can tell that the set-up cells, run again, joined an
    optimizer to other tensors (carried.joins): each optimizer among the saved names, also in a list,
    a dict or an object of the notebook's class, by the saved models' parameter names, None for a
    tensor none holds; a change, in words."""
    from colab_resilience import carried

    _Trainer.__module__ = "__main__"
    torch.manual_seed(0)
    gs = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)]
    opts = {"g": torch.optim.SGD(gs[0].parameters(), lr=0.1), "d": torch.optim.Adam(gs[1].parameters())}
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    trainer = _Trainer(model, torch.optim.SGD([{"params": model[1].parameters()}, {"params": model[0].parameters()}]))
    ns = {"gs": gs, "opts": opts, "trainer": trainer, "stale": torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1)}
    names = ["gs", "opts", "trainer", "stale"]
    recorded = carried.joins(ns, names)
    assert recorded == {
        "opts['g']": [[["gs[0]", "weight"], ["gs[0]", "bias"]]], "opts['d']": [[["gs[1]", "weight"], ["gs[1]", "bias"]]],
        "trainer.opt": [[["trainer.model", "1.weight"], ["trainer.model", "1.bias"]],
                        [["trainer.model", "0.weight"], ["trainer.model", "0.bias"]]],
        "stale": [[None, None]]}
    assert json.loads(json.dumps(recorded)) == recorded  # it goes into the checkpoint's meta
    assert carried.joins_changed(recorded, carried.joins(ns, names)) is None
    assert carried.joins_changed(None, carried.joins(ns, names)) is None  # a checkpoint of an earlier version

    ns["stale"] = torch.optim.SGD(gs[1].parameters(), lr=1)  # the set-up cells, run again, joined it to gs[1]
    model_again = "(a cell that makes the model run again after the one that makes the optimizer?)"
    assert carried.joins_changed(recorded, carried.joins(ns, names)) == (
        "stale steps the parameters of gs[1] now, where at the safe point it stepped tensors no saved model holds "
        + model_again)
    ns["stale"] = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1)
    trainer.opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}])
    assert carried.joins_changed(recorded, carried.joins(ns, names)) == (
        "trainer.opt steps the parameters of trainer.model in another order now, where at the safe point it "
        "stepped the parameters of trainer.model " + model_again)


def test_the_optimizer_each_saved_scheduler_drives_is_named_by_its_saved_name():
    """carried.joins for learning-rate schedulers: which saved optimizer each saved scheduler drives
    (also in a dict, and ReduceLROnPlateau, which older torch did not derive from LRScheduler), None
    for an optimizer no saved name holds; a scheduler joined to another optimizer, in words."""
    from colab_resilience import carried

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = torch.optim.SGD(model.parameters(), lr=0.1)  # an optimizer the user made again since
    scheds = {"step": torch.optim.lr_scheduler.StepLR(first, 1),
              "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}
    ns = {"model": model, "opt": opt, "scheds": scheds}
    recorded = carried.joins(ns, ["model", "opt", "scheds"])
    assert recorded == {"opt": [[["model", "weight"], ["model", "bias"]]],
                        "scheds['step']": {"drives": None}, "scheds['plateau']": {"drives": "opt"}}
    assert json.loads(json.dumps(recorded)) == recorded  # it goes into the checkpoint's meta
    assert carried.joins_changed(recorded, carried.joins(ns, ["model", "opt", "scheds"])) is None
    scheds["step"] = torch.optim.lr_scheduler.StepLR(opt, 1)  # the replay joined it to the optimizer that trains
    assert carried.joins_changed(recorded, carried.joins(ns, ["model", "opt", "scheds"])) == (
        "scheds['step'] drives opt now, where at the safe point it drove an optimizer no saved name holds (a cell "
        "that makes the optimizer run again after the one that makes the scheduler?)")
    # a scheduler saved without its optimizer drives none of the names, in every kernel alike
    alone = {"sched": torch.optim.lr_scheduler.StepLR(opt, 1)}
    assert carried.joins(alone, ["sched"]) == {"sched": {"drives": None}}
