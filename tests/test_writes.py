"""Write tracking (colab_resilience.writes) on real memory, and what a checkpoint store does with it.

Every write below is a real write by the CPU (or by the kernel on the process's behalf) into real
memory; whether it was seen is what the kernel's page tables say. The store tests then check the
only thing that matters to a user: whatever wrote a byte, the next checkpoint holds it, and a save
after which nothing was written reads (almost) nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from colab_resilience import state as smod
from colab_resilience import writes
from colab_resilience.state import CheckpointStore
from kernels import child_env

KEY = bytes(range(32))
PAGE = writes.PAGE
TRACKER = writes.tracker()
needs_tracking = pytest.mark.skipif(
    TRACKER is None, reason="this kernel cannot track writes (needs Linux >= 6.7 and userfaultfd)"
)


def pages(a: np.ndarray) -> tuple[int, int]:
    """The whole pages inside ``a``'s memory."""
    lo = -(-a.ctypes.data // PAGE) * PAGE
    return lo, (a.ctypes.data + a.nbytes) // PAGE * PAGE


def claim(a: np.ndarray, owner: int = 99) -> writes.Claim:
    [c] = TRACKER.claim([pages(a)], owner)
    assert c is not None
    return c


@pytest.fixture(autouse=True)
def _no_claims_left():
    yield
    if TRACKER is not None:
        TRACKER.retain(99, [])


def write_numpy(a):
    a[len(a) // 2] = 7


def write_ctypes(a):
    ctypes.memset(a.ctypes.data + a.nbytes // 3, 7, 1)


def write_readv(a):
    fd = os.open(sys.executable, os.O_RDONLY)
    try:
        os.preadv(fd, [memoryview(a).cast("B")[a.nbytes // 2 : a.nbytes // 2 + 1]], 0)
    finally:
        os.close(fd)


def write_proc_mem(a):  # how debuggers write: the kernel's remote-access path
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(a.ctypes.data + a.nbytes // 4)
        mem.write(b"\x07")


def write_thread(a):
    t = threading.Thread(target=write_numpy, args=(a,))
    t.start()
    t.join()


def write_torch_data(a):
    t = torch.from_numpy(a)
    t.data[-PAGE] += 1  # .data: autograd's version counter does not see this


def write_torch_kernel(a):
    torch.from_numpy(a).mul_(2.0)


WRITERS = [write_numpy, write_ctypes, write_readv, write_proc_mem, write_thread, write_torch_data, write_torch_kernel]


@needs_tracking
@pytest.mark.parametrize("write", WRITERS, ids=lambda f: f.__name__)
def test_a_write_of_one_byte_by_any_means_is_seen_and_nothing_else_is(write):
    a = np.ones(1 << 20, np.float32)
    b = np.ones(1 << 20, np.float32)
    ca, cb = claim(a), claim(b)
    assert TRACKER.clean(ca) and TRACKER.clean(cb)
    a.sum(), b.copy()  # reading is not writing
    assert TRACKER.clean(ca) and TRACKER.clean(cb)
    write(a)
    assert not TRACKER.clean(ca)
    assert TRACKER.clean(cb)


@needs_tracking
def test_an_overlapping_claim_revokes_the_older_one():
    """Claiming write-protects the pages again, erasing any record of writes: an older claim on
    any of them must not vouch for them afterwards."""
    a = np.ones(1 << 20, np.float32)
    old = claim(a)
    write_numpy(a)
    lo, hi = pages(a)
    [new] = TRACKER.claim([(lo + PAGE, lo + 3 * PAGE)], 99)
    assert new is not None and TRACKER.clean(new)
    assert not old.valid and not TRACKER.clean(old)


@needs_tracking
def test_memory_other_processes_or_files_can_change_is_never_claimed(tmp_path):
    shared = mmap.mmap(-1, 16 * PAGE)  # MAP_SHARED
    view = (ctypes.c_char * (16 * PAGE)).from_buffer(shared)
    addr = ctypes.addressof(view)
    mapped = np.memmap(tmp_path / "f.bin", dtype=np.uint8, mode="w+", shape=(16 * PAGE,))
    torch_shared = torch.ones(1 << 20).share_memory_()
    t_lo = -(-torch_shared.data_ptr() // PAGE) * PAGE
    got = TRACKER.claim(
        [(addr, addr + 16 * PAGE), pages(mapped), (t_lo, t_lo + 16 * PAGE), (addr + 1, addr + PAGE + 1)], 99
    )
    assert got == [None, None, None, None]
    del view


@needs_tracking
def test_release_and_retain_stop_tracking():
    a, b = np.ones(1 << 18, np.float32), np.ones(1 << 18, np.float32)
    ca, cb = claim(a), claim(b)
    TRACKER.retain(99, [cb])
    assert not ca.valid and TRACKER.claims_of(99) == [cb]
    TRACKER.release([cb])
    assert TRACKER.claims_of(99) == [] and not TRACKER.clean(cb)


@needs_tracking
def test_a_forked_child_cannot_vouch_for_its_parents_memory_nor_disturb_it():
    a = np.ones(1 << 20, np.float32)
    c = claim(a)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the memory is not tracked, and its tracker is its own
        try:
            write_numpy(a)
            answer = b"%d%d" % (TRACKER.clean(c), writes.tracker() is not TRACKER)
            TRACKER.release([c])
            os.write(w, answer)
        finally:
            os._exit(0)
    os.close(w)
    answer = os.read(r, 2)
    os.waitpid(pid, 0)
    assert answer == b"01"
    assert c.valid and TRACKER.clean(c)  # the child's write went to its own copy
    write_ctypes(a)
    assert not TRACKER.clean(c)


def test_tracking_is_on_wherever_the_kernel_offers_it():
    """The probe must not turn tracking off by mistake: where the system call and the API with
    asynchronous write-protect both work, so must the tracker."""
    nr = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine)
    if nr is None:
        pytest.skip("userfaultfd's number is not known here")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, os.O_CLOEXEC)
    if fd < 0:
        pytest.skip(f"userfaultfd refused: {os.strerror(ctypes.get_errno())}")
    try:
        import fcntl
        import struct

        api = bytearray(struct.pack("QQQ", 0xAA, (1 << 15) | (1 << 13), 0))
        try:
            fcntl.ioctl(fd, (3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F, api, True)
        except OSError as e:
            pytest.skip(f"no asynchronous write-protect in this kernel: {e}")
    finally:
        os.close(fd)
    if not os.path.exists("/proc/self/pagemap"):
        pytest.skip("no /proc")
    assert TRACKER is not None


def test_tracking_can_be_turned_off():
    code = "from colab_resilience import writes; print(writes.tracker())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(COLAB_RESILIENCE_WRITE_TRACKING="0"),
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "None"


# -- the checkpoint store ---------------------------------------------------------------------------


@pytest.fixture(params=["tracked", "fingerprinted"])
def tracking(request):
    """Both ways a store finds what changed: the kernel's word, or reading every byte."""
    if request.param == "tracked" and TRACKER is None:
        pytest.skip("this kernel cannot track writes")
    return request.param


def new_store(tmp_path, tracking="tracked"):
    return CheckpointStore(tmp_path / "run", key=KEY, track_writes=tracking == "tracked")


def namespace():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()
    return {"model": model, "opt": opt, "table": np.random.default_rng(0).random((512, 1024)), "note": "x"}


def tensor_bytes(t) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def restored(store) -> dict:
    fresh = namespace()
    fresh["model"].apply(lambda m: torch.nn.init.zeros_(m.weight) if hasattr(m, "weight") else None)
    store.load().restore(fresh)
    return fresh


def adam_state(ns):
    return ns["opt"].state[ns["opt"].param_groups[0]["params"][2]]["exp_avg"]


CHANGES = {
    "param .data": lambda ns: ns["model"][0].weight.data.__setitem__((300, 5), 9.0),
    "param via numpy": lambda ns: ns["model"][2].weight.detach().numpy().__setitem__((1, 1), -9.0),
    "optimizer state via ctypes": lambda ns: ctypes.memset(adam_state(ns).data_ptr() + 4 * 70_001, 0x41, 1),
    "array from a thread": lambda ns: write_thread(ns["table"].reshape(-1)),
    "load_state_dict": lambda ns: ns["model"].load_state_dict(
        {k: v + 1 for k, v in ns["model"].state_dict().items()}
    ),
    "name rebound": lambda ns: ns.__setitem__("table", ns["table"] + 1),
}


@pytest.mark.parametrize("change", CHANGES, ids=str)
def test_every_write_is_in_the_next_checkpoint(tmp_path, tracking, change):
    ns = namespace()
    names = ["model", "opt", "table", "note"]
    store = new_store(tmp_path, tracking)
    store.save(ns, names)
    unchanged = store.save(ns, names)
    assert unchanged.bytes_written < 4096
    CHANGES[change](ns)
    report = store.save(ns, names)
    assert report.bytes_written > 4096
    back = restored(store)
    for a, b in zip(back["model"].state_dict().values(), ns["model"].state_dict().values()):
        assert tensor_bytes(a) == tensor_bytes(b)
    assert tensor_bytes(adam_state(back)) == tensor_bytes(adam_state(ns))
    assert back["table"].tobytes() == ns["table"].tobytes()
    again = store.save(ns, names)  # and nothing is written twice
    assert again.bytes_written < 4096


def test_a_save_after_which_nothing_was_written_reads_almost_nothing(tmp_path, tracking):
    ns = namespace()
    names = ["model", "opt", "table", "note"]
    store = new_store(tmp_path, tracking)
    first = store.save(ns, names)
    second = store.save(ns, names)
    assert first.bytes_read >= first.bytes_written - 4096
    if tracking == "tracked":  # the small tensors and the pages at the ends of the large ones
        assert second.bytes_read < 0.02 * first.bytes_written
    else:  # one fingerprint pass over everything
        assert second.bytes_read >= first.bytes_written - 4096


@needs_tracking
def test_memory_training_rewrites_is_not_kept_write_protected(tmp_path):
    """A chunk found written at a save is hashed and released (no write fault per page every
    epoch); once it stops changing it is tracked again."""
    ns = namespace()
    w = ns["model"][0].weight  # 2 MiB: one chunk of the model's blob
    store = new_store(tmp_path)

    def claimed() -> bool:
        lo = w.data_ptr()
        return any(c.start <= lo + PAGE and lo + w.nbytes - PAGE <= c.end for c in TRACKER.claims_of(store._token))

    store.save(ns, ["model"])
    assert claimed()
    for _ in range(2):  # training: written before every save
        w.data.add_(1.0)
        store.save(ns, ["model"])
        assert not claimed()
    quiet = store.save(ns, ["model"])  # unchanged: hashed once more, found equal
    assert quiet.bytes_read >= w.nbytes and not claimed()
    store.save(ns, ["model"])  # claimed again (and hashed: its past is unknown)
    assert claimed()
    assert store.save(ns, ["model"]).bytes_read < w.nbytes // 8
    back: dict = {"model": namespace()["model"]}
    store.load().restore(back)
    assert tensor_bytes(back["model"][0].weight) == tensor_bytes(w)


@needs_tracking
def test_a_store_that_is_gone_or_cleared_leaves_no_claims(tmp_path):
    ns = namespace()
    store = new_store(tmp_path)
    store.save(ns, ["model", "table"])
    token = store._token
    assert TRACKER.claims_of(token)
    store.clear()
    assert TRACKER.claims_of(token) == []
    store.save(ns, ["model", "table"])
    assert TRACKER.claims_of(token)
    del store
    import gc

    gc.collect()
    assert TRACKER.claims_of(token) == []


@needs_tracking
def test_pinned_and_copied_memory_is_fingerprinted_not_tracked(tmp_path):
    """A non-contiguous tensor is saved from a copy made for the save: tracking the copy would
    say nothing about the tensor."""
    base = torch.randn(1024, 1024)
    ns = {"t": base.t()}  # a transposed view: copied to be saved
    store = new_store(tmp_path)
    store.save(ns, ["t"])
    assert TRACKER.claims_of(store._token) == []
    second = store.save(ns, ["t"])
    assert second.bytes_read >= base.nbytes
    base[3, 4] = 1e6
    store.save(ns, ["t"])
    back: dict = {}
    store.load().restore(back)
    assert torch.equal(back["t"], base.t())
    assert smod._TRACK_AT_LEAST <= base.nbytes


@pytest.mark.kernel
def test_in_a_kernel_a_write_autograd_does_not_see_reaches_a_fresh_kernel(kernel, tmp_path):
    setup = (
        "import hashlib, torch\n"
        "from colab_resilience import writes\n"
        "from colab_resilience.state import CheckpointStore\n"
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
    first, quiet, changed, tracked = kernel.value(
        "[(r.bytes_written, r.bytes_read) for r in (first, quiet, changed)] + [writes.tracker() is not None]"
    )
    assert quiet[0] < 4096 and changed[0] > 4 << 20
    if tracked:
        assert quiet[1] < first[1] // 50
    saved = kernel.value("digest()")
    kernel.restart()
    kernel.ok(setup)
    assert kernel.value("digest()") != saved
    kernel.ok("store.load().restore(globals())")
    assert kernel.value("digest()") == saved
    assert kernel.value("float(w.weight[700, 9])") == 123.0


def test_a_learning_rate_printed_longer_moves_no_chunk(tmp_path, tracking):
    """The optimizer's param_groups live in its blob's header; a learning rate with more digits
    must not shift the data behind it (its chunks would all look new): the data starts at a
    4 KiB boundary."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(2048, 2048)
        opt = torch.optim.AdamW(model.parameters(), lr=0.001)
        model(torch.randn(4, 2048)).sum().backward()
        opt.step()
        return {"opt": opt}

    ns = build()
    store = new_store(tmp_path, tracking)
    store.save(ns, ["opt"])
    store.save(ns, ["opt"])
    ns["opt"].param_groups[0]["lr"] = 0.0009000000000000001
    report = store.save(ns, ["opt"])
    assert report.bytes_written > 4 * smod.CHUNK  # the header changed: a new blob (32 MiB of state)
    if tracking == "tracked":  # the chunk holding the header, and no other
        assert report.bytes_read <= smod.CHUNK + (1 << 20)
    back = build()
    store.load().restore(back)
    assert back["opt"].param_groups[0]["lr"] == 0.0009000000000000001
    state, state_back = ns["opt"].state_dict()["state"][0], back["opt"].state_dict()["state"][0]
    assert all(tensor_bytes(state[k]) == tensor_bytes(state_back[k]) for k in ("exp_avg", "exp_avg_sq"))


@needs_tracking
def test_memory_training_rewrites_stays_unclaimed_when_the_blob_layout_moves(tmp_path):
    ns = namespace()
    model, opt = ns["model"], ns["opt"]
    store = new_store(tmp_path)

    def claimed_state() -> int:  # bytes of AdamW's state under this store's claims
        spans = [(c.start, c.end) for c in TRACKER.claims_of(store._token)]
        tensors = [v for st in opt.state.values() for v in st.values() if v.numel() > 1]
        return sum(t.nbytes for t in tensors if any(a <= t.data_ptr() + PAGE < b for a, b in spans))

    store.save(ns, ["opt"])
    assert claimed_state() > 0
    for note in ("x" * 5000, "y" * 10000, "z" * 15000):  # each moves the data by a page or more
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
        opt.param_groups[0]["note"] = note
        store.save(ns, ["opt"])
        assert claimed_state() == 0
    back = namespace()
    store.load().restore(back)
    assert back["opt"].param_groups[0]["note"] == "z" * 15000
    assert tensor_bytes(adam_state(back)) == tensor_bytes(adam_state(ns))


def test_status_says_when_tracking_is_turned_off():
    code = "from colab_resilience import writes; print(writes.describe())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(COLAB_RESILIENCE_WRITE_TRACKING="off"),
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == (
        "unchanged tensors and arrays: found by a fingerprint of every byte "
        "(write tracking turned off by COLAB_RESILIENCE_WRITE_TRACKING)"
    )
