"""What fingerprinting the set-up cells' values costs: every byte, against a strided sample and
the floor of reading every byte once, in one run.

    python benchmarks/fingerprint.py [--sizes 64 572] [--repeat 5] [--params 50e6]

A run that begins fingerprints what the set-up cells made and the training reads, and its
``--save`` values (:mod:`colab_resilience.setup_state`); each ``%%replay`` cell fingerprints what
the set-up cells bind, in two walks (with and without the models); a resumed run compares. Each
takes every byte of a tensor or array (BLAKE3 on all cores). Rows, for a float32 tensor of each
size:

- ``setup_state.fingerprint``: the package's, of a contiguous tensor, of a transposed view of it
  (copied a bounded slice at a time), and of the same values as a NumPy array;
- strided sample (the alternative, the package's before 2026-11-28): 16,384 elements a stride
  apart, BLAKE3; it misses a change to any other element;
- xxh3-128, one thread (the alternative hash: non-cryptographic, the checkpoints' fingerprint);
- floor: reading every byte once (``torch.sum``: on all cores).

Then the 50M workload (an MLP of 50M parameters + AdamW after one step: 577 MiB of state) as a run
begins: its model and optimizer with the ``--save`` values; and the two walks of a ``%%replay``
cell (with a 256 MiB train set too) with and without
:func:`~colab_resilience.setup_state.one_moment` (which hashes a tensor both walks see once).

Then, where Hugging Face ``datasets`` is installed, a tokenized data set of ``--rows`` rows of
512 int32 tokens (``datasets.Dataset``): the package's fingerprint of it as built and shuffled
(its Arrow table and the shuffle's index, in IPC form a slice at a time), against the floor of
reading every token once (``pyarrow.compute.sum``) and, for the shuffled one, that of gathering
its rows in their order once (``take``, what ``flatten_indices`` does: the alternative of hashing
the rows as the training reads them).
Times are the median of ``--repeat`` runs; "x floor" is against the floor of the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import blake3
import numpy as np
import torch
import xxhash

from colab_resilience import setup_state

MiB = 1 << 20


def timed(fn, repeat: int) -> float:
    fn()  # warm: pages touched, threads started
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sample(t: torch.Tensor) -> bytes:
    flat = t.reshape(-1)
    part = flat[:: max(1, flat.numel() // 16384)][:16384].contiguous()
    return blake3.blake3(part.numpy().tobytes()).digest()


def model_50m(params: float):
    """The 50M workload of background_save.py: an MLP and AdamW after one step."""
    torch.manual_seed(0)
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    opt.step()
    return model, opt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[64, 572], help="tensor sizes, MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--rows", type=int, default=200_000, help="rows of the Hugging Face data set")
    a = p.parse_args()
    print(f"torch {torch.__version__} on {torch.get_num_threads()} threads; median of {a.repeat}\n")
    tensors(a.sizes, a.repeat)
    workload(a.params, a.repeat)
    hugging_face(a.rows, a.repeat)


def tensors(sizes: list[float], repeat: int) -> None:
    """The table of a float32 tensor of each size (each freed before the next is made)."""
    print("| what | MiB | time (s) | GB/s | x floor |")
    print("|---|---|---|---|---|")
    for mib in sizes:
        one_size(mib, repeat)


def one_size(mib: float, repeat: int) -> None:
    """The rows of one size."""
    n = int(mib * MiB) // 4
    t = torch.randn(n)
    view = t.reshape(-1, 1024).t()
    arr = t.numpy()
    floor = timed(lambda: t.sum(), repeat)
    rows = [
        ("`setup_state.fingerprint`, contiguous", lambda: setup_state.fingerprint({"X": t}, ["X"])),
        ("`setup_state.fingerprint`, a transposed view", lambda: setup_state.fingerprint({"X": view}, ["X"])),
        ("`setup_state.fingerprint`, a NumPy array", lambda: setup_state.fingerprint({"X": arr}, ["X"])),
        ("strided sample (misses most changes)", lambda: sample(t)),
        ("xxh3-128, one thread", lambda: xxhash.xxh3_128_digest(memoryview(arr).cast("B"))),
    ]
    for label, fn in rows:
        s = timed(fn, repeat)
        print(f"| {label} | {mib:.0f} | {s:.4f} | {n * 4 / s / 1e9:.1f} | {s / floor:.2f} |")
    print(f"| floor: reading every byte once (`torch.sum`) | {mib:.0f} | {floor:.4f} | "
          f"{n * 4 / floor / 1e9:.1f} | 1.00 |")


def workload(params: float, repeat: int) -> None:
    """The table of the 50M workload as a run begins and in a %%replay cell's two walks."""
    model, opt = model_50m(params)
    ns = {"model": model, "opt": opt, "X": torch.randn(64 * MiB)}  # and a 256 MiB train set
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    floor = timed(lambda: [s.sum() for p in model.parameters() for s in (p, *opt.state[p].values()) if s.dim()],
                  repeat)

    def walks(moment: bool):
        def both():
            setup_state.fingerprint(ns, ["model", "opt", "X"])  # the train set
            setup_state.fingerprint(ns, ["model", "opt", "X"], saved=True)  # it, the model and optimizer
        if moment:
            with setup_state.one_moment():
                both()
        else:
            both()

    floor_x = floor + timed(lambda: ns["X"].sum(), repeat)
    print(f"\n{params / 1e6:.0f}M parameters + AdamW ({nbytes / MiB:.0f} MiB of state), and a 256 MiB train set:\n")
    print("| what | MiB | time (s) | x floor |")
    print("|---|---|---|---|")
    for label, mib, fn, against in [
            ("the run's start: model and optimizer (`saved=True`)", nbytes / MiB,
             lambda: setup_state.fingerprint(ns, ["model", "opt"], saved=True), floor),
            ("a `%%replay` cell's two walks, in one moment", nbytes / MiB + 256, lambda: walks(True), floor_x),
            ("the same two walks, each hashing on its own", nbytes / MiB + 256, lambda: walks(False), floor_x)]:
        s = timed(fn, repeat)
        print(f"| {label} | {mib:.0f} | {s:.4f} | {s / against:.2f} |")
    print(f"| floor: reading every byte once (`torch.sum`), the state | {nbytes / MiB:.0f} | {floor:.4f} | 1.00 |")
    print(f"| floor: the same, the state and the train set | {nbytes / MiB + 256:.0f} | {floor_x:.4f} | 1.00 |")


