"""The IPython glue: the magics, their options, and the configuration traits.

Each magic parses its line with ``magic_arguments`` and calls one function:
``%%resilient`` :func:`colab_resilience.resilient.execute`, ``%%replay``
:func:`colab_resilience.replay.run_replay_cell`, ``%resilience`` the functions of
:mod:`colab_resilience.commands`; ``%restart_after`` sets the session's policy. User mistakes are
:class:`~IPython.core.error.UsageError` in one line (IPython shows them without a traceback).
"""

from __future__ import annotations

import re
from typing import Callable

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.utils.process import arg_split
from traitlets import Bool, Enum, Float, Integer, TraitError, Unicode, validate

from . import commands, execution, options, replay, resilient
from .errors import (
    OptionError, RunLockedError, RunStoppedError, UnsafeCheckpointError, UnsafeDirectoryError, UnsaveableValueError,
)
from .checkpoints.staging import parse_budget
from .journal import RestartPolicy
from .recovery import Shrink
from .loops import active_run
from .session import Session

OPTIONS_HINT = {
    "resilient": "--save NAMES, --retries N, --shrink NAME[=FACTOR], --max-restarts N and --every N|5min",
    "restart_after": "N, --memory PERCENT and off",
    "resilience": "status, show [RUN], resume [--trust] [RUN], reset [RUN], dir PATH, isolate [off] and help",
    "replay": "",  # none
}


def _names(values: list[str]) -> list[str]:
    names: list[str] = []
    for text in values:
        for part in text.split(","):
            part = part.strip()
            if not part.isidentifier():
                raise UsageError(
                    f"%%resilient: --save {text!r}: {part!r} is not a variable name; write --save model,opt,history"
                )
            if part not in names:
                names.append(part)
    return names


def _shrinks(values: list[str], default_factor: float) -> tuple[Shrink, ...]:
    items = []
    for text in values:
        for part in text.split(","):
            part = part.strip()
            name, sep, factor_text = part.partition("=")
            name = name.strip()
            if not all(word.isidentifier() for word in name.split(".")):
                raise UsageError(
                    f"%%resilient: --shrink {part!r}: {name!r} is not a variable name or an attribute path; "
                    "write --shrink NAME or --shrink NAME=FACTOR, e.g. --shrink batch_size=0.5 or "
                    "--shrink trainer.args.per_device_train_batch_size"
                )
            factor = default_factor
            if sep:
                try:
                    factor = float(factor_text)
                except ValueError:
                    factor = float("nan")
                if not 0 < factor < 1:
                    raise UsageError(
                        f"%%resilient: --shrink {part}: the factor must be a number between 0 and 1 "
                        f"(got {factor_text!r}), e.g. --shrink {name}=0.5"
                    )
            items.append(Shrink(name, factor))
    return tuple(items)


def _parse(magic, line: str, prefix: str, unknown: Callable[[str], str] | None = None):
    """``parse_argstring``, with every mistake as a one-line UsageError (``unknown(options)``
    words the refusal of unknown options, where the magic can say more)."""
    name = magic.__name__
    try:
        return parse_argstring(magic, line)
    except ValueError as e:  # shlex: an unclosed quote
        raise UsageError(f"{prefix}{name}: cannot read the options ({e}); close or remove the quote") from None
    except UsageError as e:
        text = " ".join(str(e).split())  # one line, whatever newlines the options held
        if text.startswith("unrecognized arguments:"):
            bad = text.split(":", 1)[1].strip()
            if unknown is not None:
                raise UsageError(unknown(bad)) from None
            options = f"the options are {OPTIONS_HINT[name]}" if OPTIONS_HINT[name] else f"{prefix}{name} takes no options"
            raise UsageError(f"{prefix}{name}: unknown option {bad}; {options} (see {prefix}{name}? for help)") from None
        missing = re.fullmatch(r"argument (-\S+): expected one argument", text)
        if missing:  # argparse reads a value that begins with '-' as an option: say which value
            words = arg_split(line)  # as parse_argstring splits it (it keeps an unclosed quote)
            i = next((i for i, w in enumerate(words) if w in missing[1].split("/")), None)
            if i is not None and i + 1 < len(words):
                raise UsageError(f"{prefix}{name}: {words[i]} {words[i + 1]}: the value cannot begin with '-'; "
                                 f"see {prefix}{name}? for the options") from None
        raise UsageError(f"{prefix}{name}: {text}; see {prefix}{name}? for the options") from None


