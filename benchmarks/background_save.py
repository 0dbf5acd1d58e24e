"""What a checkpoint at every epoch costs training: the stall per safe point and the overhead, for
this package's background saves against its synchronous ones, torch.save and
torch.distributed.checkpoint.async_save, with the copy floor, in one run.

    python benchmarks/background_save.py [--params 50e6 100e6] [--epochs 6] [--steps 7] [--batch 96]
                                         [--slow-mbps 50] [--slow-epochs 3] [--dir DIR] [--threads N]
                                         [--device cuda] [--epoch-seconds S]

Workload: a stack of nn.Linear(1024, 1024) layers (``--params`` parameters) trained with AdamW on
random batches; an epoch is ``--steps`` optimizer steps, and every epoch ends in a safe point that
saves the model and the optimizer (the state: 12 bytes per parameter, 577 MiB at 50M; 7 steps
make an epoch of about 1.9 s here, the workload of issue 18). Each row trains ``--epochs`` epochs
after one untimed warm-up epoch, in this process, with torch's default threads, one row after the
other, all writing to ``--dir`` (every write fsync'ed):

- no checkpoint: the epoch alone (what the overhead is measured against), measured first and
  again last; the table gives their mean, and their difference as the run's noise;
- copy floor: the state's bytes copied into a buffer allocated once (what a snapshot cannot beat);
- colab_resilience, synchronous: ``staging_memory off``, a save while training waits (the code
  path a run used before issue 18, and uses now under ``ulimit -v``);
- colab_resilience, background: the default, a snapshot into staging memory, then the persist on
  its own thread while training goes on (:class:`colab_resilience.saving.Saver`, what a run uses);
- the same with its blobs written through the page cache (``blobs.DIRECT_IO = False``, as before
  direct writes), to show what the page cache costs on this machine;
- torch.save + fsync of ``{"model": ..., "opt": ...}`` state dicts;
- torch.distributed.checkpoint.async_save in one process (it copies to CPU, then writes on a
  thread; the next safe point waits for the previous write, as ours does).

Stall: the time from the end of the epoch's training to the start of the next epoch's (the safe
point as training sees it, waiting for a previous persist included). Overhead: the mean epoch with
its safe point against the mean epoch without any. For this package's rows, what explains them:
a persist's mean seconds (from the snapshot until ``LATEST`` names the checkpoint) and the seconds
a safe point waited for the previous persist, per safe point. The header names the file system
written to, and whether blobs go to it with ``O_DIRECT``. Below each table, the CPU time one persist
takes on its own (a synchronous save with no training, user + system seconds of this process):
where training keeps every core busy, that work has no idle core to run on, and it is the floor
of what a background save can cost. A slow disk (a Google Drive mount writes tens
of MB/s) is stood in for by a rate-limited writer: ``--slow-mbps`` caps every blob write of the
package at that rate (the writing thread sleeps, as it would wait on the device), for the
synchronous and background rows at 50M, background with ``when_busy`` both ``wait`` and ``skip``.

``--device cuda``: the model, the optimizer's state and the batches live on the GPU (TF32 matrix
products, as a GPU training runs them), and an epoch's time counts until the GPU has finished
it. The copy floor is then the state copied device-to-host into pinned memory allocated once:
a snapshot must reach host memory to be written (a copy kept on the GPU would take the GPU
memory an OOM is made of). ``--epoch-seconds S`` sets the steps of an epoch so that one takes
about S seconds (measured after the warm-up), for a GPU whose steps are much shorter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from colab_resilience.checkpoints import CheckpointStore, blobs  # noqa: E402
from colab_resilience.checkpoints.staging import Budget, parse_budget  # noqa: E402
from colab_resilience.saving import Saver  # noqa: E402

MiB = 1 << 20
WIDTH = 1024


DEVICE = torch.device("cpu")


def use_device(name: str) -> None:
    """Train on ``name``: cpu, or cuda with TF32 matrix products (as a GPU training runs them)."""
    global DEVICE
    DEVICE = torch.device(name)
    if DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True


def steps_for(model, opt, seconds: float, batch: int) -> int:
    """The steps that make an epoch about ``seconds`` long, timed over 5 after 3 of warm-up."""
    train_epoch(model, opt, 3, batch)
    t0 = time.perf_counter()
    train_epoch(model, opt, 5, batch)
    return max(1, round(seconds / ((time.perf_counter() - t0) / 5)))


def alternating_workload(doc: str, *, params: float, epoch_seconds: float, epochs: int, passes: int):
    """The command line of the benchmarks whose rows alternate in passes (their defaults given),
    and the workload it asks for: (arguments, model, optimizer, steps of an epoch)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--params", type=float, default=params)
    p.add_argument("--device", default="cpu")
    p.add_argument("--epoch-seconds", type=float, default=epoch_seconds)
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--passes", type=int, default=passes)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--dir", type=Path, default=None)
    a = p.parse_args()
    use_device(a.device)
    model, opt = build(a.params)
    train_epoch(model, opt, 1, a.batch)  # the optimizer's state exists
    return a, model, opt, steps_for(model, opt, a.epoch_seconds, a.batch)


