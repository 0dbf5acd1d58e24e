"""Settings of the background persist, against training without checkpoints, rows alternating.

    python benchmarks/persist_settings.py [--params 200e6] [--device cuda] [--epoch-seconds 2.5]
                                          [--epochs 4] [--passes 2] [--dir DIR]

``background_save.py`` measures its rows one after the other, and an epoch's time drifts over a
run (on a GPU, two rows without checkpoints 10% apart were seen): a row's overhead is then partly
its place in the run. Here every setting runs once per pass, passes repeat the same order, and a
row without checkpoints opens each pass, so that each setting's overhead is the mean over passes
against the mean of those rows, and the spread of the passes is printed beside it.

The settings: the default (4 MiB direct writes, 4 hashing threads); 16 MiB writes (fewer system
calls and thread hand-offs per byte); 2 hashing threads (fewer threads beside the one that trains
or launches the GPU's kernels); both. The workload, the stall and the persist's seconds are
``background_save.py``'s.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import background_save as bench  # noqa: E402
import torch  # noqa: E402

from colab_resilience.checkpoints import blobs, hashing  # noqa: E402
from colab_resilience.checkpoints.staging import Budget  # noqa: E402

MiB = 1 << 20


def setting(bounce: int, workers: int):
    def apply() -> None:
        blobs.BOUNCE = bounce
        blobs._bounces.clear()
        hashing._WORKERS = workers
        hashing._pool_of = None  # the next save makes a pool of that many threads
    return apply


SETTINGS = [
    ("no checkpoint", None),
    ("default: 4 MiB writes, 4 hashing threads", setting(4 * MiB, 4)),
    ("16 MiB writes", setting(16 * MiB, 4)),
    ("2 hashing threads", setting(4 * MiB, 2)),
    ("16 MiB writes, 2 hashing threads", setting(16 * MiB, 2)),
]


def main() -> None:
    a, model, opt, steps = bench.alternating_workload(__doc__, params=200e6, epoch_seconds=2.5, epochs=4, passes=2)
    root = Path(tempfile.mkdtemp(prefix="cr-settings-", dir=a.dir))
    where = f"{torch.cuda.get_device_name(bench.DEVICE)}" if bench.DEVICE.type == "cuda" else "cpu"
    print(f"{a.params / 1e6:.0f}M parameters ({bench.state_bytes(model, opt) / MiB:.0f} MiB of state) on {where}, "
          f"epochs of {steps} steps of {a.batch}; writing to {root} ({bench.file_system(root)})", flush=True)
    rows: dict[str, list[dict]] = {label: [] for label, _ in SETTINGS}
    try:
        for n in range(a.passes):
            for label, apply in SETTINGS:
                save = None
                if apply is not None:
                    apply()
                    save = bench.OurSaver(root / "bg", Budget())
                r = bench.run_row(model, opt, save, a.epochs, steps, a.batch)
                shutil.rmtree(root / "bg", ignore_errors=True)
                rows[label].append(r)
                print(f"  pass {n + 1}, {label}: epoch {r['epoch']:.3f} s, stall {r['stall']:.3f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        setting(4 * MiB, 4)()
    summary = bench.against_no_checkpoint(rows)
    print("| setting | stall (s) | epoch (s) | overhead | overhead in each pass | persist (s) |")
    print("|---|---|---|---|---|---|")
    for label, (epoch, overhead, each) in summary.items():
        rs = rows[label]
        print(f"| {label} | {statistics.mean(r['stall'] for r in rs):.3f} | {epoch:.3f} | {overhead} | {each} | "
              f"{statistics.mean(r['persist'] for r in rs):.3f} |")

if __name__ == "__main__":
    main()