def hugging_face(rows: int, repeat: int) -> None:
    """The table of a ``datasets.Dataset`` (none where datasets is not installed)."""
    try:
        import datasets
        import pyarrow.compute as pc
    except ImportError:
        print("\n(Hugging Face datasets is not installed: no data set table)")
        return
    tokens = np.random.default_rng(0).integers(0, 50_000, (rows, 512), dtype=np.int32)
    data = datasets.Dataset.from_dict({"input_ids": list(tokens), "labels": np.arange(rows)})
    shuffled = data.shuffle(seed=0)
    mib = data.data.nbytes / MiB
    column = data.data.table.column("input_ids")
    floor = timed(lambda: [pc.sum(chunk.flatten()) for chunk in column.chunks], repeat)
    order = shuffled._indices.column(0)  # the shuffle's index: what a take of every row gathers by
    gather = timed(lambda: data.data.table.take(order), repeat)
    print(f"\nA tokenized data set: {rows:,} rows of 512 int32 tokens ({mib:.0f} MiB, datasets "
          f"{datasets.__version__}):\n")
    print("| what | MiB | time (s) | x floor |")
    print("|---|---|---|---|")
    for label, fn, against in [
            ("`setup_state.fingerprint`, as built", lambda: setup_state.fingerprint({"d": data}, ["d"]), floor),
            ("`setup_state.fingerprint`, shuffled (through its index)",
             lambda: setup_state.fingerprint({"d": shuffled}, ["d"]), gather)]:
        s = timed(fn, repeat)
        print(f"| {label} | {mib:.0f} | {s:.4f} | {s / against:.2f} |")
    print(f"| floor: reading every token once (`pyarrow.compute.sum`) | {mib:.0f} | {floor:.4f} | 1.00 |")
    print(f"| floor, shuffled: gathering every row once (`take`) | {mib:.0f} | {gather:.4f} | 1.00 |")


if __name__ == "__main__":
    main()