def against_no_checkpoint(results: dict[str, list[dict]]) -> dict[str, tuple[float, str, str]]:
    """For rows run in passes (each row's results, one per pass, the row "no checkpoint" among
    them): print the epoch without checkpoints, and give every other row's mean epoch, its
    overhead over the passes and its overhead in each pass."""
    base_runs = [r["epoch"] for r in results["no checkpoint"]]
    base = statistics.mean(base_runs)
    print(f"\nWithout checkpoints: {base:.3f} s an epoch (passes: {', '.join(f'{e:.3f}' for e in base_runs)})\n")
    out = {}
    for label, rs in results.items():
        if label != "no checkpoint":
            epoch = statistics.mean(r["epoch"] for r in rs)
            out[label] = (epoch, f"{100 * (epoch - base) / base:+.1f}%",
                          ", ".join(f"{100 * (r['epoch'] - base) / base:+.1f}%" for r in rs))
    return out


def build(params: float):
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_epoch(model, opt, steps: int, batch: int) -> None:
    for _ in range(steps):
        x = torch.randn(batch, WIDTH, device=DEVICE)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)  # the epoch ends when the GPU has done its work


def state_bytes(model, opt) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return n


def tensors(model, opt):
    yield from model.state_dict().values()
    for s in opt.state.values():
        yield from (v for v in s.values() if isinstance(v, torch.Tensor))


class CopyFloor:
    """A snapshot's floor: every byte of the state copied into one buffer allocated once."""

    def __init__(self, nbytes: int):
        if DEVICE.type == "cuda":  # device-to-host, into pinned memory
            self.buf = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self.buf = np.ones(nbytes, dtype=np.uint8)

    def __call__(self, model, opt) -> None:
        pos = 0
        for t in tensors(model, opt):
            n = t.numel() * t.element_size()
            if DEVICE.type == "cuda":
                self.buf[pos : pos + n].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
            else:
                src = np.frombuffer(memoryview(t.detach().numpy()).cast("B"), dtype=np.uint8)
                np.copyto(self.buf[pos : pos + n], src)
            pos += n
        if DEVICE.type == "cuda":
            torch.cuda.synchronize(DEVICE)


class OurSaver:
    def __init__(self, folder: Path, budget: Budget, when_busy: str = "wait"):
        self.store = CheckpointStore(folder, key=b"k" * 32, run_id="bench")
        self.saver = Saver(self.store, budget=budget, when_busy=when_busy, on_durable=self._durable,
                           say=lambda line: print("   ", line, flush=True))
        self.saved = 0
        self.persists: list[float] = []  # each persist's seconds, snapshot to LATEST

    def _durable(self, report, info) -> None:
        self.persists.append(report.seconds)

    def __call__(self, model, opt) -> None:
        if self.saver.save({"model": model, "opt": opt}, ["model", "opt"], meta={}, info=None):
            self.saved += 1

    def close(self) -> None:
        self.saver.close()

    def extra(self) -> dict:
        """What explains this row's stall: a persist's seconds, and the time safe points waited
        for the previous one (per safe point, the warm-up's included)."""
        st = self.saver.stats
        return {"persist": statistics.mean(self.persists) if self.persists else None,
                "waited": st.waited_seconds / max(1, self.saved)}


class Buffered(OurSaver):
    """Background saves whose blobs go through the page cache (no O_DIRECT), for the row's span."""

    def __init__(self, folder: Path, budget: Budget):
        super().__init__(folder, budget)
        blobs.DIRECT_IO = False

    def close(self) -> None:
        super().close()
        blobs.DIRECT_IO = True


