"""What the parts of a background persist cost a training that keeps every CPU busy, against this
package's background save, rows alternating.

    python benchmarks/persist_floor.py [--params 50e6] [--epoch-seconds 1.9] [--epochs 3]
                                       [--passes 3] [--dir DIR] [--device cuda]

A background save moves a checkpoint's writing off the training's path, but not off its CPUs:
where training keeps every core busy, whatever the persist does on a core comes out of the
training's time. This benchmark measures that floor part by part. Each row trains the workload of
``background_save.py`` (50M parameters + AdamW, 577 MiB of state, an epoch of about 1.9 s) with
one piece of work started on a thread at every epoch's end, as a persist is, the next safe point
waiting for it if it has not ended:

- no checkpoint: nothing (what the overhead is measured against);
- direct write: the state's size written from one 4 MiB aligned buffer with ``O_DIRECT`` (through
  the page cache where the file system refuses it), then ``fsync``: what writing a durable
  checkpoint costs with no copy and no hash, the least any durable checkpoint costs;
- xxh3-128: a non-cryptographic checksum over a copy of the state (the fingerprint pass that
  finds unchanged chunks), one thread;
- BLAKE3: the cryptographic hash a manifest records, over the same bytes, one thread (hashing on
  more threads takes the same CPU time);
- direct write + BLAKE3: the two, one after the other;
- colab_resilience, background: the package's save as a run makes it (a snapshot into staging
  memory, then hashing, writing and committing on its threads).

Every row runs once per pass, passes repeat the same order and begin with a row without
checkpoints; a row's overhead is its mean epoch over the passes against the mean of the rows
without checkpoints, with each pass's beside it (an epoch's time drifts over a run). "work (s)"
is the mean duration of the row's work on its thread (for the package, a persist: snapshot to
``LATEST``).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import background_save as bench  # noqa: E402
import blake3  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from colab_resilience.checkpoints.staging import Budget  # noqa: E402

MiB = 1 << 20
BLOCK = 4 * MiB
CHUNK = 8 * MiB


class Work:
    """``job`` on a thread started at every safe point, the previous one waited for first."""

    def __init__(self, job):
        self.job, self.thread, self.seconds = job, None, []

    def _run(self) -> None:
        t = time.perf_counter()
        self.job()
        self.seconds.append(time.perf_counter() - t)

    def __call__(self, model, opt) -> None:
        if self.thread is not None:
            self.thread.join()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def extra(self) -> dict:
        return {"persist": statistics.mean(self.seconds) if self.seconds else None}


class Parts:
    """The parts of a persist over ``nbytes``, writing in ``folder``."""

    def __init__(self, folder: Path, nbytes: int):
        self.path, self.nbytes = folder / "floor.bin", nbytes
        self.block = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
        self.block.write(os.urandom(BLOCK))
        self.state = np.empty(nbytes, dtype=np.uint8)
        self.state[:] = np.frombuffer(os.urandom(MiB), dtype=np.uint8).repeat(-(-nbytes // MiB))[:nbytes]
        self.direct = self._direct_ok()

    def _direct_ok(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except (OSError, AttributeError):
            return False
        try:
            os.write(fd, self.block)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def write(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            for _ in range(-(-self.nbytes // BLOCK)):
                os.write(fd, self.block)
            os.fsync(fd)
        finally:
            os.close(fd)

    def xxh3(self) -> None:
        view = memoryview(self.state)
        for a in range(0, self.nbytes, CHUNK):
            xxhash.xxh3_128_digest(view[a : a + CHUNK])

    def blake3(self) -> None:
        view = memoryview(self.state)
        for a in range(0, self.nbytes, CHUNK):
            blake3.blake3(view[a : a + CHUNK]).digest()

    def write_and_blake3(self) -> None:
        self.write()
        self.blake3()


def main() -> None:
    a, model, opt, steps = bench.alternating_workload(__doc__, params=50e6, epoch_seconds=1.9, epochs=3, passes=3)
    nbytes = bench.state_bytes(model, opt)
    root = Path(tempfile.mkdtemp(prefix="cr-floor-", dir=a.dir))
    try:
        parts = Parts(root, nbytes)
        rows = [
            ("no checkpoint", None),
            ("direct write" if parts.direct else "write (page cache: O_DIRECT refused here)", lambda: Work(parts.write)),
            ("xxh3-128", lambda: Work(parts.xxh3)),
            ("BLAKE3", lambda: Work(parts.blake3)),
            ("direct write + BLAKE3", lambda: Work(parts.write_and_blake3)),
            ("colab_resilience, background", lambda: bench.OurSaver(root / "bg", Budget())),
        ]
        alone = {}
        for label, make in rows[1:-1]:  # each part's seconds with nothing beside it
            job = make().job
            job()
            t, c = time.perf_counter(), time.process_time()
            job()
            alone[label] = (time.perf_counter() - t, time.process_time() - c)
        print(f"{a.params / 1e6:.0f}M parameters ({nbytes / MiB:.0f} MiB of state) on {a.device}, torch on "
              f"{torch.get_num_threads()} threads of {os.cpu_count()} CPUs, epochs of {steps} steps of {a.batch}; "
              f"writing to {root} ({bench.file_system(root)}{', O_DIRECT' if parts.direct else ''})", flush=True)
        results: dict[str, list[dict]] = {label: [] for label, _ in rows}
        for n in range(a.passes):
            for label, make in rows:
                r = bench.run_row(model, opt, make() if make else None, a.epochs, steps, a.batch)
                shutil.rmtree(root / "bg", ignore_errors=True)
                results[label].append(r)
                print(f"  pass {n + 1}, {label}: epoch {r['epoch']:.3f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = bench.against_no_checkpoint(results)
    print("| work at every epoch's end | alone: wall (s) | alone: CPU (s) | work beside training (s) "
          "| epoch (s) | overhead | overhead in each pass |")
    print("|---|---|---|---|---|---|---|")
    for label, (epoch, overhead, each) in summary.items():
        wall, cpu = alone.get(label, (None, None))
        work = statistics.mean(r["persist"] for r in results[label] if r.get("persist") is not None)
        print(f"| {label} | {'–' if wall is None else f'{wall:.3f}'} | {'–' if cpu is None else f'{cpu:.3f}'} | "
              f"{work:.3f} | {epoch:.3f} | {overhead} | {each} |")

if __name__ == "__main__":
    main()