def _check_body(name: str, cell: str) -> None:
    if not cell.strip():
        raise UsageError(f"%%{name}: the cell has no code under the %%{name} line; put the code to run below it")


@magics_class
class ResilienceMagics(Magics):
    """``%%resilient``, ``%%replay``, ``%restart_after`` and ``%resilience``. Configure with
    ``%config ResilienceMagics.retries = 3`` or ``c.ResilienceMagics.retries = 3`` in
    ``ipython_config.py``."""

    retries = Integer(
        2, help="In-process recoveries from an out-of-memory error before giving up (--retries)."
    ).tag(config=True)
    shrink_factor = Float(
        0.5, help="Factor applied to a --shrink variable after an OOM when none is given."
    ).tag(config=True)
    verbose = Bool(True, help="Print one line for every recovery step.").tag(config=True)
    max_restarts = Integer(
        3, help="Kernel restarts a run may use, counted on disk across kernels (--max-restarts)."
    ).tag(config=True)
    run_dir = Unicode(
        "", help="Where runs keep their journal and checkpoints (default: a mounted Drive folder "
        "in Colab, else ./.colab_resilience; also $COLAB_RESILIENCE_RUN_DIR)."
    ).tag(config=True)

    staging_memory = Unicode(
        "25%", help="Memory a checkpoint's snapshot may be copied into, so that it is written while "
        "training goes on: a share of the memory available at each safe point (25%), a size "
        "(2GiB), or off (every save written while training waits)."
    ).tag(config=True)
    standby = Bool(
        True, help="Under %resilience isolate: keep a second worker kernel started and warmed with the "
        "worker's imports, so that a restart skips the kernel start and the imports (one more process)."
    ).tag(config=True)
    when_busy = Enum(
        ["wait", "skip"], "wait", help="A safe point that comes while the previous checkpoint is "
        "still being written: wait for it, or skip this save."
    ).tag(config=True)

    @validate("staging_memory")
    def _valid_staging(self, proposal):
        try:
            parse_budget(proposal["value"])
        except ValueError as e:
            raise TraitError(f"ResilienceMagics.staging_memory needs {e}") from None
        return proposal["value"]

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.session = Session(shell, self)
        # an input transformer: a syntax error in either cell's body is shown as a plain cell's
        self.parse_first = execution.parse_first(shell, ("resilient", "replay"))

    @magic_arguments()
    @argument(
        "--save", action="append", default=[], metavar="NAMES",
        help="variables checkpointed at every safe point and restored after a rollback or a "
        "restart (comma-separated); modules, optimizers and schedulers are restored in place",
    )
    @argument(
        "--retries", type=options.whole_number("--retries 2", "use --retries 0 to turn in-process retries off"),
        default=None, metavar="N",
        help="in-process recoveries after an out-of-memory error (default 2, see ResilienceMagics.retries)",
    )
    @argument(
        "--shrink", action="append", default=[], metavar="NAME[=FACTOR]",
        help="on OOM, multiply the integer variable NAME by FACTOR (default 0.5, never below 1) "
        "before retrying; repeat the option or separate names with commas",
    )
    @argument(
        "--max-restarts", type=options.whole_number("--max-restarts 3", "use --max-restarts 0 to never restart"),
        default=None, metavar="N", help="kernel restarts this run may use, counted on disk (default 3)",
    )
    @argument(
        "--every", type=options.every, default=None, metavar="N|5min",
        help="checkpoint at every Nth safe point, or at most once per duration (default: every one)",
    )
    @cell_magic
    def resilient(self, line: str, cell: str):
        """Run the cell; on an out-of-memory error, free memory and run it again; past the
        retries, restart the kernel and resume from the last safe point.

        A recovery drops what the error holds (traceback frames, ``sys.last_*``, the cell's
        stored output), collects garbage, empties torch's allocator cache, rolls the ``--save``
        variables back to the last safe point, shrinks the ``--shrink`` variables and runs the
        cell again. Errors that are not out-of-memory errors behave exactly as without the
        magic. Example::

            %%resilient --save model,opt,history --shrink batch_size
            for epoch in resume_range(20):
                train_one_epoch(model, opt, batch_size)
                history.append(evaluate(model))
        """
        args = _parse(self.resilient, line, "%%")
        _check_body("resilient", cell)
        options = resilient.Options(
            names=_names(args.save),
            retries=self.retries if args.retries is None else args.retries,
            shrink=_shrinks(args.shrink, self.shrink_factor),
            max_restarts=self.max_restarts if args.max_restarts is None else args.max_restarts,
            every=args.every or (1, None),
        )
        try:
            with self.session.kept_in_view():
                resilient.execute(self.session, line, cell, options)
        except (OptionError, RunLockedError, RunStoppedError, UnsafeCheckpointError, UnsafeDirectoryError,
                UnsaveableValueError) as e:
            # refusals, each in one line that says what to do: no traceback through this package
            raise UsageError(str(e).splitlines()[0]) from None

    @magic_arguments()
    @cell_magic
    def replay(self, line: str, cell: str):
        """Run the cell and record it as a set-up cell to replay after a kernel restart.

        Replay cells are re-run in the order they first ran, before the interrupted cell
        resumes. Re-running a cell replaces its record. Example::

            %%replay
            import torch
            model = Net(); opt = torch.optim.AdamW(model.parameters())
        """
        _parse(self.replay, line, "%%")
        _check_body("replay", cell)
        replay.run_replay_cell(self.shell, self.session.replay_log, line, cell)

    @magic_arguments()
    @argument("every", nargs="?", metavar="N|off", help="restart after every N safe points (off: no planned restarts)")
    @argument("--memory", metavar="PERCENT", help="restart at a safe point when memory in use reaches PERCENT, e.g. 90%%")
    @line_magic
    def restart_after(self, line: str):
        """Plan kernel restarts at safe points: the leak guard.

        ``%restart_after N``: a fresh kernel after every N safe points of a ``%%resilient`` run.
        ``%restart_after --memory 90%``: at a safe point, restart when host RAM (or GPU memory,
        once CUDA is initialised) in use reaches 90%. ``%restart_after off`` stops both. State is
        saved first; planned restarts do not spend the restart budget.
        """
        args = _parse(self.restart_after, line, "%")
        usage = "write %restart_after N, %restart_after --memory 90% or %restart_after off"
        current = self.session.policy or RestartPolicy()
        every, memory = current.every, current.memory_percent
        if args.every is None and args.memory is None:
            raise UsageError(f"%restart_after: give a number of safe points or a memory threshold; {usage}")
        if args.every in ("off", "0"):
            every = memory = None
        elif args.every is not None:
            try:
                every = int(args.every)
            except ValueError:
                raise UsageError(f"%restart_after: {args.every!r} is not a number of safe points; {usage}") from None
            if every < 0:
                raise UsageError(f"%restart_after: {every} is negative; {usage}")
        if args.memory is not None:
            value = args.memory.strip().lstrip("=").strip().rstrip("%").strip()
            try:
                memory = float(value)
            except ValueError:
                raise UsageError(f"%restart_after: --memory needs a percentage (got {value!r}); {usage}") from None
            if not 0 < memory <= 100:
                raise UsageError(f"%restart_after: --memory {memory:g}% is not between 0 and 100; {usage}")
        self.session.policy = RestartPolicy(every, memory)
        run = active_run()
        if run is not None:  # written inside a %%resilient cell: for its run too, from now on
            run.set_policy(self.session.policy)
        self.session.say(f"colab_resilience: planned restarts {self.session.policy.describe()}"
                         + (f" (run {run.run_id} included)" if run is not None else ""))

    @magic_arguments()
    @argument("command", nargs="?", default="status", metavar="COMMAND",
              help="status, show, resume, reset, dir, isolate or help")
    @argument("target", nargs="*", metavar="RUN|PATH|off",
              help="the run to resume or reset, the folder for dir, off for isolate")
    @argument("--trust", action="store_true", help="resume a run written under another installation's key")
    @line_magic
    def resilience(self, line: str):
        """What the runs are doing and what is on disk.

        ``%resilience status``: every run in the run directory (status, restarts, last checkpoint).
        ``%resilience show [RUN]``: what resuming the run would execute (every set-up cell, in
        full) and unpickle (every pickled value not signed here); nothing runs.
        ``%resilience resume [RUN]``: replay the recorded set-up cells, restore the last checkpoint
        into the namespace, and mark the run pending so its cell continues when run again.
        ``%resilience resume --trust [RUN]``: the same for a run written under another key (another
        machine, a new Colab VM whose run directory is on Drive): every set-up cell and pickled
        value is printed, then run; you vouch for them, and the run's journal and checkpoints are
        signed with this installation's key from then on.
        ``%resilience reset [RUN]``: forget a run (journal and checkpoints).
        ``%resilience dir PATH``: choose the run directory (in Colab, a mounted Drive folder
        survives the loss of the VM).
        ``%resilience isolate``: from now on run every cell in a worker kernel that this kernel
        starts and owns; when the worker dies (OOM, SIGKILL, a planned restart) the cell goes on
        in a new worker within the same execution, with no re-run. ``%resilience isolate off``
        shuts the worker down.
        ``%resilience help``: what each of this package's magics does.
        """
        forms = {"status": "status", "show": "show [RUN]", "resume": "resume [--trust] [RUN]", "reset": "reset [RUN]",
                 "dir": "dir PATH", "isolate": "isolate [off]", "help": "help"}
        words = line.split()
        command = words[0] if words and words[0] in forms else None

        def unknown(bad: str) -> str:
            if command is None:
                return f"%resilience: unknown option {bad}; the options are {OPTIONS_HINT['resilience']} (see %resilience? for help)"
            return f"%resilience {command}: unexpected {bad!r}; write %resilience {forms[command]}"

        if command == "resume" and "--trust" in words:  # argparse takes no RUN after the flag
            line = " ".join([w for w in words if w != "--trust"] + ["--trust"])
        args = _parse(self.resilience, line, "%", unknown)
        command, rest, session = args.command, list(args.target), self.session
        try:
            if command not in ("status", "help") and active_run() is not None:
                raise OptionError(
                    f"%resilience {command}: not while the %%resilient cell of run {active_run().run_id} runs; "
                    "write it in a cell of its own"
                )
            if command not in forms:
                *others, last = forms.values()
                raise OptionError(f"%resilience: unknown command {command!r}; write %resilience {', '.join(others)} or {last}")
            if command == "isolate":
                return self._isolate(rest, args.trust)
            if command == "dir" and len(rest) != 1:
                raise OptionError("%resilience dir: give one folder, e.g. %resilience dir /content/drive/MyDrive/runs")
            extra = rest[{"status": 0, "help": 0, "dir": 1}.get(command, 1):] + (["--trust"] if args.trust and command != "resume" else [])
            if extra:
                raise OptionError(f"%resilience {command}: unexpected {' '.join(extra)!r}; write %resilience {forms[command]}")
            if command == "status":
                return commands.status(session)
            if command == "help":
                return print(self._help())
            if command == "dir":
                return commands.set_dir(session, rest[0])
            run_dir = commands.pick_run(session, command, rest[0] if rest else None)
            if command == "reset":
                return commands.reset(session, run_dir)
            if command == "show":
                return commands.show(session, run_dir)
            return commands.resume(session, run_dir, trust=args.trust)
        except (OptionError, UnsafeDirectoryError) as e:
            raise UsageError(str(e)) from None

    def _help(self) -> str:
        """``%resilience help``: each magic's summary (the first paragraph of its docstring, so the
        two cannot disagree), and the ``%resilience`` commands in full."""
        import inspect
        import textwrap

        def described(magic) -> list[str]:
            # magic_arguments made each docstring "::", the usage line, the description, then the
            # options: the description's paragraphs
            paragraphs = [p.strip() for p in (inspect.getdoc(magic) or "").split("\n\n")]
            if paragraphs[0] == "::":
                paragraphs = paragraphs[2:]
            ends = [i for i, p in enumerate(paragraphs)
                    if p.startswith(("positional arguments:", "options:", "optional arguments:"))]
            return paragraphs[:ends[0] if ends else None]

        lines = ["colab_resilience's magics (each one's options: %%resilient?, %%replay?, %restart_after?, "
                 "%resilience?):"]
        for prefix, magic in (("%%", self.resilient), ("%%", self.replay), ("%", self.restart_after),
                              ("%", self.resilience)):
            summary = " ".join(described(magic)[0].split())
            lines.append(textwrap.fill(summary, 100, initial_indent=f"  {prefix}{magic.__name__}: ",
                                       subsequent_indent="      "))
        for paragraph in described(self.resilience)[1:]:
            lines += ["    " + line for line in paragraph.replace("``", "").splitlines()]
        return "\n".join(lines)

    def _isolate(self, rest: list[str], trust: bool) -> None:
        from . import isolate

        if trust or rest not in ([], ["off"], ["on"]):
            extra = " ".join(rest + (["--trust"] if trust else []))
            raise OptionError(f"%resilience isolate: unexpected {extra!r}; write %resilience isolate or %resilience isolate off")
        if rest == ["off"]:
            return isolate.stop(self.session)
        return isolate.isolate(self.session)
