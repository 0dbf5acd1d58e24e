"""Time lost per fault (kernel restart or in-process OOM recovery) under colab_resilience's supervisor, against the floor and against
re-running the notebook from scratch with papermill (what users do today), in one run.

    python benchmarks/recovery.py [--params 50e6] [--epochs 40] [--steps 3] [--restarts 2]
                                  [--fault kill|request] [--demo-epochs 12] [--only demo|workload]
                                  [--kernel python3] [--quick] [--no-standby]

Two notebooks, each run twice under ``colab_resilience.run_notebook`` (real kernels, IPC
sockets): once with faults, once without.

- demo: the bundled ``colab_resilience/notebooks/demo.ipynb``, as ``colab-resilience demo`` runs
  it: the faulty run hits a real out-of-memory error under a memory cap (``--shrink`` halves the
  batch and retries in process; past the retries the kernel restarts) and a real SIGKILL in the
  middle of epoch 2; the uninterrupted run trains with the batch size the faulty run ended with.
  ``--demo-epochs`` sets its ``epochs`` parameter.
- workload: a stack of nn.Linear(1024, 1024) layers (``--params`` parameters) trained with AdamW
  (``--steps`` steps of ``--batch`` rows per epoch) in a ``%%resilient --save model,opt,history``
  loop over ``resume_range(--epochs)``, checkpointed at every epoch, with ``%%replay`` imports and
  set-up cells. Faults: ``--restarts`` SIGKILLs from inside at the start of evenly spaced epochs
  (default) or planned restarts (``--fault request``: ``%restart_after``, the kernel asks for
  them). 40 epochs: a crash at 80% of a 10-epoch run (11 s under papermill) loses less than 5
  restarts cost however fast they are; real training runs are longer still.

Both supervised runs use the driver's standby kernel (a second kernel started ahead of need and
warmed with the working kernel's imports, which takes over after a death), as
``colab-resilience run`` does by default; ``--no-standby`` measures cold restarts instead.

Definitions:

- time lost per fault = (wall time of the faulty supervised run - wall time of the
  uninterrupted supervised run) / number of faults, a fault being a kernel restart or an
  in-process OOM recovery (the demo's ``--shrink`` retries; without colab_resilience each one
  ends the run too). Everything the faults cost is in it (for the demo the failed attempts at
  too big a batch and the part of epoch 2 redone after the kill).
- floor = a fresh kernel (``KernelManager.start_kernel`` -> the first line of a cell runs) +
  ``import torch`` + a raw read (``readinto``, no verification) of the files the notebook's last
  checkpoint holds on disk (its blobs and manifest), page cache warm as for the resume.
- re-running from scratch: papermill (its default engine) runs the notebook without
  colab_resilience (the ``%load_ext``/``%%replay``/``%%resilient``/``%restart_after`` lines
  removed, ``resume_range`` -> ``range``), uninterrupted, in T seconds (kernel start included).
  A crash at 80% of the run loses the 80% of the work done and a kernel start:
  lost = K + 0.8 x (T - K), K being the floor's kernel start.

- for the workload, also stamped in the run: see :func:`stamped_losses`.

Targets: time lost per fault <= 1.5x the floor; >= 5x less time lost than re-running from
scratch after a crash at 80%. One run of each; ratios come from this run only.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _kernels as K  # noqa: E402

from colab_resilience.demo import oom_recoveries  # noqa: E402

CRASH_AT = 0.8


def result_line(nb) -> str | None:
    """The last ``RESULT ...`` line the notebook printed."""
    for cell in reversed(nb.cells):
        for out in cell.get("outputs", []):
            for line in out.get("text", "").splitlines():
                if line.startswith("RESULT "):
                    return line
    return None


def epoch_marks(marks: list, kind: str) -> dict:
    """{epoch: the last ``kind`` mark of it} (``iter_start`` or ``iter_end``)."""
    return {int(m.name.split(":")[1]): m for m in marks if m.name.startswith(f"{kind}:")}


def stamped_losses(marks: list) -> list[float]:
    """Time lost to each fault, from the faulty run's own time stamps. For an epoch whose start
    was logged by another kernel than the previous epoch's end (a restart came between): the gap
    from that end to the start in the new kernel, less the run's usual gap between epochs (its
    checkpoint), plus how much longer that first epoch in the new kernel took than the run's
    usual epoch (a new process warming up, a standby starting beside it). Both ends are stamped
    in the same run, seconds apart, so this does not carry the noise of two 30-100 s wall times
    (40 checkpoints whose fsync takes 0.5-3 s each) that the difference of runs does."""
    import statistics

    ends, starts = epoch_marks(marks, "iter_end"), epoch_marks(marks, "iter_start")
    gaps, faults, durations = [], [], []
    for e in sorted(starts):
        if e - 1 in ends:
            gap = starts[e].t - ends[e - 1].t
            if starts[e].pid != ends[e - 1].pid:
                faults.append((gap, ends[e].t - starts[e].t if e in ends else 0.0))
            else:
                gaps.append(gap)
                if e in ends:
                    durations.append(ends[e].t - starts[e].t)
    usual_gap = statistics.median(gaps) if gaps else 0.0
    usual_epoch = statistics.median(durations) if durations else 0.0
    return [(g - usual_gap) + max(0.0, d - usual_epoch) for g, d in faults]


def usual_cycle(marks: list) -> float | None:
    """The median time from one epoch's start to the next one's in the same kernel (training and
    checkpoint): where the two supervised runs differ in it, their wall times differ by that times
    the number of epochs, faults or not."""
    import statistics

    starts = epoch_marks(marks, "iter_start")
    cycles = [starts[e + 1].t - starts[e].t for e in starts if e + 1 in starts and starts[e + 1].pid == starts[e].pid]
    return statistics.median(cycles) if cycles else None


def measure(work: Path, kernel: str, faulty_nb, clean_nb, plain_nb, *, faulty_params=None, clean_params=None,
            plain_params=None, max_restarts=3, standby=True, logs: tuple[Path, Path] | None = None) -> dict:
    """Faulty and uninterrupted supervised runs (``standby``: with the driver's standby kernel),
    the floor, the papermill re-run; ``logs``: the two runs' epoch logs (faulty, uninterrupted)."""
    (work / "faulty").mkdir(parents=True)
    (work / "clean").mkdir()
    (work / "plain").mkdir()
    faulty = K.supervised(faulty_nb, work / "faulty.ipynb", kernel, work / "faulty" / "runs", work / "faulty",
                          parameters=faulty_params, max_restarts=max_restarts, standby=standby)
    clean_params = clean_params(faulty.notebook) if callable(clean_params) else clean_params
    clean = K.supervised(clean_nb, work / "clean.ipynb", kernel, work / "clean" / "runs", work / "clean",
                         parameters=clean_params, standby=standby)
    floor = K.floor(kernel, K.checkpoint_files(work / "faulty" / "runs"))
    plain_params = plain_params(faulty.notebook) if callable(plain_params) else plain_params
    plain = K.papermill_run(plain_nb, work / "plain", kernel, parameters=plain_params)
    n = len(faulty.restarts)
    ooms = oom_recoveries(faulty.notebook)
    lost = (faulty.seconds - clean.seconds) / max(1, n + ooms)
    rerun_lost = floor.kernel_start + CRASH_AT * (plain - floor.kernel_start)
    return {
        "clean": clean.seconds, "faulty": faulty.seconds, "restarts": n, "ooms": ooms, "lost": lost,
        "recovery": [r.seconds for r in faulty.restarts], "reasons": [r.reason for r in faulty.restarts],
        "floor": floor, "plain": plain, "rerun_lost": rerun_lost,
        "stamped": stamped_losses(K.read_marks(logs[0])) if logs else None,
        "cycles": [usual_cycle(K.read_marks(p)) for p in logs] if logs else None,
        "identical": result_line(faulty.notebook) == result_line(clean.notebook) and result_line(clean.notebook) is not None,
    }


def demo(root: Path, kernel: str, epochs: int, standby: bool) -> dict:
    import nbformat

    from colab_resilience.demo import _result

    work = root / "demo"
    nb = nbformat.reads((resources.files("colab_resilience") / "notebooks" / "demo.ipynb").read_text(), as_version=4)

    def batch(faulty_nb) -> int:
        return _result(faulty_nb).get("batch_size", 8192)

    return measure(
        work, kernel, nb, copy.deepcopy(nb), K.plain_notebook(nb),
        faulty_params={"workdir": str(work / "faulty"), "epochs": epochs},
        clean_params=lambda f: {"workdir": str(work / "clean"), "epochs": epochs, "inject_faults": False,
                                "batch_size": batch(f)},
        plain_params=lambda f: {"workdir": str(work / "plain"), "epochs": epochs, "inject_faults": False,
                                "batch_size": batch(f)},
        standby=standby,
    )


def workload(root: Path, kernel: str, w: K.Workload, restarts: int, fault: str, standby: bool) -> dict:
    work = root / "workload"
    work.mkdir()
    every = math.ceil(w.epochs / (restarts + 1))
    kill_at = tuple(sorted({round(w.epochs * (i + 1) / (restarts + 1)) for i in range(restarts)}))
    faulty = K.workload_notebook(w, work / "faulty.log", fault=fault, every=every, kill_at=kill_at,
                                 workdir=work)
    clean = K.workload_notebook(w, work / "clean.log")
    plain = K.plain_notebook(K.workload_notebook(w, work / "plain.log"))
    return measure(work, kernel, faulty, clean, plain, max_restarts=restarts + 2, standby=standby,
                   logs=(work / "faulty.log", work / "clean.log"))


def lost_ratio(lost: float, floor: float) -> str:
    return "-" if lost <= 0 else K.ratio(lost, floor)


def mean_stamped(x: dict) -> float:
    return sum(x["stamped"]) / len(x["stamped"])


def stamped(x: dict, fmt) -> str:
    return fmt(mean_stamped(x)) if x.get("stamped") else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    K.add_workload_args(ap, steps=3, what="workload", fault="kill")
    ap.add_argument("--epochs", type=int, default=40, help="workload epochs (default 40)")
    ap.add_argument("--restarts", type=int, default=2, help="workload kernel restarts (default 2)")
    ap.add_argument("--demo-epochs", type=int, default=12,
                    help="the demo's epochs parameter (default 12; the notebook's own is 4; at least 3)")
    ap.add_argument("--only", choices=["demo", "workload"], help="run one of the two")
    ap.add_argument("--quick", action="store_true",
                    help="the workload only, --params 5e6 --epochs 6 --steps 2 --restarts 1 (under a minute)")
    ap.add_argument("--no-standby", action="store_true", help="supervised runs without the standby kernel")
    args = ap.parse_args()
    if args.quick:
        args.params, args.epochs, args.steps, args.restarts = 5_000_000, 6, 2, 1
        args.only = args.only or "workload"
    if args.restarts < 1 or args.epochs < args.restarts + 1:
        ap.error("need --restarts >= 1 and --epochs > --restarts")
    if args.demo_epochs < 3:
        ap.error("--demo-epochs must be at least 3 (the demo's SIGKILL is in epoch 2)")

    w = K.workload_from(args, epochs=args.epochs)
    cols: dict[str, dict] = {}
    with K.workspace(args.kernel, "cr-bench-recovery-") as (root, kernel):
        if args.only in (None, "demo"):
            print("recovery benchmark: the demo notebook ...", flush=True)
            cols["demo notebook"] = demo(root, kernel, args.demo_epochs, not args.no_standby)
        if args.only in (None, "workload"):
            print(f"recovery benchmark: the {w.nparams / 1e6:.1f}M-parameter workload ...", flush=True)
            cols[f"{w.nparams / 1e6:.0f}M workload"] = workload(root, kernel, w, args.restarts, args.fault, not args.no_standby)

    import torch

    print()
    what = []
    if args.only in (None, "demo"):
        what.append(f"demo notebook, {args.demo_epochs} epochs")
    if args.only in (None, "workload"):
        what.append(f"workload {w.nparams / 1e6:.1f}M parameters + AdamW, {args.epochs} epochs of {args.steps} "
                    f"steps, {args.restarts} restart(s) ({args.fault})")
    print(f"recovery benchmark: {'; '.join(what)}; standby kernel {'off' if args.no_standby else 'on'}; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print()
    c = list(cols.values())

    def row(label, f):
        return (label, *[f(x) for x in c])

    rows = [
        row("uninterrupted supervised run (s)", lambda x: K.secs(x["clean"])),
        row("faulty supervised run (s)", lambda x: K.secs(x["faulty"])),
        row("OOM recoveries in process (--shrink)", lambda x: str(x["ooms"])),
        row("kernel restarts", lambda x: str(x["restarts"])),
        row("  driver's recovery per restart (s)", lambda x: ", ".join(f"{s:.1f}" for s in x["recovery"])),
        row("same result as uninterrupted", lambda x: "yes" if x["identical"] else "NO"),
        row("checkpoint on disk (MiB)", lambda x: f"{x['floor'].nbytes / (1 << 20):.1f}"),
        (),
        row("usual epoch + checkpoint, uninterrupted / faulty (s)",
            lambda x: " / ".join(f"{v:.2f}" for v in x["cycles"]) if x.get("cycles") else "-"),
        row("time lost per fault (s)", lambda x: K.secs(x["lost"])),
        row("floor: fresh kernel + import torch + raw read (s)", lambda x: K.secs(x["floor"].total)),
        row("  time lost per fault, x floor", lambda x: lost_ratio(x["lost"], x["floor"].total)),
        (),
        row("papermill, uninterrupted, no colab_resilience (s)", lambda x: K.secs(x["plain"])),
        row(f"papermill re-run after a crash at {CRASH_AT:.0%} (s lost)", lambda x: K.secs(x["rerun_lost"])),
        row("  less time lost than re-running (x)", lambda x: "-" if x["lost"] <= 0 else K.ratio(x["rerun_lost"], x["lost"])),
        (),
        row("time lost per fault, stamped in the run (s)", lambda x: stamped(x, K.secs)),
        row("  x floor", lambda x: stamped(x, lambda v: K.ratio(v, x["floor"].total))),
        row("  less time lost than re-running (x)", lambda x: stamped(x, lambda v: K.ratio(x["rerun_lost"], v))),
    ]
    K.table(rows, ("", *cols))
    print("(stamped: the gap between the last epoch before a restart and the first after it, less the run's")
    print(" usual gap between epochs, plus what the first epoch in the new kernel took over the usual epoch;")
    print(" the workload logs its epochs, the demo does not; where the two runs' usual epochs differ, the")
    print(" difference of their wall times carries that difference times the number of epochs)")
    print()
    print("targets:")
    for name, x in cols.items():
        if x["lost"] <= 0:  # the faulty run was the faster one: the difference is all noise
            print(f"  [?] {name}: the faulty run took {-x['lost'] * max(1, x['restarts'] + x['ooms']):.2f} s less than "
                  "the uninterrupted one: wall times too noisy to measure the loss (see stamped)")
        else:
            K.target(f"{name}: time lost per fault <= 1.5x floor", x["lost"] <= 1.5 * x["floor"].total,
                     f"{x['lost'] / x['floor'].total:.2f}x")
            K.target(f"{name}: >= 5x less time lost than a papermill re-run at {CRASH_AT:.0%}",
                     x["rerun_lost"] >= 5 * x["lost"], f"{x['rerun_lost'] / x['lost']:.2f}x")
        if x.get("stamped"):
            v = mean_stamped(x)
            K.target(f"{name}, stamped: time lost per fault <= 1.5x floor", v <= 1.5 * x["floor"].total,
                     f"{v / x['floor'].total:.2f}x")
            K.target(f"{name}, stamped: >= 5x less time lost than a papermill re-run at {CRASH_AT:.0%}",
                     x["rerun_lost"] >= 5 * v, f"{x['rerun_lost'] / v:.2f}x")
    print()
    for name, x in cols.items():
        for i, reason in enumerate(x["reasons"], 1):
            print(f"{name}: restart {i}: {reason}")


if __name__ == "__main__":
    main()
