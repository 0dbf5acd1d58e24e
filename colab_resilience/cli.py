"""``colab-resilience``: the command line.

``colab-resilience run NOTEBOOK [-o OUT]`` executes a notebook headless (nbclient, a kernel
started by jupyter_client over IPC) with the extension loaded into the kernel, echoes what each
cell prints, and writes the executed notebook. Exit codes: 0 done, 1 a cell failed, 2 usage or
input error.

This first version recovers in process (``%%resilient``); restarting a dead kernel and resuming
is the supervised driver's job, which comes next.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

EXIT_OK, EXIT_CELL_FAILED, EXIT_USAGE = 0, 1, 2

# Run in the kernel at start-up. Unlike --ext, a later `%load_ext colab_resilience` in the
# notebook (written for Colab, where it is needed) then stays silent.
_LOAD = "import colab_resilience as _cr; _cr.load_ipython_extension(get_ipython()); del _cr"


def _fail(message: str) -> int:
    print(f"colab-resilience: {message}", file=sys.stderr)
    return EXIT_USAGE


def _echo_cell(cell, cell_index, **_):
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            text = out.get("text", "")
            stream = sys.stdout if out.get("name") == "stdout" else sys.stderr
            for line in text.splitlines():
                print(f"[cell {cell_index}] {line}", file=stream)


def run(args) -> int:
    import nbformat
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    path = Path(args.notebook)
    if not path.is_file():
        return _fail(f"{path}: no such notebook; give the path of an .ipynb file")
    try:
        nb = nbformat.read(path, as_version=4)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _fail(f"{path}: not a notebook (invalid JSON: {e}); give the path of an .ipynb file")
    except Exception as e:  # nbformat's own validation and reader errors
        return _fail(f"{path}: not a readable notebook ({type(e).__name__}: {e})")
    out = Path(args.output) if args.output else path.with_name(path.stem + ".out.ipynb")
    kernel_name = args.kernel or nb.metadata.get("kernelspec", {}).get("name") or "python3"
    # IPC sockets in a private (0700) folder: the kernel is not reachable by other local users,
    # and an absolute path keeps working although the kernel runs in the notebook's folder.
    sockets = tempfile.mkdtemp(prefix="colab-resilience-")
    km = KernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(sockets, "kernel"))
    client = NotebookClient(
        nb,
        km=km,
        kernel_name=kernel_name,
        timeout=args.cell_timeout,
        resources={"metadata": {"path": str(path.parent.resolve())}},
        on_cell_executed=_echo_cell,
        # the extension is loaded into the kernel without the notebook asking for it
        extra_arguments=[f"--IPKernelApp.exec_lines={_LOAD}"],
    )
    status = EXIT_OK
    try:
        client.execute()
    except NoSuchKernel:
        return _fail(f"no kernel named {kernel_name!r}; list them with `jupyter kernelspec list` or pass --kernel NAME")
    except CellExecutionError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"colab-resilience: a cell failed: {first}", file=sys.stderr)
        status = EXIT_CELL_FAILED
    except DeadKernelError:
        print(
            "colab-resilience: the kernel died (killed, or restarting itself after an OOM); this "
            "version does not restart it yet: run the notebook again to resume from its last checkpoint",
            file=sys.stderr,
        )
        status = EXIT_CELL_FAILED
    finally:
        nbformat.write(nb, out)
        shutil.rmtree(sockets, ignore_errors=True)
    print(f"colab-resilience: wrote {out}" + ("" if status == EXIT_OK else " (with the failing cell's traceback)"))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colab-resilience", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("run", help="execute a notebook headless with the extension loaded")
    p.add_argument("notebook", help="the .ipynb file to execute")
    p.add_argument("-o", "--output", help="where to write the executed notebook (default: NAME.out.ipynb)")
    p.add_argument("--kernel", help="kernel name (default: the notebook's kernelspec, else python3)")
    p.add_argument("--cell-timeout", type=int, default=None, metavar="S", help="seconds a cell may run (default: no limit)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else EXIT_OK
    if args.command == "run":
        return run(args)
    parser.print_help()
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
