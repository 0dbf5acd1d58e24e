"""``colab-resilience``: the command line; it parses arguments and calls one library function.

``colab-resilience run NOTEBOOK`` executes a notebook headless under supervision
(:func:`colab_resilience.driver.run_notebook`): a kernel that dies is restarted, the replay cells
are replayed and the interrupted cell resumes. ``colab-resilience check NOTEBOOK`` runs it with
injected faults and compares (:func:`colab_resilience.check.check_notebook`).
``colab-resilience demo`` runs the bundled demo. ``colab-resilience reset | show | resume [--trust]
[RUN]`` do to a run folder what ``%resilience reset | show | resume`` do in a notebook
(:mod:`colab_resilience.headless_runs`).

Exit codes: 0 done, 1 a cell failed, 2 usage or input error, 3 restart budget spent, 130 interrupted (Ctrl-C),
143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# nbformat (which nbclient imports) imports jsonschema, whose format checkers import rfc3987-syntax
# where it is installed (jupyter-events, which Jupyter Server needs, pulls it in): that builds some
# 35 Lark parsers as it is imported, 1 to 2.5 s of every command's start
# (python-jsonschema/jsonschema#1428). A notebook's schema checks no IRI: this process does without
# that one checker.
sys.modules.setdefault("rfc3987_syntax", None)

from . import options  # noqa: E402
from .driver import EXIT_OK, EXIT_USAGE, resolve_parameter, run_notebook  # noqa: E402
from .errors import NotebookInputError  # noqa: E402
from .words import did_you_mean, headless  # noqa: E402


def _fail(message: str) -> int:
    print(f"colab-resilience: {message}", file=sys.stderr)
    return EXIT_USAGE


def _parameters(args) -> dict | str:
    """The -p values, typed as papermill types them; a one-line refusal for a bad name."""
    parameters = {name: resolve_parameter(value) for name, value in args.parameters}
    for name in parameters:
        if not name.isidentifier():
            return f"-p {name}: not a Python variable name; write -p NAME VALUE, e.g. -p lr 0.01"
    return parameters


def _say_unknown_parameters(command: str, notebook, parameters: dict) -> None:
    """One line, as papermill warns, where -p names a value the notebook's parameters cell does
    not set (the run goes on: papermill's rule sets it anyway)."""
    from .driver import read_notebook, unknown_parameters

    said = unknown_parameters(read_notebook(notebook)[0], parameters) if parameters else None
    if said:
        print(f"colab-resilience {command}: {said}", file=sys.stderr, flush=True)


def run(args) -> int:
    path = Path(args.notebook)
    # parent / name, not with_name: `.` or `/` has no name to change, and is refused as a folder
    out = Path(args.output) if args.output else path.parent / (path.stem + ".out.ipynb")
    parameters = _parameters(args)
    if isinstance(parameters, str):
        return _fail(parameters)
    cell: list[int] = []
    started = time.time()
    try:
        _say_unknown_parameters("run", path, parameters)
        result = run_notebook(
            path, out, parameters=parameters, max_restarts=args.max_restarts,
            cell_timeout=args.cell_timeout, kernel_name=args.kernel, run_dir=args.run_dir,
            progress=not args.no_progress, log_output=args.log_output, say=True, standby=not args.no_standby,
            on_cell_start=lambda index, _: cell.append(index), run_dir_named="--run-dir",
        )
    except NotebookInputError as e:
        return _fail(str(e))
    except KeyboardInterrupt as e:
        return interrupted(args, out, cell[-1] if cell else None, started, e)
    if result.message:
        print(headless(result.message, args.run_dir) + (_going_on(args) if result.timed_out and result.pending else ""), file=sys.stderr)
    state = "done" if result.status == EXIT_OK else "stopped"
    print(
        f"colab-resilience: {state} in {result.seconds:.1f} s with {len(result.restarts)} kernel "
        f"restart{'s' if len(result.restarts) != 1 else ''}; "
        + (f"wrote {result.written}" if result.written is not None else "wrote no notebook")
    )
    return result.status


def interrupted(args, out: Path, cell: int | None, started: float, how: KeyboardInterrupt) -> int:
    """Ctrl-C or SIGTERM during ``run``: one line (where, what was written, how to go on), exit
    status 130 or 143."""
    quiet_the_interrupted_cell()
    where = f" in cell {cell}" if cell is not None else ""
    wrote = f"wrote {out}" if out.is_file() and out.stat().st_mtime >= started else "wrote no notebook"
    print(f"colab-resilience: {_stopped(how)}{where}; {wrote}{_going_on(args)}", file=sys.stderr)
    return _status(how)


def _going_on(args) -> str:
    """For a run the command stopped (Ctrl-C, a cell's timeout): "; " and how the same command goes
    on from its checkpoints, or what they went with; "" where no run is pending."""
    from .journal import pending_runs

    if args.run_dir is None:
        return ("; its runs' checkpoints went with it: with --run-dir DIR they stay, and the same command "
                "goes on from them")
    if pending_runs(args.run_dir):
        return f"; the same command (--run-dir {args.run_dir}) goes on from the last checkpoint of its run"
    return ""


INTERRUPTED = 128 + 2  # the exit status of a command ended by Ctrl-C (SIGINT), as a shell reports it


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a job's time limit, ``timeout``): the command stops as Ctrl-C stops it
    (the executed notebook written, the kernels shut down, its temporary folders removed), not
    at once with nothing written."""


def _on_sigterm(signum, frame) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends it at once
    raise Terminated()


def _stopped(how: KeyboardInterrupt) -> str:
    return "stopped by SIGTERM" if isinstance(how, Terminated) else "interrupted"


def _status(how: KeyboardInterrupt) -> int:
    return 128 + 15 if isinstance(how, Terminated) else INTERRUPTED


def quiet_the_interrupted_cell() -> None:
    """nbclient's task for the cell that was running ends with its kernel, after the interrupt, and
    nobody waits for it: asyncio would print "Task exception was never retrieved" and a traceback."""
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def check(args) -> int:
    from .check import check_notebook

    parameters = _parameters(args)
    if isinstance(parameters, str):
        return _fail(parameters)
    try:
        _say_unknown_parameters("check", args.notebook, parameters)
        report = check_notebook(args.notebook, parameters=parameters, faults=args.faults, seed=args.seed,
                                kernel_name=args.kernel, cell_timeout=args.cell_timeout, keep=args.keep,
                                standby=not args.no_standby)
    except NotebookInputError as e:
        return _fail(str(e))
    if report.broken:
        print(f"colab-resilience check: {args.notebook}: cannot check: {report.broken}", file=sys.stderr)
    else:
        print(f"colab-resilience check: {args.notebook}: {report.summary(args.seed)}")
    return report.status


def demo(args) -> int:
    from .demo import main as demo_main

    try:
        return demo_main(keep=args.keep)
    except NotebookInputError as e:
        return _fail(str(e))


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line that says what was wrong and where to look (not the whole usage)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message}; see `{self.prog} --help`\n")


DESCRIPTION = (
    "Run Jupyter notebooks that survive out-of-memory errors and kernel deaths: a kernel that dies "
    "is restarted, the set-up cells are replayed and the interrupted cell resumes from its last checkpoint."
)
EXIT_CODES = ("exit codes: 0 done, 1 a cell failed, 2 usage or input error, 3 restart budget spent, "
              "130 interrupted (Ctrl-C), 143 stopped by SIGTERM")


def _hint(extra: list[str], where: argparse.ArgumentParser, commands: dict[str, argparse.ArgumentParser]) -> str:
    """For an unknown option: the command it belongs to (``run --faults``), or the option meant."""
    options = [a for a in extra if a.startswith("-") and len(a) > 1]
    if not options:
        return ""
    name = options[0].partition("=")[0]
    for command, other in commands.items():
        if other is not where and name in other._option_string_actions:
            return f" ({name} is an option of `colab-resilience {command}`)"
    longs = [s for s in where._option_string_actions if s.startswith("--")]
    return did_you_mean(name, longs, quoted=False) if name.startswith("--") else ""


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="colab-resilience", description=DESCRIPTION, epilog=EXIT_CODES)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("run", help="execute a notebook headless; restart a dead kernel and resume",
                       description="Execute NOTEBOOK headless with nbclient; restart a dead kernel, replay "
                       "the set-up cells and resume the interrupted cell.", epilog=EXIT_CODES)
    p.add_argument("notebook", help="the .ipynb file to execute")
    p.add_argument("-o", "--output", help="the executed notebook (default: NAME.out.ipynb beside it)")
    p.add_argument("-p", "--parameter", dest="parameters", nargs=2, action="append", default=[],
                   metavar=("NAME", "VALUE"), help="set a parameter (papermill's `parameters` tag convention)")
    p.add_argument("--max-restarts", type=options.whole_number(), default=3, metavar="N",
                   help="kernel restarts for the whole notebook (default 3)")
    p.add_argument("--cell-timeout", type=options.whole_number(), default=None, metavar="S", help="seconds a cell may run (default, or 0: no limit)")
    p.add_argument("--kernel", help="kernel name (default: the notebook's kernelspec, else python3)")
    p.add_argument("--run-dir", help="where runs keep journals and checkpoints (default: a temporary folder)")
    p.add_argument("--log-output", action="store_true", help="echo what the cells print as they print it ([cell N] line), and each recovery as it happens")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-standby", action="store_true",
                   help="no standby kernel kept warm to take over from a dead one (saves its memory; "
                   "restarts then start a kernel and redo the imports)")
    c = sub.add_parser("check", help="run a notebook uninterrupted and with injected faults, and compare",
                       description="Run NOTEBOOK once uninterrupted and once per fault (SIGKILLs between and at "
                       "safe points and during checkpoint writes, out-of-memory errors in %%resilient cells), "
                       "and compare every variable bit for bit and every cell's printed output.",
                       epilog="exit codes: 0 identical, 1 a faulted run differs (what differs is named), "
                       "2 usage or input error, 3 the notebook fails (or has no safe point) without faults, "
                       "130 interrupted (Ctrl-C), 143 stopped by SIGTERM")
    c.add_argument("notebook", help="the .ipynb file to check")
    c.add_argument("-p", "--parameter", dest="parameters", nargs=2, action="append", default=[],
                   metavar=("NAME", "VALUE"), help="set a parameter, e.g. -p epochs 2 for a short check; the value "
                   "{run} is a folder of the check's, the same in every run and empty as each begins (where the "
                   "notebook writes a marker or a log: -p workdir {run})")
    c.add_argument("--faults", type=options.whole_number(
                       like="--faults 3", if_zero="a check with no fault compares nothing"), default=3, metavar="N",
                   help="faulted runs, one fault each (default 3)")
    c.add_argument("--seed", type=int, default=0, metavar="S", help="which faults, and when (default 0)")
    c.add_argument("--cell-timeout", type=options.whole_number(), default=None, metavar="S", help="seconds a cell may run (default, or 0: no limit)")
    c.add_argument("--kernel", help="kernel name (default: the notebook's kernelspec, else python3)")
    c.add_argument("--keep", metavar="DIR", help="keep the executed notebooks, runs and timeline in DIR")
    c.add_argument("--no-standby", action="store_true", help="cold restarts only (no standby kernel)")
    d = sub.add_parser("demo", help="train a small model through a real OOM and a real kernel kill, and compare",
                       description="Train a small model on synthetic data twice, in a temporary folder (or --keep DIR): supervised, "
                       "through a real out-of-memory error (a memory cap on its kernel; the batch is halved and "
                       "retried) and a real SIGKILL mid-epoch (the standby kernel takes over), then uninterrupted; "
                       "print both runs side by side and whether they are identical bit for bit (20 to 40 s on 2 "
                       "cores).",
                       epilog="exit codes: 0 identical, 1 the runs differ or a cell failed, 3 restart budget spent")
    d.add_argument("--keep", metavar="DIR", help="keep the demo's notebooks in DIR")
    r = sub.add_parser("reset", help="forget a run (journal and checkpoints), as %%resilience reset does",
                       description="Forget RUN (its journal and checkpoints), as `%resilience reset RUN` does in a "
                       "notebook: the pending run a refusal named, so that the next `colab-resilience run` (or "
                       "the notebook's %%resilient cell) starts it afresh. Without RUN, the only run there is.",
                       epilog="exit codes: 0 forgotten, 2 no such run, several runs and none named, or the run "
                       "is in use by a kernel")
    sh = sub.add_parser("show", help="print what resuming a run would run and unpickle, as %%resilience show does",
                        description="Print every set-up cell that resuming RUN replays, in full, and the name and type of "
                        "every pickled value of its checkpoints that this installation did not sign, as `%resilience "
                        "show RUN` does in a notebook. Nothing runs.",
                        epilog="exit codes: 0 shown, 2 no such run, several runs and none named, or an unreadable journal")
    rs = sub.add_parser("resume", help="mark a run to go on from its checkpoint, as %%resilience resume does",
                        description="Mark RUN to go on from its last checkpoint when `colab-resilience run` runs its "
                        "notebook again, as `%resilience resume RUN` does in a notebook: a run stopped by an error in its "
                        "cell, whose checkpoint the cell's next run would drop, or a finished one (its final state comes "
                        "back, its cell is not run again). --trust vouches for a run written under another installation "
                        "key (another machine, a new Colab VM whose run directory is on Drive, a lost key): it prints "
                        "every set-up cell the run replays and every pickled value it unpickles, then signs the run with "
                        "this installation's key. Nothing runs here: read what it prints before you run the notebook "
                        "(`colab-resilience reset RUN` forgets the run instead).",
                        epilog="exit codes: 0 marked (or pending already), 2 no such run, several runs and none named, an "
                        "unreadable journal, a run another key signed without --trust, or the run is in use by a kernel")
    rs.add_argument("--trust", action="store_true", help="the run was written under another installation key, and you "
                    "vouch for what it prints")
    for q in (r, sh, rs):
        q.add_argument("run", nargs="?", metavar="RUN", help="the run's id, as messages and %%resilience status show it")
        q.add_argument("--run-dir", help="where the runs are: the --run-dir of `colab-resilience run` (default: "
                       "$COLAB_RESILIENCE_RUN_DIR, else a notebook's: ./.colab_resilience, in Colab the Drive folder)")
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the command's own parser, which its --help explains
            commands = {"run": p, "check": c, "demo": d, "reset": r, "show": sh, "resume": rs}
            where = commands.get(args.command, parser)
            where.error(f"unrecognized arguments: {' '.join(extra)}{_hint(extra, where, commands)}")
    except SystemExit as e:
        return EXIT_USAGE if e.code else EXIT_OK
    import signal
    import threading

    # where SIGTERM would end the process at once (not where a caller set its own handler)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    if args.command == "run":
        return run(args)
    if args.command in ("reset", "show", "resume"):
        from . import headless_runs

        act = {"reset": lambda: headless_runs.reset(args.run, args.run_dir),
               "show": lambda: headless_runs.show(args.run, args.run_dir),
               "resume": lambda: headless_runs.resume(args.run, args.run_dir, trust=args.trust)}[args.command]
        return headless_runs.refusing(args.command, act)
    if args.command in ("check", "demo"):
        try:
            return check(args) if args.command == "check" else demo(args)
        except KeyboardInterrupt as e:
            quiet_the_interrupted_cell()
            what = f"{args.notebook} not checked" if args.command == "check" else "the demo did not finish"
            print(f"colab-resilience {args.command}: {_stopped(e)}; {what}", file=sys.stderr)
            return _status(e)
    parser.print_help()
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
