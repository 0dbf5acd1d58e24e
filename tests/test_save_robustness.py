"""Saves that fail, and values that are hard to save: descriptors and disk space always come back,
many names fit under the descriptor limit, every value that cannot be saved is one line, and
masked arrays and nested tensors come back exactly (issue 17, items 4 and 5).

Real file systems and real limits only: a small tmpfs, RLIMIT_FSIZE, RLIMIT_NOFILE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

from colab_resilience.checkpoints import CheckpointStore, tree_hash
from colab_resilience.errors import CheckpointError, UnsaveableValueError
from harness import child_env
from payloads import raw, roundtrip

KEY = bytes(range(32))


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "run", key=KEY)


def open_descriptors() -> dict[int, str]:
    """This process's open file descriptors and what each points to."""
    out = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            out[int(n)] = os.readlink(f"/proc/self/fd/{n}")
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    return out


# -- a full disk: every descriptor closed, the space given back -------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs, unmounted afterwards (skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip() or proc.returncode}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def test_saves_failing_on_a_full_tmpfs_give_back_descriptors_and_space(small_disk):
    """Ten saves that do not fit on an 8 MiB tmpfs each fail with one line, keep the previous
    checkpoint, and leave no descriptor open and no space held (no unlinked-but-open temporary
    file): the free space is what it was before each. Then a save that fits succeeds and loads back
    bit for bit."""
    store = CheckpointStore(small_disk / "run", key=KEY)
    first = {"t": torch.arange(1000, dtype=torch.float32), "v": 1}
    store.save(first, ["t", "v"])
    store.wait()
    free_before = free_bytes(small_disk)
    fds_before = open_descriptors()
    for attempt in range(10):
        # a few small new blobs are written (and pending) before the one that does not fit
        ns = {f"s{i}": torch.full((5000,), float(attempt * 10 + i)) for i in range(4)}
        ns["big"] = torch.full((3 << 20,), float(attempt))  # 12 MiB
        with pytest.raises(CheckpointError) as info:
            store.save(ns, list(ns))
        message = str(info.value)
        assert message.startswith("colab_resilience: checkpoint not written"), message
        assert "No space left on device" in message and "checkpoint ckpt-000001 is intact" in message
        assert "\n" not in message
        store.wait()
        assert open_descriptors() == fds_before, f"attempt {attempt}: a descriptor was left open"
        assert free_bytes(small_disk) == free_before, f"attempt {attempt}: space held after the failure"
        assert store.checkpoint_ids() == ["ckpt-000001"]
        assert not [p for p in store.run_dir.rglob("*") if ".tmp" in p.name]
    fits = {"t": torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)), "v": 2}  # 4 MiB
    store.save(fits, ["t", "v"])
    ns: dict = {}
    CheckpointStore(store.run_dir, key=KEY).load().restore(ns, rng=False)
    assert ns["v"] == 2 and raw(ns["t"]) == raw(fits["t"])
    assert not [fd for fd, target in open_descriptors().items() if str(small_disk) in target]


FSIZE_SCRIPT = r"""
import json, os, resource, signal, sys, torch
from colab_resilience.checkpoints import CheckpointStore
from colab_resilience.errors import CheckpointError

def descriptors():
    out = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            out[n] = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            pass
    return out

run = sys.argv[1]
store = CheckpointStore(run, key=bytes(range(32)))
store.save({"t": torch.zeros(1000), "v": 1}, ["t", "v"])
store.wait()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
before = descriptors()
report = {"messages": [], "leaks": []}
for attempt in range(10):
    ns = {f"s{i}": torch.full((5000,), float(attempt * 10 + i)) for i in range(4)}
    ns["big"] = torch.full((1 << 20,), float(attempt))  # 4 MiB: past the 1 MiB limit
    try:
        store.save(ns, list(ns))
    except CheckpointError as e:
        report["messages"].append(str(e))
    else:
        report["messages"].append("SAVED")
    store.wait()
    now = descriptors()
    if now != before:
        report["leaks"].append({"attempt": attempt, "open": sorted(set(now.values()) - set(before.values()))})
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
fits = torch.arange(1 << 20, dtype=torch.float32)
store.save({"t": fits, "v": 2}, ["t", "v"])
ns = {}
CheckpointStore(run, key=bytes(range(32))).load().restore(ns, rng=False)
report["restored"] = ns["v"] == 2 and torch.equal(ns["t"], fits)
report["deleted_open"] = [t for t in descriptors().values() if "(deleted)" in t]
print(json.dumps(report))
"""