def persist_cpu(folder: Path, model, opt, repeat: int = 3) -> tuple[float, float, float]:
    """(wall, CPU, of which system) seconds of a synchronous save of state that changed, nothing
    else running: the run with the least CPU time of ``repeat``."""
    store = CheckpointStore(folder, key=b"k" * 32, run_id="cpu")
    best = (float("inf"), float("inf"), 0.0)
    for _ in range(repeat):
        train_epoch(model, opt, 1, 8)  # every tensor changes
        c0, w0 = os.times(), time.perf_counter()
        store.save({"model": model, "opt": opt}, ["model", "opt"], meta={})
        c1, w1 = os.times(), time.perf_counter()
        best = min(best, (w1 - w0, (c1.user - c0.user) + (c1.system - c0.system), c1.system - c0.system),
                   key=lambda x: x[1])
    shutil.rmtree(folder, ignore_errors=True)
    return best


class TorchSave:
    def __init__(self, folder: Path):
        self.path = folder / "state.pt"
        folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, model, opt) -> None:
        with open(self.path, "wb") as f:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())


class DcpAsync:
    def __init__(self, folder: Path):
        import torch.distributed.checkpoint as dcp

        self.dcp, self.folder, self.future, self.n = dcp, folder, None, 0

    def __call__(self, model, opt) -> None:
        if self.future is not None:
            self.future.result()  # one in flight, as ours
        self.n += 1
        self.future = self.dcp.async_save({"model": model.state_dict(), "opt": opt.state_dict()},
                                          checkpoint_id=str(self.folder / f"c{self.n % 2}"))

    def close(self) -> None:
        if self.future is not None:
            self.future.result()


def run_row(model, opt, save, epochs: int, steps: int, batch: int) -> dict:
    """One warm-up epoch (with its save), then ``epochs`` timed ones."""
    train_epoch(model, opt, steps, batch)
    if save is not None:
        save(model, opt)
    epoch_times, stalls = [], []
    for _ in range(epochs):
        t0 = time.perf_counter()
        train_epoch(model, opt, steps, batch)
        t1 = time.perf_counter()
        if save is not None:
            save(model, opt)
        t2 = time.perf_counter()
        epoch_times.append(t2 - t0)
        stalls.append(t2 - t1)
    if hasattr(save, "close"):
        save.close()
    out = {"epoch": statistics.mean(epoch_times), "stall": statistics.mean(stalls), "worst": max(stalls)}
    if hasattr(save, "extra"):
        out.update(save.extra())
    return out


class RateLimit:
    """Every blob write of the package capped at ``mbps`` MB/s (a slow device, waited on)."""

    def __init__(self, mbps: float):
        self.rate, self.lock, self.free_at = mbps * 1e6, threading.Lock(), 0.0
        self.original = blobs.write_all

    def write_all(self, fd, data) -> None:
        self.original(fd, data)
        n = memoryview(data).nbytes
        with self.lock:
            now = time.monotonic()
            self.free_at = max(self.free_at, now) + n / self.rate
            wait = self.free_at - now
        time.sleep(wait)

    def __enter__(self):
        blobs.write_all = self.write_all
        return self

    def __exit__(self, *exc):
        blobs.write_all = self.original


def file_system(path: Path) -> str:
    """The type and device of the file system ``path`` is on (the mount with the longest prefix)."""
    best = ("", "?", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                dev, point, kind = line.split()[:3]
                point = point.replace("\\040", " ")
                if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best[0]):
                    best = (point, kind, dev)
    except OSError:
        pass
    return f"{best[1]} on {best[0] or '?'}, {best[2]}"


