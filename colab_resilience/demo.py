"""``colab-resilience demo``: the bundled notebook, once through real faults and once without.

The faulty run trains under a memory cap (a real out-of-memory error, recovered in process by
``--shrink``: the batch is halved until it fits) and is killed with SIGKILL in the middle of an
epoch (the supervisor brings a kernel back and the run resumes). The clean run trains the same
model with the batch size the faulty run ended with. The summary says what the faults cost and
whether the final weights are identical.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .driver import EXIT_OK, keep_folder, run_notebook
from .tempdirs import TempFolder


def _result(nb) -> dict:
    for cell in reversed(nb.cells):
        for out in cell.get("outputs", []):
            for line in out.get("text", "").splitlines():
                if line.startswith("RESULT "):
                    return json.loads(line[len("RESULT "):])
    return {}


def oom_recoveries(nb) -> int:
    """How many in-process OOM recoveries (``--shrink`` retries) the executed notebook reports."""
    return sum(
        1
        for cell in nb.cells
        for out in cell.get("outputs", [])
        for line in out.get("text", "").splitlines()
        if line.startswith("colab_resilience: OOM (") and "; retry " in line
    )


def main(keep: str | None = None) -> int:
    own = None if keep else TempFolder("demo")
    workdir = keep_folder(keep, "demo") if keep else Path(own.path)
    source = resources.files("colab_resilience") / "notebooks" / "demo.ipynb"
    notebook = workdir / "demo.ipynb"
    notebook.write_bytes(source.read_bytes())
    try:
        print("colab-resilience demo: 1/2 training through a real OOM and a SIGKILL, supervised ...", flush=True)
        faulty_dir = workdir / "faulty"
        faulty_dir.mkdir(exist_ok=True)
        faulty = run_notebook(notebook, workdir / "faulty.ipynb", parameters={"workdir": str(faulty_dir)},
                              log_output=True)
        if faulty.status != EXIT_OK:
            print(faulty.message)
            return faulty.status
        got = _result(faulty.notebook)
        print(f"colab-resilience demo: 2/2 the same training without faults (batch_size {got.get('batch_size')}) ...", flush=True)
        clean_dir = workdir / "clean"
        clean_dir.mkdir(exist_ok=True)
        clean = run_notebook(notebook, workdir / "clean.ipynb", parameters={
            "workdir": str(clean_dir), "inject_faults": False, "batch_size": got.get("batch_size", 8192)})
        if clean.status != EXIT_OK:
            print(clean.message)
            return clean.status
        ref = _result(clean.notebook)
        restarts = faulty.restarts
        ooms = oom_recoveries(faulty.notebook)
        lost = faulty.seconds - clean.seconds
        rows = [
            ("", "faulty run", "uninterrupted"),
            ("OOM recoveries in process (--shrink)", str(ooms), "0"),
            ("kernel restarts", str(len(restarts)), "0"),
            ("recovery per restart (restart + replay)", ", ".join(f"{r.seconds:.1f} s" for r in restarts) or "-", "-"),
            ("wall time", f"{faulty.seconds:.1f} s", f"{clean.seconds:.1f} s"),
            ("time lost per fault (all included)", f"{lost / max(1, len(restarts) + ooms):.1f} s", "-"),
            ("final batch_size", str(got.get("batch_size")), str(ref.get("batch_size"))),
            ("final eval loss", str(got.get("eval_loss")), str(ref.get("eval_loss"))),
            ("weights (sha256)", str(got.get("weights")), str(ref.get("weights"))),
        ]
        width = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        print()
        for name, a, b in rows:
            print(f"  {name:<{width}}  {a:<{w1}}  {b}")
        for i, r in enumerate(restarts, 1):
            print(f"  restart {i}: {r.reason} (recovered in {r.seconds:.1f} s)")
        identical = got and got.get("weights") == ref.get("weights") and got.get("eval_loss") == ref.get("eval_loss")
        print()
        print("  identical to the uninterrupted run: " + ("yes (bit for bit)" if identical else "NO"))
        print(f"  notebooks: {workdir}" if keep else "")
        return EXIT_OK if identical else 1
    finally:
        if own is not None:
            own.remove()