def test_saves_failing_past_rlimit_fsize_leave_no_descriptor_open(tmp_path):
    """RLIMIT_FSIZE (no root needed) makes blob writes fail with EFBIG, as a full disk fails:
    ten failed saves, each one line with the previous checkpoint kept, leave exactly the
    descriptors there were before; a save under the old limit then succeeds and loads back."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(run)], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["messages"]) == 10
    for m in report["messages"]:
        assert m.startswith("colab_resilience: checkpoint not written") and "File too large" in m, m
        assert "checkpoint ckpt-000001 is intact" in m and "\n" not in m
    assert report["leaks"] == []
    assert report["restored"] is True and report["deleted_open"] == []
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]


def test_a_failed_rename_closes_every_descriptor(store):
    """A blob that cannot be renamed into place (a folder holds its name) fails the save in one
    line; every temporary blob of that save is closed and removed."""
    store.save({"v": 0}, ["v"])
    blocked = store.blob_dir / tree_hash(b"1")  # the blob of the value 1 (tagged JSON: b"1")
    (blocked / "x").mkdir(parents=True)
    ns = {f"a{i}": torch.full((100,), float(i)) for i in range(5)}
    ns["v"] = 1
    store.wait()  # the first save's trash, emptied in the background
    fds = open_descriptors()
    with pytest.raises(CheckpointError) as info:
        store.save(ns, list(ns))
    assert "Is a directory" in str(info.value) and "checkpoint ckpt-000001 is intact" in str(info.value)
    store.wait()
    assert open_descriptors() == fds
    assert not [p for p in store.blob_dir.iterdir() if p.name.startswith(".tmp-")]


# -- many names in one save -------------------------------------------------------------------------


MANY_NAMES_SCRIPT = r"""
import resource, sys, torch, numpy as np
from colab_resilience.checkpoints import CheckpointStore
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
n = int(sys.argv[2])

def value(i, generation):
    kind = i % 3
    if kind == 0:
        return torch.full((4,), float(i + generation))
    if kind == 1:
        return np.full(3, i + generation, dtype=np.int32)
    return i + generation

ns = {f"v{i}": value(i, 0) for i in range(n)}
store = CheckpointStore(sys.argv[1], key=bytes(range(32)))
report = store.save(ns, list(ns))
assert len(report.names) == n and not report.skipped
for i in range(0, n, 7):  # change some, and save again
    ns[f"v{i}"] = value(i, 1)
store.save(ns, list(ns))
# a fresh store, as a new process has: every blob is written again to a temporary file first
CheckpointStore(sys.argv[1], key=bytes(range(32))).save(ns, list(ns))
out = {}
CheckpointStore(sys.argv[1], key=bytes(range(32))).load().restore(out, rng=False)
for i in range(n):
    a, b = ns[f"v{i}"], out[f"v{i}"]
    assert type(a) is type(b), i
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), i
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), i
    else:
        assert a == b, i