def print_table(params, nbytes, results, cpu_wall, cpu, cpu_system) -> None:
    first, again = results[0][1]["epoch"], dict(results)["no checkpoint (again)"]["epoch"]
    base = (first + again) / 2
    results = [(label, r) for label, r in results if label != "no checkpoint (again)"]
    floor = results[1][1]["stall"]
    print(f"\n{params / 1e6:.0f}M parameters + AdamW ({nbytes / MiB:.0f} MiB, on {DEVICE.type}), a checkpoint every epoch "
          f"(epoch without one: {base:.2f} s, {first:.2f} s first and {again:.2f} s last: noise "
          f"{100 * abs(first - again) / base:.1f}%)\n")
    print("| safe point | stall per safe point (s) | × copy floor | worst stall (s) | epoch (s) | overhead "
          "| persist (s) | of the stall, waiting for the previous persist (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in results:
        if "failed" in r:
            print(f"| {label} | failed here ({r['failed']}) | – | – | – | – | – | – |")
            continue
        if label == "no checkpoint":
            print(f"| {label} (mean of first and last) | – | – | – | {base:.2f} | – | – | – |")
            continue
        saved = f" (saved {r['saved']})" if "saved" in r else ""
        persist = "–" if r.get("persist") is None else f"{r['persist']:.3f}"
        waited = "–" if "waited" not in r else f"{r['waited']:.3f}"
        print(f"| {label}{saved} | {r['stall']:.3f} | {r['stall'] / floor:.1f} | {r['worst']:.3f} | "
              f"{r['epoch']:.2f} | {100 * (r['epoch'] - base) / base:+.1f}% | {persist} | {waited} |")
    print(f"\nOne persist alone (a synchronous save, no training): {cpu_wall:.3f} s, {cpu:.3f} s of CPU, "
          f"{cpu_system:.3f} s of it in the kernel ({100 * cpu / base:.1f}% of an epoch: the floor of the overhead "
          "where training keeps every core busy)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, nargs="+", default=[50e6, 100e6])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--slow-mbps", type=float, default=50.0)
    p.add_argument("--slow-epochs", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch's threads (default: its own choice, every CPU); fewer leave a CPU to the "
                        "persist, as a training on a GPU does")
    p.add_argument("--device", default="cpu", help="where the model trains: cpu, or cuda")
    p.add_argument("--epoch-seconds", type=float, default=None,
                   help="steps per epoch chosen to make an epoch about this long (instead of --steps)")
    a = p.parse_args()
    use_device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", module="torch.distributed")  # "assuming ... a single process"
    root = Path(tempfile.mkdtemp(prefix="cr-bgsave-", dir=a.dir))
    where = f", on {torch.cuda.get_device_name(DEVICE)}" if DEVICE.type == "cuda" else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs{where}; "
          f"writing to {root} ({file_system(root)}; blobs written "
          f"{'directly (O_DIRECT)' if blobs.direct_io(root) else 'through the page cache: O_DIRECT is refused there'})")
    try:
        for params in a.params:
            model, opt = build(params)
            train_epoch(model, opt, 1, a.batch)  # the optimizer's state exists
            if a.epoch_seconds:
                a.steps = steps_for(model, opt, a.epoch_seconds, a.batch)
            nbytes = state_bytes(model, opt)
            print(f"\n{params / 1e6:.0f}M parameters: {nbytes / MiB:.0f} MiB of state; epochs of {a.steps} steps "
                  f"of {a.batch}", flush=True)
            rows = [
                ("no checkpoint", lambda: None),
                ("copy floor (into a buffer allocated once)", lambda: CopyFloor(nbytes)),
                ("colab_resilience, synchronous", lambda: OurSaver(root / "sync", parse_budget("off"))),
                ("colab_resilience, background (default)", lambda: OurSaver(root / "bg", Budget())),
                ("... its blobs written through the page cache", lambda: Buffered(root / "bg", Budget())),
                ("torch.save + fsync", lambda: TorchSave(root / "torch")),
                ("torch.distributed.checkpoint.async_save", lambda: DcpAsync(root / "dcp")),
                ("no checkpoint (again)", lambda: None),
            ]
            results = []
            for label, make in rows:
                print(f"  {label} ...", flush=True)
                try:
                    results.append((label, run_row(model, opt, make(), a.epochs, a.steps, a.batch)))
                except Exception as e:  # a row that cannot run here (async_save's requirements) is named
                    print(f"    failed: {type(e).__name__}: {e}", flush=True)
                    results.append((label, {"failed": f"{type(e).__name__}"}))
                for sub in ("sync", "bg", "torch", "dcp"):
                    shutil.rmtree(root / sub, ignore_errors=True)
            if params == a.params[0] and a.slow_mbps:
                slow = f"{a.slow_mbps:g} MB/s disk"
                for label, make in [
                    (f"colab_resilience, synchronous, {slow}", lambda: OurSaver(root / "sync", parse_budget("off"))),
                    (f"colab_resilience, background, {slow}", lambda: OurSaver(root / "bg", Budget())),
                    (f"... when_busy='skip', {slow}", lambda: OurSaver(root / "bg", Budget(), "skip")),
                ]:
                    print(f"  {label} ...", flush=True)
                    saver = make()
                    with RateLimit(a.slow_mbps):
                        r = run_row(model, opt, saver, a.slow_epochs, a.steps, a.batch)
                    r["saved"] = f"{saver.saved - 1}/{a.slow_epochs}"  # less the warm-up's
                    results.append((label, r))
                    for sub in ("sync", "bg"):
                        shutil.rmtree(root / sub, ignore_errors=True)
            print("  one persist alone ...", flush=True)
            cpu = persist_cpu(root / "cpu", model, opt)
            print_table(params, nbytes, results, *cpu)  # each size's table as soon as it is measured
            del model, opt
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
