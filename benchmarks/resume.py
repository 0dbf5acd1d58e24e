"""Resume speed: from a kernel restart request to the first resumed iteration, phase by phase,
against the floor and against re-running the notebook from scratch, in one run.

    python benchmarks/resume.py [--params 50e6] [--iters 4] [--fault request|kill] [--repeat 3]
                                [--kernel python3] [--quick]

Workload: a stack of nn.Linear(1024, 1024) layers (``--params`` parameters) trained with AdamW
(``--steps`` steps of ``--batch`` random rows per iteration), written as a user would: a
``%%replay`` imports cell, a ``%%replay`` set-up cell (model + optimizer), and a
``%%resilient --save model,opt,history`` loop over ``resume_range``, checkpointed at every
iteration. It runs under ``colab_resilience.run_notebook`` (real kernels, IPC sockets). After
``--iters`` iterations the kernel goes: with ``--fault request`` (default) because
``%restart_after ITERS`` asks for a planned restart (the kernel re-checks its checkpoint, writes
the journal and exits with code 75); with ``--fault kill`` it SIGKILLs itself at the start of the
next iteration (right after that checkpoint). The driver restarts the kernel, replays the set-up
cells and re-executes the training cell, which restores the checkpoint and continues.

Each repetition runs the faulty notebook twice: with the driver's standby kernel (the default: a
second kernel started ahead of need, warmed with the working kernel's imports, takes over) and
with ``standby=False`` (jupyter_client restarts the kernel: a cold start, the imports redone).

Phases (wall clock; the kernels write ``time.time()`` stamps to a log file, with their PID):

- leave: the restart request -> the kernel calls ``os._exit``. The request is the safe point after
  iteration ITERS-1, right after its regular checkpoint (the point where an uninterrupted run
  would start the next iteration); in between, the package saves again (force) and writes the
  journal. Zero with ``--fault kill`` (the request is the SIGKILL).
- kernel restart: ``os._exit`` (or the SIGKILL) -> the first line of the first replayed cell runs
  in the new kernel: the package's 0.1 s wait for output to flush before ``os._exit``, the driver
  noticing the death (polled every 0.1 s), jupyter_client's restart (a new Python with ipykernel
  and the extension loaded) or the standby's adoption, the client connecting, the first replay
  cell sent.
- imports: ``import torch`` in the first replayed cell.
- replay: the set-up cell (building the model and the optimizer), from the end of the imports.
  Under torch 2.13 the first optimizer built in a process imports ``torch._dynamo`` (about 800
  modules); the table shows that part separately.
- cell start: the end of the set-up -> the first line of the ``%%resilient`` body (the driver
  sending the cell, the run reopening its journal, lock and key).
- restore: the first line of the body -> the first line of the first resumed iteration (loading
  and verifying the checkpoint, restoring model, optimizer, history and RNG states in place).
- total: the restart request -> the first line of the first resumed iteration.

Floor, measured after the run in the same conditions (warm page cache): a fresh kernel
(``KernelManager.start_kernel`` -> the first line of a cell runs), ``import torch``, and a raw
read (``readinto``, 16 MiB chunks, no verification) of the files the checkpoint holds on disk
(its blobs and manifest: the same bytes). Re-run: papermill (its default engine, no
colab_resilience) runs the same notebook from scratch; timed from the call to the first line of
iteration ITERS (set-up + the ITERS iterations already done, without checkpoints). Times are the
median of ``--repeat`` runs; ratios come from this run only. Target: total <= 1.5x the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _kernels as K  # noqa: E402

PHASES = ["leave", "kernel restart", "imports", "replay", "optimizer", "cell start", "restore", "total"]


def phases(marks: list[K.Mark], iters: int, fault: str) -> tuple[dict[str, float], list[str]]:
    """The phases of one faulty run from its time stamps; and notes on anything unexpected."""
    notes = []
    starts = [m for m in marks if m.name == "cell_start"]
    if len(starts) < 2:
        raise SystemExit(f"expected a restart, found {len(starts)} kernel(s) running the training cell")
    p1, p2 = starts[0].pid, starts[-1].pid
    if fault == "kill":
        request = exit_ = K.mark_time(marks, "request", p1)
    else:
        request = K.mark_time(marks, "safe_point", p1, last=True)
        exit_ = K.mark_time(marks, "exit", p1)
        if request is None or exit_ is None:  # the package's internals moved: coarser stamps
            notes.append("no safe-point/exit stamps (package internals changed): the request is the end of "
                         "the last iteration's body, so 'leave' includes its regular checkpoint")
            request = K.mark_time(marks, f"iter_end:{iters - 1}", p1)
            exit_ = exit_ or request
    if sum(1 for m in marks if m.name == "replay_start" and m.pid == p2) != 1:
        notes.append("the imports cell ran more than once in the resumed kernel (replayed twice?)")
    t = {
        "ready": K.mark_time(marks, "replay_start", p2),
        "imports_end": K.mark_time(marks, "imports_end", p2),
        "optimizer_start": K.mark_time(marks, "optimizer_start", p2),
        "setup_end": K.mark_time(marks, "setup_end", p2),
        "cell_start": K.mark_time(marks, "cell_start", p2),
        "resumed": K.mark_time(marks, f"iter_start:{iters}", p2),
    }
    if None in t.values() or request is None:
        raise SystemExit(f"missing time stamps: {t}, request {request}")
    return {
        "leave": exit_ - request,
        "kernel restart": t["ready"] - exit_,
        "imports": t["imports_end"] - t["ready"],
        "replay": t["setup_end"] - t["imports_end"],
        "optimizer": t["setup_end"] - t["optimizer_start"],
        "cell start": t["cell_start"] - t["setup_end"],
        "restore": t["resumed"] - t["cell_start"],
        "total": t["resumed"] - request,
    }, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    K.add_workload_args(ap, steps=2, what="model")
    ap.add_argument("--iters", type=int, default=4, help="iterations done before the restart (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="faulty runs, floors and re-runs (median; default 3)")
    ap.add_argument("--quick", action="store_true", help="--params 5e6 --iters 2 --repeat 1 (well under a minute)")
    args = ap.parse_args()
    if args.quick:
        args.params, args.iters, args.repeat = 5_000_000, 2, 1
    if args.iters < 1:
        ap.error("--iters must be at least 1")

    w = K.workload_from(args, epochs=args.iters + 1)
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    floors: list[K.Floor] = []
    reruns: list[float] = []
    driver_seconds: dict[bool, list[float]] = {False: [], True: []}
    notes: list[str] = []
    with K.workspace(args.kernel, "cr-bench-resume-") as (root, kernel):
        for rep in range(args.repeat):
            work = root / f"rep-{rep}"
            work.mkdir()
            for standby in (True, False):
                kind = "standby" if standby else "cold"
                log = work / f"marks-{kind}.log"
                nb = K.workload_notebook(w, log, fault=args.fault, every=args.iters, kill_at=(args.iters,),
                                         workdir=work, instrument=True)
                result = K.supervised(nb, work / f"faulty-{kind}.ipynb", kernel, work / f"runs-{kind}", work,
                                      max_restarts=2, standby=standby)
                if len(result.restarts) != 1:
                    raise SystemExit(f"expected 1 restart, got {len(result.restarts)}: "
                                     f"{[r.reason for r in result.restarts]}")
                if result.restarts[0].standby != standby:
                    notes.append(f"a {kind} run restarted {'with' if result.restarts[0].standby else 'without'} "
                                 "the standby")
                driver_seconds[standby].append(result.restarts[0].seconds)
                got, why = phases(K.read_marks(log), args.iters, args.fault)
                runs[standby].append(got)
                notes += [n for n in why if n not in notes]

            floors.append(K.floor(kernel, K.checkpoint_files(work / "runs-cold")))

            plain_log = work / "plain.log"
            plain = K.plain_notebook(K.workload_notebook(w, plain_log))
            t0 = time.time()
            K.papermill_run(plain, work, kernel)
            reached = K.mark_time(K.read_marks(plain_log), f"iter_start:{args.iters}")
            reruns.append(reached - t0)

    med = {sb: {p: statistics.median(r[p] for r in runs[sb]) for p in PHASES} for sb in (True, False)}
    fl = K.Floor(*(statistics.median(getattr(f, a) for f in floors) for a in ("kernel_start", "imports", "read")),
                 floors[0].nbytes)
    rerun = statistics.median(reruns)
    import torch

    how = {"request": f"%restart_after {args.iters}", "kill": "SIGKILL from inside"}[args.fault]
    print(f"resume benchmark: {w.nparams / 1e6:.1f}M parameters + AdamW state, checkpoint "
          f"{fl.nbytes / (1 << 20):.0f} MiB on disk; restart after {args.iters} iterations "
          f"({how}); median of {args.repeat}; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print()
    cold, warm = med[False], med[True]
    floors_of = {"kernel restart": fl.kernel_start, "imports": fl.imports, "restore": fl.read, "total": fl.total}

    def row(label: str, phase: str, shown: bool = True):
        f = floors_of.get(phase)
        return (label, K.secs(cold[phase]) if shown else None, K.secs(warm[phase]) if shown else None, K.secs(f),
                K.ratio(cold[phase], f) if shown else None, K.ratio(warm[phase], f) if shown else None)

    rows = [
        row("leave (re-save, journal, exit)", "leave", args.fault == "request"),
        row("kernel restart | fresh kernel start", "kernel restart"),
        row("imports (import torch)", "imports"),
        row("replay (set-up cell: model + AdamW)", "replay"),
        row("  of which AdamW(...) (imports torch._dynamo)", "optimizer"),
        row("cell start (driver, journal, run)", "cell start"),
        row("restore (load, verify, in place) | raw read", "restore"),
        (),
        row("total: request -> first resumed iteration", "total"),
        (f"re-run from scratch to iteration {args.iters} (papermill)", K.secs(rerun), K.secs(rerun), K.secs(fl.total),
         K.ratio(rerun, fl.total), K.ratio(rerun, fl.total)),
    ]
    K.table(rows, ("phase (resume | floor)", "cold s", "standby s", "floor s", "cold x", "standby x"))
    print()
    print("targets:")
    for name, m in (("standby kernel (default)", warm), ("cold restart (standby=False)", cold)):
        K.target(f"{name}: resume <= 1.5x floor (fresh kernel + import torch + raw read)",
                 m["total"] <= 1.5 * fl.total, f"{m['total'] / fl.total:.2f}x")
        K.target(f"{name}: resume faster than re-running from scratch", m["total"] < rerun,
                 f"{rerun / m['total']:.2f}x faster")
    print()
    print(f"The driver's own figure (Restart.seconds: death noticed -> set-up cells replayed): "
          f"{statistics.median(driver_seconds[True]):.2f} s with the standby, "
          f"{statistics.median(driver_seconds[False]):.2f} s cold.")
    for n in notes:
        print(f"note: {n}")


if __name__ == "__main__":
    main()
