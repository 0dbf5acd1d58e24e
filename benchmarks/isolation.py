"""What isolation costs per cell: a notebook kernel with ``%resilience isolate`` against a plain
kernel (the floor: the same cell in the kernel the frontend talks to), in one run.

    python benchmarks/isolation.py [--repeat 30] [--kernel python3]

Both kernels are started by jupyter_client over IPC sockets, as a frontend starts them, and are
driven the same way: an ``execute_request``, then every iopub message until the kernel is idle and
the ``execute_reply`` is in. The time of a cell is from the request to the last of those. The
cells, each run ``--repeat`` times, alternating between the two kernels:

- empty: ``pass`` (the relay's fixed cost: the transform, the magic, one round trip to the worker);
- small: a line of arithmetic with a result (an ``execute_result`` crosses);
- streaming: 20,000 lines printed in a tight loop (stdout crosses, batched as ipykernel batches it);
- streaming, paced: 200 lines flushed one by one 5 ms apart (about 1 s of a training loop's log);
- displays: 200 ``display()`` calls (200 ``display_data`` messages cross one by one).

The table gives medians, the time isolation adds per cell, and the ratio to the plain kernel.
Targets (issue 19): at most 5 ms added per cell, at most 2 % on a streaming-output cell.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _kernels import table, target, workspace  # noqa: E402

CELLS = {
    "empty": "pass",
    "small (a result)": "sum(range(1000))",
    "streaming, 20,000 lines": "for i in range(20000):\n    print(i)",
    "streaming, paced (~1 s)": "import time\nfor i in range(200):\n    print('step', i, flush=True)\n    time.sleep(0.005)",
    "displays, 200": "from IPython.display import display\nfor i in range(200):\n    display(i)",
}


class Frontend:
    def __init__(self, kernel: str, isolate: bool):
        from jupyter_client import KernelManager

        self.sockets = tempfile.mkdtemp(prefix="cr-bench-iso-")
        self.km = KernelManager(kernel_name=kernel, transport="ipc", ip=os.path.join(self.sockets, "k"))
        self.km.start_kernel()
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        if isolate:
            self.cell("%load_ext colab_resilience")
            self.cell("%resilience isolate")

    def cell(self, code: str) -> tuple[float, int]:
        """Seconds from the request to the reply and the idle status; how many outputs came."""
        kc = self.kc
        t0 = time.perf_counter()
        msg_id = kc.execute(code)
        reply = idle = False
        outputs = 0
        while not (reply and idle):
            if not idle:
                msg = kc.get_iopub_msg(timeout=120)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
                elif msg["msg_type"] in ("stream", "display_data", "execute_result", "error"):
                    outputs += 1
            else:
                msg = kc.get_shell_msg(timeout=120)
                reply = msg["parent_header"].get("msg_id") == msg_id
                if reply:
                    assert msg["content"]["status"] == "ok", msg["content"]
        if not reply:
            while kc.get_shell_msg(timeout=120)["parent_header"].get("msg_id") != msg_id:
                pass
        return time.perf_counter() - t0, outputs

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
        shutil.rmtree(self.sockets, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--kernel", default="python3")
    args = ap.parse_args()
    with workspace(args.kernel, "cr-bench-isolation-") as (root, kernel):
        os.chdir(root)
        plain, relay = Frontend(kernel, False), Frontend(kernel, True)
        try:
            rows, added = [], {}
            for name, code in CELLS.items():
                for f in (plain, relay):  # warm-up: imports, first prints
                    f.cell(code)
                times = {id(plain): [], id(relay): []}
                counts = {}
                for _ in range(args.repeat):
                    for f in (plain, relay):
                        seconds, outputs = f.cell(code)
                        times[id(f)].append(seconds)
                        counts[id(f)] = outputs
                p, r = statistics.median(times[id(plain)]), statistics.median(times[id(relay)])
                added[name] = (r - p, r / p)
                rows.append((name, f"{p * 1000:.2f} ms", f"{r * 1000:.2f} ms", f"{(r - p) * 1000:+.2f} ms",
                             f"{r / p:.3f}x", f"{counts[id(plain)]} / {counts[id(relay)]}"))
            print(f"median of {args.repeat} cells each; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
            table(rows, ("cell", "plain kernel (floor)", "isolated", "added", "ratio", "output messages plain / isolated"))
            fixed = max(added["empty"][0], added["small (a result)"][0])
            target("added per cell <= 5 ms (the empty and the small cell)", fixed <= 0.005, f"{fixed * 1000:.2f} ms")
            for name in (n for n in added if n.startswith("streaming")):
                ratio = added[name][1]
                target(f"streaming-output cell <= 2 % ({name})", ratio <= 1.02, f"{100 * (ratio - 1):+.1f} %")
        finally:
            plain.close()
            relay.close()


if __name__ == "__main__":
    main()
