"""Reliability trials: SIGKILL during checkpoint writes, chaos runs under the supervisor, crash loops.

    python benchmarks/reliability.py kill-writes [--trials 200] [--size-mb 300] [--dir DIR] [--seed S] [--background]
    python benchmarks/reliability.py chaos       [--runs 1] [--kills 8] [--epochs 8] [--width 1024] [--pause S] [--seed S] [--no-standby]
    python benchmarks/reliability.py crash-loops [--max-restarts 2]
    python benchmarks/reliability.py hostile     [--attacks 400] [--journals 200] [--full-saves 200] [--disk-mb 8] [--names 34000] [--seed S]

kill-writes
    A writer process saves generation after generation of a namespace with ``CheckpointStore``
    (``--size-mb`` of tensors and arrays: a float32 tensor, a tree of a float64 tensor and the
    counter, a uint8 NumPy array; plus an ``nn.Module`` saved by ``state_dict``, a pickled
    instance of a custom class and a list of floats). Every value of generation ``g`` holds ``g``
    (its bytes are a fixed pseudo-random pattern plus ``g``), so a mix of generations is caught.
    The writer is SIGKILLed at a random moment: the start of one of its first three saves plus a
    random delay up to 1.15x the measured length of a save (so kills also land just after a
    save, between two). Then this process loads the store: it must give the newest committed
    generation (the one acknowledged last, or the one in flight if its ``LATEST`` was already
    replaced) or the one before it, with every byte equal to what that generation wrote; or
    ``NoCheckpointError`` when no save was ever committed. Anything else (an error, a warning
    about a damaged checkpoint, an older generation, a wrong byte) is a failure. The store
    folder is reused across trials, as a real run would, so what earlier kills left behind
    (``blobs/.tmp-*``, ``.tmp-ckpt-*``, trashed blobs, unreferenced blobs) is exercised too; its
    largest size between trials is reported. Where the kill landed is read from the files it left
    (new temporary blob, temporary manifest folder, checkpoint renamed but ``LATEST`` not yet,
    ``LATEST`` replaced). Writers are forked from a "zygote" process that has imported torch and
    the package once (no torch compute before the fork), to save ~3 s of imports per trial; each
    writer is a separate process with its own ``CheckpointStore``. The store lives in a temporary
    folder on disk (``--dir`` to choose; /dev/shm was not needed: a 300 MB save takes < 1 s here).
    ``--background``: the writer saves as a run does by default, a snapshot into staging memory
    and the persist on a thread of its own, while it makes the next generation in place (every
    tensor and array written during the persist): a persist that read live memory would write a
    mix of generations, which the check catches.

chaos
    A supervised run (``colab_resilience.run_notebook``) of the tests' training notebook,
    ``tests/files/train.ipynb``, at ``--epochs`` and ``--width``: a ``%%replay`` set-up cell (seeds,
    data, an MLP with dropout, AdamW), a ``%%resilient --save model,opt,history`` cell looping over
    ``resume_range`` with a fresh ``randperm`` shuffle per epoch, and a cell printing one ``RESULT``
    line: the history and the SHA-256 of the final weights and of the optimizer state. The kernel
    writes time-stamped markers (set-up start/end, epoch start and end) to its log (``log``).
    A killer thread SIGKILLs the kernel from outside by PID (found as a child process of this
    one running ``ipykernel_launcher``, the process the kernel manager started) ``--kills`` times,
    each time in a phase drawn from start-up, set-up/replay, training and checkpoint write, after
    a random delay within the phase's length measured in the uninterrupted run. Where each kill
    really landed is read from the log afterwards. With the driver's standby kernel (the
    default; ``--no-standby`` for none), a start-up kill finds the standby, the only kernel then
    starting: it is reported as "standby" (told apart by ``COLAB_RESILIENCE_STANDBY=1`` in its
    environment, and by not having taken over yet) and
    costs no restart, only a cold one at the next death. The result must be identical (same
    hashes) to the uninterrupted run's. The killer stops once training has ended; afterwards one more run
    checks what a kill in a plain cell *after* the finished ``%%resilient`` cell does (the
    notebook's last cell, ``fault_epoch="result"``): the re-executed cell must see the trained
    state, restored from the finished run, not the freshly replayed, untrained model.

crash-loops
    Kernels that die every time: (a) at start-up (an IPython startup file that SIGKILLs the
    kernel once a marker exists; the first cell creates it and dies), (b) during every replay of
    the set-up cell, both under the supervisor; (c) an interactive kernel (jupyter_client standing
    in for the Jupyter server's restarter) whose ``%%resilient --max-restarts N`` cell dies at the
    start of every attempt, (d) one whose ``%%replay`` cell dies at every replay. Each must stop
    at its budget in bounded time with a report: status 3 and a message naming the restarts from
    the supervisor; from the interactive kernel an error reply naming the spent budget, after
    which the kernel stays up. (tests/test_driver.py already proves a crash in the first *cell*
    of every kernel; tests/test_restart.py an always-OOM interactive cell.)

hostile
    Another user's folders and links where a run writes, journals moved between runs or rolled
    back, saves failing on a full file system, tens of thousands of names in one save: see
    ``benchmarks/hostile.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(REPO / "tests")):  # tests/harness.py: kernels, the training notebook
    if _p not in sys.path:
        sys.path.insert(0, _p)

from colab_resilience.standby import is_standby  # noqa: E402

KEY = bytes(range(32))
MiB = 1 << 20


# ==================================================================================================
# kill-writes: generation contents


class Blob:
    """A custom class: saved by pickle (only loadable because the manifest is signed)."""

    def __init__(self, gen: int, payload: bytes):
        self.gen = gen
        self.payload = payload

    def __eq__(self, other):
        # by name: run as a script, this module is also imported as `reliability` by pickle
        return type(other).__qualname__ == "Blob" and other.gen == self.gen and other.payload == self.payload

    __hash__ = None


_PATTERN_CHUNK = 8 << 20  # elements per chunk when making or checking a pattern


def _pattern(torch, a: int, b: int, salt: int, dtype):
    """Elements a..b-1 of a fixed pseudo-random pattern of integers in [-500000, 500000],
    exactly representable in float32/float64, so that ``pattern + g`` is exact."""
    idx = torch.arange(a, b, dtype=torch.int64)
    v = (idx * 2654435761 + salt * 40503) % 1000003 - 500001
    return v.to(dtype)


def _bytes_pattern(np, n: int, salt: int, gen: int):
    idx = np.arange(n, dtype=np.uint64)
    return (((idx * np.uint64(2654435761) + np.uint64(salt)) >> np.uint64(5)) + np.uint64(gen)).astype(np.uint8)


def layout(size_bytes: int) -> dict:
    """Element counts for a namespace of about ``size_bytes`` of tensors and arrays."""
    return {
        "weights": max(1, int(size_bytes * 0.6) // 4),  # float32
        "moments": max(1, int(size_bytes * 0.3) // 8),  # float64, inside a tree
        "array": max(1, int(size_bytes * 0.1)),  # uint8
        "blob": 1 << 20,  # bytes in the pickled object
    }


def make_namespace(size_bytes: int, gen: int) -> dict:
    """Generation ``gen`` of the namespace (built chunk by chunk: no second copy in memory)."""
    import numpy as np
    import torch

    n = layout(size_bytes)
    weights = torch.empty(n["weights"], dtype=torch.float32)
    for a in range(0, n["weights"], _PATTERN_CHUNK):
        b = min(a + _PATTERN_CHUNK, n["weights"])
        weights[a:b] = _pattern(torch, a, b, 1, torch.float32)
    moments = torch.empty(n["moments"], dtype=torch.float64)
    for a in range(0, n["moments"], _PATTERN_CHUNK):
        b = min(a + _PATTERN_CHUNK, n["moments"])
        moments[a:b] = _pattern(torch, a, b, 2, torch.float64)
    array = _bytes_pattern(np, n["array"], 3, 0)
    model = torch.nn.Linear(32, 16)
    with torch.no_grad():
        model.weight.copy_(_pattern(torch, 0, 512, 4, torch.float32).view(16, 32))
        model.bias.copy_(_pattern(torch, 0, 16, 5, torch.float32))
    ns = {"weights": weights, "state": {"gen": 0, "moments": moments}, "array": array, "model": model}
    advance(ns, size_bytes, gen)
    return ns


def advance(ns: dict, size_bytes: int, gen: int) -> None:
    """Make ``ns`` generation ``gen`` (from the generation it holds): every value changes."""
    import numpy as np
    import torch

    step = gen - ns["state"]["gen"]
    with torch.no_grad():
        ns["weights"].add_(step)
        ns["state"]["moments"].add_(step)
        ns["model"].weight.add_(step)
        ns["model"].bias.add_(step)
    ns["array"] += np.uint8(step % 256)  # wraps around, as the check expects
    ns["state"] = {"gen": gen, "moments": ns["state"]["moments"]}
    ns["blob"] = Blob(gen, _bytes_pattern(np, layout(size_bytes)["blob"], 6, gen).tobytes())
    ns["history"] = [gen + i * 0.25 for i in range(200)]


NAMES = ["weights", "state", "array", "model", "blob", "history"]


def check_namespace(ns: dict, size_bytes: int, gen: int) -> str | None:
    """None if ``ns`` is exactly generation ``gen``; else what differs (one line)."""
    import numpy as np
    import torch

    n = layout(size_bytes)
    w = ns.get("weights")
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.numel() != n["weights"]:
        return f"weights: wrong type/shape {type(w).__name__}"
    for a in range(0, n["weights"], _PATTERN_CHUNK):
        b = min(a + _PATTERN_CHUNK, n["weights"])
        if not torch.equal(w[a:b], _pattern(torch, a, b, 1, torch.float32) + gen):
            return f"weights[{a}:{b}] differ from generation {gen}"
    st = ns.get("state")
    if not isinstance(st, dict) or st.get("gen") != gen:
        return f"state: gen {st.get('gen') if isinstance(st, dict) else st!r}, expected {gen}"
    m = st["moments"]
    if not isinstance(m, torch.Tensor) or m.dtype != torch.float64 or m.numel() != n["moments"]:
        return "state.moments: wrong type/shape"
    for a in range(0, n["moments"], _PATTERN_CHUNK):
        b = min(a + _PATTERN_CHUNK, n["moments"])
        if not torch.equal(m[a:b], _pattern(torch, a, b, 2, torch.float64) + gen):
            return f"state.moments[{a}:{b}] differ from generation {gen}"
    arr = ns.get("array")
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.shape != (n["array"],):
        return "array: wrong type/shape"
    if not np.array_equal(arr, _bytes_pattern(np, n["array"], 3, gen)):
        return f"array differs from generation {gen}"
    model = ns["model"]
    if not torch.equal(model.weight.detach(), _pattern(torch, 0, 512, 4, torch.float32).view(16, 32) + gen):
        return f"model.weight differs from generation {gen}"
    if not torch.equal(model.bias.detach(), _pattern(torch, 0, 16, 5, torch.float32) + gen):
        return f"model.bias differs from generation {gen}"
    if ns.get("blob") != Blob(gen, _bytes_pattern(np, n["blob"], 6, gen).tobytes()):
        return f"blob differs from generation {gen} (gen {getattr(ns.get('blob'), 'gen', None)!r})"
    if ns.get("history") != [gen + i * 0.25 for i in range(200)]:
        return f"history differs from generation {gen}"
    return None


# ==================================================================================================
# kill-writes: the zygote and its writers


def _writer(run_dir: str, size_bytes: int, start_gen: int, out_fd: int, background: bool = False) -> None:
    """In a forked child: save generation after generation until killed (or 1000 of them). With
    ``background``, as a run does: a snapshot into staging memory, the persist on a thread of its
    own, and the next generation made in place (every tensor and array written) while it runs."""
    from concurrent.futures import ThreadPoolExecutor

    from colab_resilience.checkpoints import CheckpointStore
    from colab_resilience.checkpoints.staging import Budget, Staging

    def say(line: str) -> None:
        os.write(out_fd, (line + "\n").encode())  # one write < PIPE_BUF: atomic

    store = CheckpointStore(run_dir, key=KEY)
    ns = make_namespace(size_bytes, start_gen)
    staging, thread, in_flight = Staging(Budget(0.5)), ThreadPoolExecutor(1), None
    say(f"ready {os.getpid()}")
    for gen in range(start_gen, start_gen + 1000):
        if gen != start_gen:
            advance(ns, size_bytes, gen)
        if in_flight is not None:
            in_flight.result()
            say(f"done {gen - 1}")
        say(f"begin {gen}")
        if not background:
            store.save(ns, NAMES, meta={"gen": gen})
            say(f"done {gen}")
            continue
        snap = store.snapshot(ns, NAMES, meta={"gen": gen}, staging=staging)
        in_flight = thread.submit(store.persist, snap)
    store.wait()


def _zygote() -> None:
    """Import torch and the package once; fork a writer per ``spawn`` line on stdin; report
    each writer's pid and exit status on stdout (the writers write their lines there too)."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import colab_resilience.checkpoints  # noqa: F401

    out = sys.stdout.fileno()
    os.write(out, b"zygote ready\n")
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "spawn":
            break
        run_dir, size_bytes, start_gen, background = parts[1], int(parts[2]), int(parts[3]), parts[4] == "1"
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _writer(run_dir, size_bytes, start_gen, out, background)
            except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit
                os.write(out, f"error {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n".encode())
                code = 1
            os._exit(code)
        os.write(out, f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(out, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


class Zygote:
    def __init__(self):
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import reliability; reliability._zygote()"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, bufsize=0)
        self.lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        t, line = self.get(timeout=120)
        if line != "zygote ready":
            raise RuntimeError(f"the writer zygote did not start: {line!r}")

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put((time.monotonic(), raw.decode().strip()))
        self.lines.put((time.monotonic(), "eof"))

    def get(self, timeout: float) -> tuple[float, str]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no word from the writer in {timeout:.0f} s") from None

    def spawn(self, run_dir: Path, size_bytes: int, start_gen: int, background: bool = False) -> None:
        self.proc.stdin.write(f"spawn {run_dir} {size_bytes} {start_gen} {int(background)}\n".encode())
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ==================================================================================================
# kill-writes: the trials


@dataclass
class KillTrial:
    index: int
    outcome: str  # "latest", "latest (in flight)", "previous", "none yet", "failure"
    loaded_gen: int | None
    in_flight: int | None
    acknowledged: int | None
    phase: str
    fraction: float  # kill time after the save's start, in units of a save's length
    detail: str = ""
    dir_bytes: int = 0


def _dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


def _listing(run_dir: Path) -> tuple[set, set]:
    top = set(os.listdir(run_dir)) if run_dir.is_dir() else set()
    blobs = set(os.listdir(run_dir / "blobs")) if (run_dir / "blobs").is_dir() else set()
    return top, blobs


def _phase(run_dir: Path, before: tuple[set, set], in_flight: int | None, ckpt_of_gen: dict) -> str:
    """Where the kill landed, from what it left on disk (new names since the trial started)."""
    if in_flight is None:
        return "between saves"
    top, blobs = _listing(run_dir)
    new_top, new_blobs = top - before[0], blobs - before[1]
    try:
        latest = (run_dir / "LATEST").read_text().strip()
    except OSError:
        latest = None
    cid = ckpt_of_gen.get(in_flight)
    if cid and latest == cid:
        return "after LATEST (clean-up)"
    if cid and (run_dir / cid / "manifest.json").is_file():
        return "checkpoint renamed, LATEST not yet"
    if any(n.startswith(".tmp-ckpt-") for n in new_top):
        return "manifest write"
    if any(n.startswith(".tmp-") for n in new_blobs):
        return "blob write"
    if any(not n.startswith(".") for n in new_blobs):
        return "blobs written, no manifest yet"
    return "preparing (no file yet)"


def _leftovers(run_dir: Path) -> list[str]:
    """Files no kept checkpoint needs: temporary files and folders, trash, damaged or
    unreferenced blobs, checkpoints beyond the two kept."""
    top, blobs = _listing(run_dir)
    referenced = set()
    ckpts = sorted(n for n in top if n.startswith("ckpt-"))
    for c in ckpts:
        try:
            body = json.loads((run_dir / c / "manifest.json").read_text())["body"]
            referenced |= {e["hash"] for e in body["entries"] + [body["rng"]]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    out = [n for n in top if n not in ("LATEST", "blobs") and not n.startswith("ckpt-")]
    out += ckpts[:-2]
    out += ["blobs/" + n for n in blobs if n not in referenced]
    return sorted(out)


def _gen_of_checkpoints(run_dir: Path) -> dict:
    """{generation: checkpoint id} of the manifests on disk (read as plain JSON)."""
    out = {}
    for d in run_dir.glob("ckpt-*"):
        try:
            body = json.loads((d / "manifest.json").read_text())["body"]
            out[int(body["meta"]["gen"])] = d.name
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def kill_trials(trials: int, size_mb: float, *, run_dir: Path | None = None, seed: int = 0,
                progress=None, background: bool = False) -> tuple[list[KillTrial], dict]:
    """Run ``trials`` kill-during-write trials; return them and a summary. ``background``: the
    writer persists on a thread while it makes the next generation in place, as a run does."""
    import torch

    from colab_resilience.errors import NoCheckpointError
    from colab_resilience.checkpoints import CheckpointStore

    rng = random.Random(seed)
    size_bytes = int(size_mb * MiB)
    own_dir = run_dir is None
    base = Path(tempfile.mkdtemp(prefix="cr-killwrites-")) if own_dir else Path(run_dir)
    store_dir = base / "checkpoints"
    results: list[KillTrial] = []
    durations: list[float] = []
    committed: list[int] = []  # generations known committed, in order
    next_gen = 1
    max_dir = 0
    zygote = Zygote()
    started = time.perf_counter()
    try:
        for index in range(trials):
            before = _listing(store_dir)
            zygote.spawn(store_dir, size_bytes, next_gen, background)
            pid = None
            begins: dict[int, float] = {}
            dones: dict[int, float] = {}
            target = rng.randrange(3)  # which of the writer's saves to hit
            kill_at = None
            killed_at = None
            exit_code = None
            error = ""
            while exit_code is None:
                timeout = 120.0 if kill_at is None or killed_at is not None else max(0.0, kill_at - time.monotonic())
                try:
                    t, line = zygote.get(timeout=timeout)
                except TimeoutError:
                    if kill_at is None or killed_at is not None:
                        raise
                    line = ""
                if kill_at is not None and killed_at is None and time.monotonic() >= kill_at:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                if not line:
                    continue
                kind, _, rest = line.partition(" ")
                if kind == "pid":
                    pid = int(rest)
                elif kind == "begin":
                    g = int(rest)
                    begins[g] = t
                    if len(begins) - 1 == target and killed_at is None:
                        # before the first save was measured: a guess (~400 MB/s)
                        est = statistics.median(durations[-20:]) if durations else 0.05 + size_bytes / 400e6
                        kill_at = t + rng.uniform(0, 1.15 * est)
                elif kind == "done":
                    g = int(rest)
                    dones[g] = t
                    durations.append(t - begins[g])
                elif kind == "exit":
                    exit_code = int(rest.split()[1])
                elif kind == "error":
                    error = rest
                elif kind == "eof":
                    raise RuntimeError("the writer zygote died")
            acknowledged_here = sorted(dones)
            committed.extend(acknowledged_here)
            begun = sorted(begins)
            in_flight = begun[-1] if begun and begun[-1] not in dones else None
            next_gen = (begun[-1] if begun else next_gen) + 1
            ckpt_of_gen = _gen_of_checkpoints(store_dir)
            phase = _phase(store_dir, before, in_flight, ckpt_of_gen)
            last_begin = begins[begun[-1]] if begun else killed_at
            est = statistics.median(durations[-20:]) if durations else 0.05 + size_bytes / 400e6
            fraction = ((killed_at or last_begin) - last_begin) / est
            acknowledged = committed[-1] if committed else None
            previous = committed[-2] if len(committed) > 1 else None
            detail = ""
            loaded_gen = None
            if exit_code != -signal.SIGKILL:
                outcome, detail = "failure", f"writer exit code {exit_code} {error}".strip()
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        ckpt = CheckpointStore(store_dir, key=KEY).load()
                        ns = {"model": torch.nn.Linear(32, 16)}
                        ckpt.restore(ns, rng=False)
                        loaded_gen = ckpt.meta.get("gen")
                        problem = check_namespace(ns, size_bytes, loaded_gen) if isinstance(loaded_gen, int) else "no gen in meta"
                        del ckpt, ns
                        if problem:
                            outcome, detail = "failure", problem
                        elif loaded_gen == in_flight:
                            outcome = "latest (in flight)"
                        elif loaded_gen == acknowledged:
                            outcome = "latest"
                        elif loaded_gen == previous:
                            outcome = "previous"
                        else:
                            outcome = "failure"
                            detail = f"loaded generation {loaded_gen}; committed {acknowledged}, in flight {in_flight}"
                    except NoCheckpointError as e:
                        if acknowledged is None:
                            outcome = "none yet"
                        else:
                            outcome, detail = "failure", f"NoCheckpointError after generation {acknowledged} was saved: {e}"
                    except Exception as e:  # noqa: BLE001 - every other error is a failure
                        outcome, detail = "failure", f"{type(e).__name__}: {e}"
                if caught and outcome != "failure":
                    outcome = "failure"
                    detail = "warning: " + "; ".join(str(w.message) for w in caught)
            if loaded_gen is not None and loaded_gen == in_flight:
                committed.append(in_flight)
            size = _dir_size(store_dir)
            max_dir = max(max_dir, size)
            trial = KillTrial(index, outcome, loaded_gen, in_flight, acknowledged, phase, fraction, detail, size)
            results.append(trial)
            if progress:
                progress(trial)
        # one clean save: what the kills left behind must be gone after it
        leftovers_before = _leftovers(store_dir)
        store = CheckpointStore(store_dir, key=KEY)
        store.save(make_namespace(size_bytes, next_gen), NAMES, meta={"gen": next_gen})
        store.wait()
        leftovers_after = _leftovers(store_dir)
    finally:
        zygote.close()
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)
    counts = {k: sum(r.outcome == k for r in results)
              for k in ("latest", "latest (in flight)", "previous", "none yet", "failure")}
    phases: dict[str, int] = {}
    for r in results:
        phases[r.phase] = phases.get(r.phase, 0) + 1
    summary = {
        "trials": len(results),
        "size_mb": size_mb,
        "counts": counts,
        "phases": phases,
        "faults_survived": len(results) - counts["failure"],
        "data_lost": counts["failure"],
        "fell_back_to_previous": counts["previous"],
        "save_seconds_median": statistics.median(durations) if durations else None,
        "max_dir_bytes": max_dir,
        "max_dir_in_namespaces": max_dir / max(1, size_bytes),
        "seconds": time.perf_counter() - started,
        "leftovers_before_clean_save": leftovers_before,
        "leftovers_after_clean_save": leftovers_after,
        "failures": [f"trial {r.index}: {r.detail}" for r in results if r.outcome == "failure"],
    }
    return results, summary


def print_kill_table(summary: dict) -> None:
    c = summary["counts"]
    rows = [
        ("trials (SIGKILL at a random moment of a save)", summary["trials"]),
        ("namespace size per generation", f"{summary['size_mb']:g} MiB + a 1 MiB pickled object"),
        ("median save time", f"{summary['save_seconds_median']:.3f} s" if summary["save_seconds_median"] else "-"),
        ("loaded the newest committed generation", c["latest"]),
        ("  ... the one in flight (LATEST already replaced)", c["latest (in flight)"]),
        ("loaded the one before it", c["previous"]),
        ("no checkpoint yet (NoCheckpointError, none committed)", c["none yet"]),
        ("failures (error, warning, wrong generation, wrong byte)", c["failure"]),
        ("faults survived", f"{summary['faults_survived']}/{summary['trials']}"),
        ("data lost", summary["data_lost"]),
        ("largest store folder between trials", f"{summary['max_dir_bytes'] / MiB:.0f} MiB "
                                                f"({summary['max_dir_in_namespaces']:.2f}x a namespace)"),
        ("files left by the kills before one clean save", len(summary["leftovers_before_clean_save"])),
        ("  ... after it (must be 0)", len(summary["leftovers_after_clean_save"])),
        ("wall time", f"{summary['seconds']:.0f} s"),
    ]
    _table(rows)
    print("\n  where the kills landed (from the files left behind):")
    _table(sorted(summary["phases"].items(), key=lambda kv: -kv[1]), indent=4)
    for f in summary["failures"][:20]:
        print("  FAILURE", f)


def _table(rows, indent: int = 2) -> None:
    width = max(len(str(k)) for k, _ in rows) if rows else 0
    for k, v in rows:
        print(f"{' ' * indent}{str(k):<{width}}  {v}")


# ==================================================================================================
# kernels: an isolated Jupyter environment


@contextmanager
def workspace(prefix: str = "cr-reliability-"):
    """A temporary root: kernelspec ``colab-resilience-test`` (this interpreter), a private
    IPYTHONDIR, COLAB_RESILIENCE_HOME and RUN_DIR; the environment is restored afterwards."""
    from harness import isolated_jupyter

    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        with isolated_jupyter(root, "colab_resilience reliability"):
            yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def kernel_pids() -> set[int]:
    """Live kernels started by this process (jupyter_client starts them as our children)."""
    import psutil

    pids = set()
    for child in psutil.Process().children(recursive=False):
        try:
            if "ipykernel_launcher" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def _nb(*sources: str):
    from harness import notebook

    return notebook(*sources)


# ==================================================================================================
# chaos runs

PHASES = ["start-up", "set-up/replay", "training", "checkpoint write"]


def chaos_notebook(workdir: Path, log: Path, parameters: dict, budget: int):
    """tests/files/train.ipynb with ``parameters`` (``epochs``, ``width``...), its log ``log``, a
    budget of ``budget`` restarts and no fault of its own: the killer is the fault."""
    from harness import load

    return load("train.ipynb", workdir, log=str(log), max_restarts=budget, **parameters)


def _read_log(log: Path) -> list[tuple[int, float, str]]:
    try:
        text = log.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            try:
                out.append((int(parts[0]), float(parts[1]), parts[2]))
            except ValueError:
                continue
    return out


def _result_line(nb) -> str:
    """The notebook's RESULT line (history, weights and optimizer fingerprints), or "" without one."""
    from harness import cell_text

    found = [l for c in nb.cells for l in cell_text(c).splitlines() if l.startswith("RESULT ")]
    return found[-1] if found else ""


def _phase_lengths(log: list, appeared: dict[int, float]) -> dict[str, float]:
    """Median length of each phase in a log (for the kill delays)."""
    by_pid: dict[int, list] = {}
    for pid, t, what in log:
        by_pid.setdefault(pid, []).append((t, what))
    startup, setup, train, ckpt = [], [], [], []
    for pid, marks in by_pid.items():
        if pid in appeared and marks:
            startup.append(marks[0][0] - appeared[pid])
        for (t0, w0), (t1, w1) in zip(marks, marks[1:]):
            if w0.startswith("setup-start") and w1 == "setup-end":
                setup.append(t1 - t0)
            elif w0.startswith("epoch-start") and w1.startswith("epoch-end"):
                train.append(t1 - t0)
            elif w0.startswith("epoch-end") and (w1.startswith("epoch-start") or w1 == "train-end"):
                ckpt.append(t1 - t0)
    med = lambda xs, d: statistics.median(xs) if xs else d  # noqa: E731
    return {"start-up": med(startup, 1.5), "set-up/replay": med(setup, 1.0), "training": med(train, 0.3),
            "checkpoint write": med(ckpt, 0.05)}


def _landed(log: list, pid: int, t: float) -> str:
    """The phase the kernel ``pid`` was in at time ``t`` (from its markers)."""
    last = None
    for p, tt, what in log:
        if p == pid and tt <= t:
            last = what
    if last is None:
        return "start-up"
    if last.startswith("setup-start"):
        return "set-up/replay"
    if last == "setup-end":
        return "resume (run open, restore)"
    if last.startswith("epoch-start"):
        return "training"
    if last.startswith("epoch-end"):
        return "checkpoint write"
    return "after training"


class Killer(threading.Thread):
    """SIGKILLs the kernel from outside, by PID, in the phases of ``schedule``."""

    def __init__(self, log: Path, schedule: list[str], lengths: dict[str, float], rng: random.Random,
                 spread: int = 1):
        super().__init__(daemon=True)
        self.log, self.schedule, self.lengths, self.rng, self.spread = log, schedule, lengths, rng, spread
        self.stop = threading.Event()
        self.kills: list[dict] = []
        self.appeared: dict[int, float] = {}
        self.error: BaseException | None = None

    def _poll(self):
        for pid in kernel_pids():
            self.appeared.setdefault(pid, time.time())

    def _wait_event(self, phase: str, after: float) -> tuple[int, float] | None:
        # training and checkpoint kills: at the next such moment, or up to `spread` later
        skip = self.rng.randrange(self.spread + 1) if phase in ("training", "checkpoint write") else 0
        seen = 0
        counted: set = set()
        while not self.stop.is_set():
            self._poll()
            log = _read_log(self.log)
            if any(w == "train-end" and t > after for _, t, w in log):
                return None  # training is over: no more kills
            if phase == "start-up":
                logged = {p for p, _, _ in log}
                fresh = [(t, p) for p, t in self.appeared.items() if t > after and p not in logged and _alive(p)]
                if fresh:
                    t, p = min(fresh)
                    return p, t
            else:
                prefix = {"set-up/replay": "setup-start", "training": "epoch-start",
                          "checkpoint write": "epoch-end"}[phase]
                for p, t, w in log:
                    if t > after and w.startswith(prefix) and (p, t) not in counted:
                        counted.add((p, t))
                        if seen >= skip:
                            return p, t
                        seen += 1
            time.sleep(0.01)
        return None

    def run(self):
        try:
            after = 0.0
            schedule = list(self.schedule)
            for i, phase in enumerate(schedule):
                if phase in ("start-up", "set-up/replay") and self.kills and self.kills[-1]["standby"]:
                    # a standby's death brings no restart, so no start-up or replay follows it:
                    # the next training or checkpoint kill goes first
                    later = [j for j in range(i + 1, len(schedule)) if schedule[j] in ("training", "checkpoint write")]
                    if later:
                        schedule[i], schedule[later[0]] = schedule[later[0]], schedule[i]
                        phase = schedule[i]
                event = self._wait_event(phase, after)
                if event is None:
                    return
                pid, t = event
                delay = self.rng.uniform(0, 0.9 * self.lengths[phase])
                while time.time() < t + delay and not self.stop.is_set():
                    time.sleep(min(0.005, max(0.0, t + delay - time.time())))
                if self.stop.is_set():
                    return
                spare = is_standby(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                now = time.time()
                self.kills.append({"pid": pid, "time": now, "planned": phase, "standby": spare})
                after = now
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def chaos_schedule(kills: int, rng: random.Random) -> list[str]:
    """``kills`` phases covering all four as evenly as possible, in random order; the first is
    not start-up (there is no restart to hit before the first kill)."""
    phases = [PHASES[i % len(PHASES)] for i in range(kills)]
    rng.shuffle(phases)
    if phases and phases[0] == "start-up":
        j = next((i for i, p in enumerate(phases) if p != "start-up"), None)
        if j is None:
            phases[0] = "training"
        else:
            phases[0], phases[j] = phases[j], phases[0]
    return phases


def chaos_runs(runs: int, kills: int, *, parameters: dict | None = None, seed: int = 0,
               schedule: list[str] | None = None, spread: int = 1, progress=None, standby: bool = True,
               reference=None) -> dict:
    """``runs`` runs of tests/files/train.ipynb with ``parameters``, with ``kills`` SIGKILLs each
    (in the phases of ``schedule`` if given, else drawn by :func:`chaos_schedule`), compared with
    an uninterrupted run: ``reference`` (a ``harness.Reference`` of a run with the same results,
    whose log gives the phase lengths) or, without one, a run made here first."""
    from colab_resilience import driver
    from harness import KERNEL_NAME, events

    parameters = dict(parameters or {})
    rng = random.Random(seed)
    budget = kills + 3
    out = {"runs": [], "reference": None}
    with workspace("cr-chaos-") as root:
        if reference is None:
            ref_log = root / "reference.log"
            watcher = Killer(ref_log, [], {}, rng)
            nb = chaos_notebook(root, ref_log, parameters, budget)
            stop = threading.Event()

            def watch():
                while not stop.is_set():
                    watcher._poll()
                    time.sleep(0.01)

            w = threading.Thread(target=watch, daemon=True)
            w.start()
            t0 = time.perf_counter()
            ref = driver.run_notebook(nb, root / "reference.ipynb", kernel_name=KERNEL_NAME, run_dir=root / "runs-ref",
                                      cwd=root, max_restarts=0)
            stop.set()
            w.join()
            if ref.status != 0:
                raise RuntimeError(f"the uninterrupted run failed: {ref.message}")
            expected, seconds = _result_line(nb), time.perf_counter() - t0
            lengths = _phase_lengths(_read_log(ref_log), watcher.appeared)
        else:  # start-up: no kernel was watched appearing, the default length
            expected, seconds = reference.result, None
            lengths = _phase_lengths([(e.pid, e.time, f"{e.name} {e.arg}".strip()) for e in events(reference.log)], {})
        out["reference"] = {"seconds": seconds, "result": expected, "lengths": lengths}
        for i in range(runs):
            log = root / f"chaos-{i}.log"
            plan = list(schedule) if schedule else chaos_schedule(kills, rng)
            killer = Killer(log, plan, lengths, rng, spread)
            nb = chaos_notebook(root, log, parameters, budget)
            killer.start()
            t0 = time.perf_counter()
            error = ""
            try:
                res = driver.run_notebook(nb, root / f"chaos-{i}.ipynb", kernel_name=KERNEL_NAME,
                                          run_dir=root / f"runs-{i}", cwd=root, max_restarts=budget, standby=standby)
                status, message, restarts = res.status, res.message, res.restarts
            except Exception as e:  # noqa: BLE001 - a driver that raises is a failure of the run
                status, message, restarts = None, "", []
                error = f"run_notebook raised {type(e).__name__}: {e}"
            seconds = time.perf_counter() - t0
            killer.stop.set()
            killer.join()
            full_log = _read_log(log)
            landed = [_landed(full_log, k["pid"], k["time"]) for k in killer.kills]
            for k, where in zip(killer.kills, landed):  # a standby that had not taken over: logged nothing
                k["standby"] = k["standby"] and where == "start-up"
            landed = ["standby" if k["standby"] else where for k, where in zip(killer.kills, landed)]
            result = _result_line(nb) if status == 0 else ""
            run = {
                "schedule": plan,
                "kills": len(killer.kills),
                "landed": landed,
                "restarts": len(restarts),
                "standby_kills": sum(k["standby"] for k in killer.kills),
                "restart_reasons": [r.reason for r in restarts],
                "recovery_seconds": [round(r.seconds, 2) for r in restarts],
                "status": status,
                "message": message or error,
                "seconds": seconds,
                "identical": status == 0 and result == expected,
                "result": result,
                "killer_error": repr(killer.error) if killer.error else None,
            }
            out["runs"].append(run)
            if progress:
                progress(i, run)
    return out


def print_chaos_table(out: dict) -> None:
    ref = out["reference"]
    took = f"{ref['seconds']:.1f} s" if ref["seconds"] is not None else "given"
    print(f"  uninterrupted run: {took}; phase lengths (median): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in ref["lengths"].items()))
    fields = dict(re.findall(r"(\w+)=(\[[^]]*\]|\S+)", ref["result"]))
    print(f"  reference: weights {fields.get('weights', '?')[:16]} | optimizer {fields.get('optimizer', '?')[:16]} | "
          f"history of {len(json.loads(fields.get('history', '[]')))} epochs")
    rows = [("run", "kills", "restarts", "status", "identical", "wall", "where the kills landed")]
    for i, r in enumerate(out["runs"]):
        rows.append((str(i), str(r["kills"]), str(r["restarts"]), str(r["status"]),
                     "yes (bit for bit)" if r["identical"] else "NO", f"{r['seconds']:.1f} s", ", ".join(r["landed"])))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)))
    landed: dict[str, int] = {}
    for r in out["runs"]:
        for p in r["landed"]:
            landed[p] = landed.get(p, 0) + 1
    total = sum(r["kills"] for r in out["runs"])
    ok = sum(r["identical"] for r in out["runs"])
    print(f"\n  {len(out['runs'])} run(s), {total} kills survived; identical to the uninterrupted run: {ok}/{len(out['runs'])}")
    print("  kills by phase: " + ", ".join(f"{k} {v}" for k, v in sorted(landed.items(), key=lambda kv: -kv[1])))
    for i, r in enumerate(out["runs"]):
        if not r["identical"]:
            print(f"  run {i}: status {r['status']}: {r['message']}")
        if r["killer_error"]:
            print(f"  run {i}: killer error {r['killer_error']}")


def kill_in_a_later_cell(root: Path, expected: str, parameters: dict | None = None) -> dict:
    """A SIGKILL in a plain cell *after* the ``%%resilient`` cell finished (train.ipynb's last cell,
    ``fault_epoch="result"``): the driver restarts, replays the set-up cells and re-executes that
    cell. Does it see the trained state? It must restore it from the finished run's last
    checkpoint after the replay, and print ``expected`` (the uninterrupted run's RESULT line, with
    the same ``parameters``), without training again."""
    from colab_resilience import driver
    from harness import KERNEL_NAME, cell_text, epochs, index, load

    parameters = dict(parameters or {})
    nb = load("train.ipynb", root, fault="sigkill", fault_epoch="result", **parameters)
    res = driver.run_notebook(nb, root / "later.ipynb", kernel_name=KERNEL_NAME, run_dir=root / "runs-later",
                              cwd=root, max_restarts=3)
    seen = _result_line(nb)
    trained = epochs(root / "events.log")
    return {"status": res.status, "restarts": len(res.restarts), "seen_after_restart": seen, "epochs": trained,
            "trained": trained == list(range(parameters.get("epochs", 4))),  # each epoch once: not trained again
            "identical": seen == expected,
            "marker": "restored model, opt, history, epoch, step from the finished training" in cell_text(nb.cells[index(nb, "result")])}


# ==================================================================================================
# crash loops

STARTUP_KILLER = """import os, signal
if os.path.exists({mark!r}):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def crash_loop_driver_startup(root: Path, max_restarts: int = 2) -> dict:
    """Supervised: after the first kernel, every kernel dies while starting (an IPython startup
    file kills it once the marker exists; the first cell creates the marker and dies)."""
    from colab_resilience import driver
    from harness import KERNEL_NAME

    mark = root / "startup-mark"
    startup = Path(os.environ["IPYTHONDIR"]) / "profile_default" / "startup" / "50-reliability-crash.py"
    startup.parent.mkdir(parents=True, exist_ok=True)
    startup.write_text(STARTUP_KILLER.format(mark=str(mark)))
    nb = _nb(f"import os, signal\nopen({str(mark)!r}, 'w').close()\nos.kill(os.getpid(), signal.SIGKILL)",
             "print('not reached')")
    t0 = time.perf_counter()
    try:
        res = driver.run_notebook(nb, root / "startup-loop.ipynb", kernel_name=KERNEL_NAME,
                                  run_dir=root / "runs-startup", cwd=root, max_restarts=max_restarts)
        out = {"status": res.status, "message": res.message, "restarts": len(res.restarts),
               "reasons": [r.reason for r in res.restarts], "reached": "not reached" in _cell_text(nb.cells[1])}
    except Exception as e:  # noqa: BLE001
        out = {"status": None, "message": f"run_notebook raised {type(e).__name__}: {e}", "restarts": None,
               "reasons": [], "reached": False}
    finally:
        startup.unlink()
    out["seconds"] = time.perf_counter() - t0
    return out


def crash_loop_driver_replay(root: Path, max_restarts: int = 2) -> dict:
    """Supervised: the training cell dies once; then every replay of the set-up cell dies. The
    run's --max-restarts is ``max_restarts``, the driver's larger: the run's governs."""
    from colab_resilience import driver
    from harness import KERNEL_NAME

    mark = root / "replay-mark"
    setup = f"%%replay\nimport os, signal\nif os.path.exists({str(mark)!r}):\n    os.kill(os.getpid(), signal.SIGKILL)\nx = 1"
    train = (f"%%resilient --max-restarts {max_restarts}\n"
             f"open({str(mark)!r}, 'w').close()\nos.kill(os.getpid(), signal.SIGKILL)")
    nb = _nb(setup, train, "print('not reached')")
    t0 = time.perf_counter()
    try:
        res = driver.run_notebook(nb, root / "replay-loop.ipynb", kernel_name=KERNEL_NAME,
                                  run_dir=root / "runs-replay", cwd=root, max_restarts=max_restarts + 5)
        out = {"status": res.status, "message": res.message, "restarts": len(res.restarts),
               "reasons": [r.reason for r in res.restarts], "reached": "not reached" in _cell_text(nb.cells[2])}
    except Exception as e:  # noqa: BLE001
        out = {"status": None, "message": f"run_notebook raised {type(e).__name__}: {e}", "restarts": None,
               "reasons": [], "reached": False}
    out["seconds"] = time.perf_counter() - t0
    return out


def _cell_text(cell) -> str:
    from harness import cell_text

    return cell_text(cell)


def _interactive_loop(root: Path, setup: str, cell: str, limit: int) -> dict:
    """Run ``cell`` in a kernel; while the kernel dies, restart it (as the Jupyter server's
    restarter does) and run the cell again, at most ``limit`` kernels. Returns what happened."""
    from harness import Kernel

    env = {"COLAB_RESILIENCE_RUN_DIR": str(root / "runs-interactive"), "IPYTHONDIR": os.environ["IPYTHONDIR"]}
    k = Kernel(env)
    t0 = time.perf_counter()
    deaths, exit_codes, pids = 0, [], [k.pid]
    try:
        k.ok("%load_ext colab_resilience")
        k.ok(setup)
        while True:
            if len(pids) > limit:
                return {"kernels": len(pids), "deaths": deaths, "exit_codes": exit_codes, "status": "looping",
                        "report": "", "alive_after": None, "seconds": time.perf_counter() - t0}
            msg_id = k.submit(cell)
            reply = _collect_or_death(k, msg_id)
            if reply is None:  # the kernel died: the restarter brings a new one
                deaths += 1
                exit_codes.append(k.km.provisioner.process.poll() if k.km.provisioner else None)
                k.restart()
                pids.append(k.pid)
                continue
            alive = k.execute("1 + 1").status == "ok"
            return {"kernels": len(pids), "deaths": deaths, "exit_codes": exit_codes, "status": reply.status,
                    "ename": reply.ename, "report": reply.stdout + reply.stderr, "alive_after": alive,
                    "same_kernel_after": k.pid == pids[-1], "seconds": time.perf_counter() - t0}
    finally:
        k.shutdown()


def _collect_or_death(k, msg_id: str, timeout: float = 120):
    """The reply to ``msg_id`` (a tests/harness.py Reply), or None if the kernel died first."""
    from harness import Reply

    deadline = time.monotonic() + timeout
    stdout = stderr = ""
    reply = None
    idle = False
    while time.monotonic() < deadline:
        if reply is not None and idle:
            c = reply["content"]
            return Reply(status=c["status"], ename=c.get("ename"), evalue=c.get("evalue"),
                         traceback=c.get("traceback", []), stdout=stdout, stderr=stderr)
        try:
            msg = k.kc.get_iopub_msg(timeout=0.1)
            if msg["parent_header"].get("msg_id") == msg_id:
                if msg["msg_type"] == "stream":
                    if msg["content"]["name"] == "stdout":
                        stdout += msg["content"]["text"]
                    else:
                        stderr += msg["content"]["text"]
                elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
            continue
        except queue.Empty:
            pass
        if reply is None:
            try:
                m = k.kc.get_shell_msg(timeout=0)
                if m["parent_header"].get("msg_id") == msg_id:
                    reply = m
                continue
            except queue.Empty:
                pass
        if not k.km.is_alive():
            return None
    raise TimeoutError(f"no reply and no death in {timeout} s")


def crash_loop_interactive_attempt(root: Path, max_restarts: int = 2) -> dict:
    """Interactive: the ``%%resilient`` cell SIGKILLs its kernel at the start of every attempt."""
    cell = f"%%resilient --max-restarts {max_restarts}\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
    return _interactive_loop(root, "%%replay\nx = 1", cell, limit=max_restarts + 4)


def crash_loop_interactive_replay(root: Path, max_restarts: int = 2) -> dict:
    """Interactive: the cell dies once; then the replay of the set-up cell kills every new kernel."""
    mark = root / "interactive-replay-mark"
    setup = f"%%replay\nimport os, signal\nif os.path.exists({str(mark)!r}):\n    os.kill(os.getpid(), signal.SIGKILL)"
    cell = (f"%%resilient --max-restarts {max_restarts}\n"
            f"open({str(mark)!r}, 'w').close()\nos.kill(os.getpid(), signal.SIGKILL)")
    return _interactive_loop(root, setup, cell, limit=max_restarts + 4)


CRASH_LOOPS = {
    "supervised: dies at every kernel start-up": crash_loop_driver_startup,
    "supervised: dies during every replay": crash_loop_driver_replay,
    "interactive: dies at the start of every attempt": crash_loop_interactive_attempt,
    "interactive: dies during every replay": crash_loop_interactive_replay,
}


def crash_loops(max_restarts: int = 2, only: list[str] | None = None) -> dict:
    out = {}
    with workspace("cr-crashloop-") as root:
        for name, fn in CRASH_LOOPS.items():
            if only and name not in only:
                continue
            out[name] = fn(root, max_restarts)
    return out


def print_crash_table(out: dict) -> None:
    for name, r in out.items():
        print(f"  {name}")
        if "kernels" in r:
            print(f"    kernels started {r['kernels']}, deaths {r['deaths']} (exit codes {r['exit_codes']}), "
                  f"final reply {r['status']} {r.get('ename') or ''}, kernel answers afterwards: {r['alive_after']}, "
                  f"{r['seconds']:.1f} s")
            report = [l for l in r["report"].splitlines() if "restart budget" in l]
            print(f"    report: {report[0] if report else r['report'].strip()[:300]}")
        else:
            print(f"    status {r['status']}, restarts {r['restarts']}, later cell reached: {r['reached']}, {r['seconds']:.1f} s")
            print(f"    message: {r['message']}")


# ==================================================================================================


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser("kill-writes", help="SIGKILL a checkpoint writer at random moments; check every load")
    k.add_argument("--trials", type=int, default=200)
    k.add_argument("--size-mb", type=float, default=300.0, help="tensors and arrays per generation (MiB)")
    k.add_argument("--dir", type=Path, default=None, help="a folder for the store (default: a temporary one)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", type=Path, default=None, help="also write the summary here")
    k.add_argument("--background", action="store_true", help="snapshot, then persist on a thread (as runs do)")
    c = sub.add_parser("chaos", help="SIGKILL a supervised training run's kernel at random moments")
    c.add_argument("--runs", type=int, default=1)
    c.add_argument("--kills", type=int, default=8)
    c.add_argument("--epochs", type=int, default=8)
    c.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (checkpoint size)")
    c.add_argument("--pause", type=float, default=0.0,
                   help="seconds of sleep after each minibatch (train.ipynb's pause): a slower run for the kills to land in")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", type=Path, default=None)
    c.add_argument("--no-standby", action="store_true", help="run the driver without its standby kernel")
    l = sub.add_parser("crash-loops", help="kernels that die every time: the budget must stop them")
    l.add_argument("--max-restarts", type=int, default=2)
    l.add_argument("--json", type=Path, default=None)
    h = sub.add_parser("hostile", help="another user's folders and links, moved and rolled-back journals")
    h.add_argument("--attacks", type=int, default=400)
    h.add_argument("--journals", type=int, default=200)
    h.add_argument("--full-saves", type=int, default=200, help="saves that do not fit on a small tmpfs (0: none)")
    h.add_argument("--disk-mb", type=int, default=8, help="size of that tmpfs (blobs under the 8 MiB chunk took the path that leaked)")
    h.add_argument("--names", type=int, default=34000, help="top-level names in one save (0: none)")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.command == "hostile":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import hostile

        out = hostile.hostile(a.attacks, a.journals, a.seed, full_saves=a.full_saves, disk_mb=a.disk_mb,
                              names=a.names)
        hostile.print_hostile(out)
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
        disk, names = out.get("full_disk", {}), out.get("many_names", {})
        ok = (not out["attacks"]["failures"] and not out["journals"]["failures"] and not disk.get("failures")
              and disk.get("loaded_after", True) and names.get("identical", True))
        return 0 if ok else 1
    if a.command == "kill-writes":
        def progress(t: KillTrial):
            if t.outcome == "failure" or (t.index + 1) % 25 == 0:
                print(f"  trial {t.index + 1}: {t.outcome} ({t.phase}) {t.detail}", flush=True)

        _, summary = kill_trials(a.trials, a.size_mb, run_dir=a.dir, seed=a.seed, progress=progress,
                                 background=a.background)
        print()
        print_kill_table(summary)
        if a.json:
            a.json.write_text(json.dumps(summary, indent=1))
        return 0 if summary["data_lost"] == 0 else 1
    if a.command == "chaos":
        def progress(i, run):
            print(f"  run {i}: status {run['status']}, {run['kills']} kills, identical: {run['identical']}", flush=True)

        parameters = {"epochs": a.epochs, "width": a.width, "pause": a.pause}
        out = chaos_runs(a.runs, a.kills, parameters=parameters, seed=a.seed, progress=progress,
                         standby=not a.no_standby)
        print()
        print_chaos_table(out)
        with workspace("cr-later-") as root:
            later = kill_in_a_later_cell(root, out["reference"]["result"], parameters)
        out["kill_in_a_later_cell"] = later
        print(f"\n  a SIGKILL in a plain cell after the %%resilient cell: status {later['status']}, "
              f"{later['restarts']} restart, that cell sees the trained state: {'yes' if later['identical'] else 'NO'}"
              + ("" if later["identical"] else " (the trained state is not brought back: known gap)"))
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
        return 0 if all(r["identical"] for r in out["runs"]) else 1
    out = crash_loops(a.max_restarts)
    print_crash_table(out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    ok = all((r.get("status") == 3) if "kernels" not in r else (r["status"] == "error" and r["alive_after"])
             for r in out.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
