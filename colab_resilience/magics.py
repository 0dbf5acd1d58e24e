"""The IPython glue: magics, their options, and the configuration traits.

Argument parsing and messages live here; the work is done by :mod:`.recovery` (in-process OOM
recovery) and :mod:`.replay` (the record of set-up cells).
"""

from __future__ import annotations

import argparse
import ast
import difflib

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Integer

from . import execution
from .recovery import Recovery, Shrink
from .replay import ReplayLog, cell_key_from_metadata, parent_metadata


def _retries(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"needs a whole number, like --retries 2 (got {text!r})"
        ) from None
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"cannot be negative (got {n}); use --retries 0 to turn in-process retries off"
        )
    return n


def _shrink_items(text: str, default_factor: float) -> list[Shrink]:
    items = []
    for part in text.split(","):
        part = part.strip()
        name, sep, factor_text = part.partition("=")
        name = name.strip()
        if not name.isidentifier():
            raise UsageError(
                f"%%resilient: --shrink {part!r}: {name!r} is not a variable name; "
                "write --shrink NAME or --shrink NAME=FACTOR, e.g. --shrink batch_size=0.5"
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
    return items


def _assigned_names(body: str) -> set[str]:
    """Names the body assigns at any level (a retry re-runs those assignments)."""
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


@magics_class
class ResilienceMagics(Magics):
    """``%%resilient`` and ``%%replay``. Configure with ``%config ResilienceMagics.retries = 3``
    or ``c.ResilienceMagics.retries = 3`` in ``ipython_config.py``."""

    retries = Integer(
        2, help="In-process recoveries from an out-of-memory error before giving up (--retries)."
    ).tag(config=True)
    shrink_factor = Float(
        0.5, help="Factor applied to a --shrink variable after an OOM when none is given."
    ).tag(config=True)
    verbose = Bool(True, help="Print one line for every recovery step.").tag(config=True)

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.replay_log = ReplayLog()

    # ----------------------------------------------------------------------------- helpers

    def say(self, line: str) -> None:
        if self.verbose:
            print(line, flush=True)

    def _cell_key(self) -> str | None:
        return cell_key_from_metadata(parent_metadata(self.shell))

    def _parse(self, magic, line: str):
        try:
            return parse_argstring(magic, line)
        except UsageError as e:
            name = magic.__name__
            text = str(e)
            if text.startswith("unrecognized arguments:"):
                bad = text.split(":", 1)[1].strip()
                raise UsageError(
                    f"%%{name}: unknown option {bad}; the options are {self._options_hint(name)} "
                    f"(see %%{name}? for help)"
                ) from None
            raise UsageError(f"%%{name}: {text}; see %%{name}? for the options") from None

    @staticmethod
    def _options_hint(name: str) -> str:
        if name == "resilient":
            return "--retries N and --shrink NAME[=FACTOR]"
        return "none"

    def _check_body(self, name: str, cell: str) -> None:
        if not cell.strip():
            raise UsageError(
                f"%%{name}: the cell has no code under the %%{name} line; "
                "put the code to run below it"
            )

    def _check_shrink(self, shrinks: list[Shrink], cell: str) -> None:
        ns = self.shell.user_ns
        assigned = _assigned_names(cell)
        for s in shrinks:
            if s.name not in ns:
                ints = [k for k, v in ns.items() if not k.startswith("_") and type(v) is int]
                close = difflib.get_close_matches(s.name, ints, n=1)
                also = f" (did you mean {close[0]!r}?)" if close else ""
                raise UsageError(
                    f"%%resilient: --shrink {s.name}: no variable {s.name!r} exists{also}; "
                    f"set it in an earlier cell, e.g. {s.name} = 256"
                )
            value = ns[s.name]
            if not isinstance(value, int) or isinstance(value, bool):
                raise UsageError(
                    f"%%resilient: --shrink {s.name}: {s.name} is a {type(value).__name__} "
                    f"({value!r:.40}), but --shrink needs an integer such as a batch size"
                )
            if value < 1:
                raise UsageError(
                    f"%%resilient: --shrink {s.name}: {s.name} is {value}; it must be at least 1"
                )
            if s.name in assigned:
                raise UsageError(
                    f"%%resilient: --shrink {s.name}: the cell assigns {s.name}, so every retry "
                    f"would undo the shrink; set {s.name} in an earlier cell instead"
                )

    # ----------------------------------------------------------------------------- magics

    @magic_arguments()
    @argument(
        "--retries", type=_retries, default=None, metavar="N",
        help="in-process recoveries after an out-of-memory error (default 2, see ResilienceMagics.retries)",
    )
    @argument(
        "--shrink", action="append", default=[], metavar="NAME[=FACTOR]",
        help="on OOM, multiply the integer variable NAME by FACTOR (default 0.5, never below 1) "
        "before retrying; repeat the option or separate names with commas",
    )
    @cell_magic
    def resilient(self, line: str, cell: str):
        """Run the cell; on an out-of-memory error, free memory and run it again.

        A recovery drops what the error holds (traceback frames, ``sys.last_*``, the cell's
        stored output), collects garbage, empties the allocator cache of torch when it is
        imported, shrinks the ``--shrink`` variables and runs the cell again. Errors that are not
        out-of-memory errors behave exactly as without the magic. Example::

            %%resilient --retries 3 --shrink batch_size
            for epoch in range(10):
                train_one_epoch(model, opt, batch_size)
        """
        args = self._parse(self.resilient, line)
        self._check_body("resilient", cell)
        shrinks = [s for text in args.shrink for s in _shrink_items(text, self.shrink_factor)]
        self._check_shrink(shrinks, cell)
        retries = self.retries if args.retries is None else args.retries
        recovery = Recovery(self.shell, retries=retries, shrink=tuple(shrinks), say=self.say)
        recovery.run(f"%%resilient {line}".rstrip(), cell)

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
        self._parse(self.replay, line)
        self._check_body("replay", cell)
        key = self._cell_key()
        failure = None
        try:
            execution.run_body(self.shell, execution.compile_body(self.shell, f"%%replay {line}".rstrip(), cell))
        except execution.BodyError as e:
            failure = e
        if failure is not None:
            execution.reraise(self.shell, failure.exc, failure.tb)
        self.replay_log.record(key, f"%%replay {line}".rstrip() + "\n" + cell)

    # ----------------------------------------------------------------------------- events

    def post_run_cell(self, result) -> None:
        execution.forget_rendered()