print("OK", len(out))
"""


def test_many_names_in_one_save_stay_under_the_descriptor_limit(tmp_path):
    """2,000 top-level names (tensors, arrays, ints: a blob each) saved under a soft limit of 256
    open files, three times (first, changed, from a fresh store), and loaded back exactly: a blob's
    file is not kept open until the commit."""
    proc = subprocess.run([sys.executable, "-c", MANY_NAMES_SCRIPT, str(tmp_path / "run"), "2000"],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["OK", "2000"]


# -- values that cannot be saved: one line, whatever they raise ---------------------------------------


class StateDictPropertyRaises:
    @property
    def state_dict(self):
        raise RuntimeError("the weights live on a device that is gone")

    def load_state_dict(self, sd):
        pass


class LoadStateDictPropertyRaises:
    def state_dict(self):
        return {}

    @property
    def load_state_dict(self):
        raise NotImplementedError("read-only")


class GetattrRaisesValueError:
    def __getattr__(self, name):
        raise ValueError(f"no field {name}")


class DictBackedConfig:
    """``__getattr__`` over a dict: a missing attribute raises KeyError, not AttributeError."""

    def __init__(self):
        self.__dict__["data"] = {"lr": 0.1}

    def __getattr__(self, name):
        return self.__dict__["data"][name]


class ClassPropertyRaises:
    @property
    def __class__(self):
        raise RuntimeError("the proxy is closed")


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message either")


class StateDictRaisesUnprintable:
    def state_dict(self):
        raise Unprintable()

    def load_state_dict(self, sd):
        pass


class _Target:
    pass


def dead_proxy():
    target = _Target()
    proxy = weakref.proxy(target)
    del target
    return proxy  # every attribute lookup raises ReferenceError


UNSAVEABLE = {
    "sd_property": (StateDictPropertyRaises, "RuntimeError: the weights live on a device that is gone"),
    "load_sd_property": (LoadStateDictPropertyRaises, "NotImplementedError: read-only"),
    "getattr_value_error": (GetattrRaisesValueError, "ValueError: no field"),
    "config": (DictBackedConfig, "KeyError"),
    "class_property": (ClassPropertyRaises, "RuntimeError: the proxy is closed"),
    "unprintable": (StateDictRaisesUnprintable, "Unprintable"),
    "dead_proxy": (dead_proxy, "ReferenceError"),
}


def test_values_raising_anything_while_inspected_are_one_line_and_the_rest_is_saved(store):
    """Objects whose ``state_dict``/``load_state_dict`` property, ``__getattr__`` or ``__class__``
    raises (RuntimeError, ValueError, KeyError, ReferenceError of a dead weak proxy, an exception
    that cannot even be printed) are each named as not saveable in one line, with the type, the
    error and what to do; the other names are saved. With ``strict`` the first one raises
    UnsaveableValueError (never a raw traceback) and nothing is written."""
    ns = {name: make() for name, (make, _) in UNSAVEABLE.items()}
    ns["ok"] = {"a": torch.arange(3)}
    report = store.save(ns, list(ns))
    assert report.names == ["ok"]
    assert set(report.skipped) == set(UNSAVEABLE)
    for name, (_, error) in UNSAVEABLE.items():
        message = report.skipped[name]
        assert message.startswith(f"colab_resilience: cannot save {name!r}: "), message
        assert "objects cannot be checkpointed (" in message and error in message, message
        assert message.endswith("or leave it out of --save") and "\n" not in message, message
    other = CheckpointStore(store.run_dir.parent / "strict", key=KEY)
    for name in UNSAVEABLE:
        with pytest.raises(UnsaveableValueError) as info:
            other.save(ns, [name, "ok"], strict=True)
        assert info.value.name == name and "\n" not in str(info.value)
    assert other.latest_id() is None


class StateDictOOM:
    def __init__(self, error):
        self.error = error

    def state_dict(self):
        raise self.error

    def load_state_dict(self, sd):
        pass


class PickleOOM:
    def __reduce_ex__(self, protocol):
        raise MemoryError()


class GetattrInterrupted:
    def __getattr__(self, name):
        raise KeyboardInterrupt


@pytest.mark.parametrize("value, expected", [
    (StateDictOOM(MemoryError()), MemoryError),
    (StateDictOOM(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")), RuntimeError),
    (StateDictOOM(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 8589934592 bytes")), RuntimeError),
    (PickleOOM(), MemoryError),
    (GetattrInterrupted(), KeyboardInterrupt),
], ids=["MemoryError", "cuda-oom", "cpu-oom", "pickle-MemoryError", "KeyboardInterrupt"])
def test_out_of_memory_and_interrupts_while_saving_are_not_called_unsaveable(store, value, expected):
    """Running out of memory while a value is prepared is an OOM (the package's OOM handling must
    see it), and Ctrl-C is Ctrl-C: neither becomes a 'cannot save' line. Nothing is written, and
    the store saves normally afterwards."""
    with pytest.raises(expected) as info:
        store.save({"x": value, "ok": 1}, ["x", "ok"])
    assert not isinstance(info.value, UnsaveableValueError)
    assert store.latest_id() is None
    store.save({"ok": 1}, ["ok"])
    assert store.load().names == ["ok"]


# -- nested tensors -----------------------------------------------------------------------------------


def assert_same_nested(a, b):
    assert b.is_nested and type(b) is type(a) and b.layout == a.layout
    assert b.dtype == a.dtype and b.device == a.device and b.requires_grad == a.requires_grad
    if a.layout == torch.strided:
        assert torch.equal(b._nested_tensor_size(), a._nested_tensor_size())
        assert torch.equal(b._nested_tensor_strides(), a._nested_tensor_strides())
        assert torch.equal(b._nested_tensor_storage_offsets(), a._nested_tensor_storage_offsets())
        assert b.is_contiguous() == a.is_contiguous()
    parts_a, parts_b = a.detach().unbind(), b.detach().unbind()
    assert len(parts_a) == len(parts_b)
    for x, y in zip(parts_a, parts_b):
        assert x.shape == y.shape and x.stride() == y.stride() and raw(x) == raw(y)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_round_trip_exactly(store):
    """Nested tensors (torch.nested, strided and jagged layouts), alone or inside a container,
    are saved and come back bit for bit with their sizes, strides, offsets, dtype, device and
    requires_grad."""
    g = torch.Generator().manual_seed(0)
    values = {
        "nt": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        "grad": torch.nested.nested_tensor([torch.randn(2, 3, generator=g), torch.randn(4, 3, generator=g)],
                                           dtype=torch.float64, requires_grad=True),
        "transposed": torch.nested.nested_tensor([torch.randn(2, 3, generator=g),
                                                  torch.randn(5, 3, generator=g)]).transpose(1, 2),
        "jagged": torch.nested.nested_tensor([torch.randn(2, 4, generator=g), torch.randn(3, 4, generator=g)],
                                             layout=torch.jagged),
    }
    values["inside"] = {"batch": values["nt"], "step": 3}
    report = store.save(values, list(values))
    assert report.names == list(values) and not report.skipped
    ns: dict = {}
    CheckpointStore(store.run_dir, key=KEY).load().restore(ns, rng=False)
    for name in ("nt", "grad", "transposed", "jagged"):
        assert_same_nested(values[name], ns[name])
    assert ns["inside"]["step"] == 3
    assert_same_nested(values["nt"], ns["inside"]["batch"])


# -- masked arrays --------------------------------------------------------------------------------------


def assert_same_masked(a, b):
    assert type(b) is type(a)
    assert b.dtype == a.dtype and b.shape == a.shape
    if a.dtype.hasobject:  # the bytes of an object array are addresses
        assert np.asarray(b).tolist() == np.asarray(a).tolist()
    else:
        assert np.asarray(b).tobytes("A") == np.asarray(a).tobytes("A")
    assert np.asarray(b).flags.f_contiguous == np.asarray(a).flags.f_contiguous
    if a.mask is np.ma.nomask:
        assert b.mask is np.ma.nomask, f"'no mask' came back as {b.mask!r}"
    else:
        assert b.mask is not np.ma.nomask
        assert b.mask.dtype == a.mask.dtype and b.mask.shape == a.mask.shape
        assert b.mask.tobytes() == a.mask.tobytes()
    assert b.hardmask == a.hardmask
    fill_a, fill_b = np.asarray(a.fill_value), np.asarray(b.fill_value)
    assert fill_b.dtype == fill_a.dtype
    assert fill_b.tolist() == fill_a.tolist() if a.dtype.hasobject else fill_b.tobytes() == fill_a.tobytes()


def masked_arrays() -> dict:
    data = np.arange(12.0).reshape(3, 4)
    return {
        "nomask": np.ma.masked_array([1, 2, 3]),
        "nomask_float": np.ma.masked_array(np.linspace(0, 1, 7, dtype=np.float32)),
        "all_false": np.ma.masked_array([1, 2, 3], mask=[False, False, False]),
        "masked": np.ma.masked_array(data, mask=data % 5 == 0, fill_value=-1.5, hard_mask=True),
        "fortran": np.ma.masked_array(np.asfortranarray(data), mask=np.asfortranarray(data > 6),
                                      fill_value=7.0),
        "ints": np.ma.masked_array(np.arange(5, dtype=np.int16), mask=[0, 1, 0, 1, 0]),
        "objects": np.ma.masked_array(np.array([{"a": 1}, None, "x"], dtype=object)),
        "records": np.ma.masked_array(np.array([(1, 2.0), (3, 4.0)], dtype=[("i", "i4"), ("f", "f8")]),
                                      mask=[(True, False), (False, True)]),
    }


@pytest.mark.parametrize("name", list(masked_arrays()))
def test_masked_arrays_round_trip_their_mask_exactly(store, name):
    """A NumPy masked array comes back with its mask exactly: 'no mask' (``np.ma.nomask``) stays
    'no mask', not a full False mask, and a real mask (all False included) stays that mask; the
    data bit for bit, dtype, memory order, fill value and hard-mask flag too."""
    a = masked_arrays()[name]
    assert_same_masked(a, roundtrip(store, a))


def test_masked_arrays_inside_containers_and_the_masked_constant(store):
    """Masked arrays inside a container come back exactly too, and ``np.ma.masked`` stays the
    one masked constant."""
    arrays = masked_arrays()
    value = {"arrays": [arrays["nomask"], arrays["masked"]], "m": np.ma.masked, "step": 4}
    back = roundtrip(store, value)
    assert_same_masked(arrays["nomask"], back["arrays"][0])
    assert_same_masked(arrays["masked"], back["arrays"][1])
    assert back["m"] is np.ma.masked and back["step"] == 4
