"""Which cells run again after a restart, in which order, and running them.

A set-up cell is a cell marked ``%%replay`` (recorded when it runs successfully) or, in a
notebook run by the supervisor, a cell tagged ``replay`` (or papermill's ``parameters``). Cells
are identified by the id the front end sends with the execute request (JupyterLab/Notebook:
``metadata.cellId``; Colab: ``metadata.colab.cell_id``); without one (nbclient, the terminal) the
source itself is the identity. Re-running a recorded cell replaces its record in place, so the
order is the order in which the cells first ran: notebook order for a notebook run top to bottom.

After a restart, :func:`replay` executes the recorded cells this kernel has not run yet, in that
order, their output hidden unless one fails; a supervising driver replays the notebook's set-up
cells itself, through nbclient, and declares the tagged ones (:mod:`colab_resilience.kernelapi`).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable

from . import execution
from .journal import ReplayCell

MAGIC = "%%replay"
TAGS = frozenset({"replay", "parameters", "injected-parameters"})


def cell_key_from_metadata(metadata: dict | None) -> str | None:
    """The front end's cell id from an execute_request's metadata, if it sent one."""
    if not isinstance(metadata, dict):
        return None
    for key in ("cellId", "cell_id"):
        value = metadata.get(key)
        if isinstance(value, str) and value:
            return value
    colab = metadata.get("colab")
    if isinstance(colab, dict):
        value = colab.get("cell_id")
        if isinstance(value, str) and value:
            return value
    return None


def source_key(source: str) -> str:
    return "src:" + hashlib.sha256(source.strip().encode()).hexdigest()[:16]


def parent_metadata(shell) -> dict | None:
    """The metadata of the execute_request being handled by this kernel (None outside one)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return None
    try:
        parent = kernel.get_parent()
    except TypeError:  # ipykernel < 6 took a channel argument and had no default
        parent = kernel.get_parent("shell")
    except Exception:
        return None
    return (parent or {}).get("metadata") if isinstance(parent, dict) else None


def current_cell_key(shell) -> str | None:
    """The front end's id of the cell being executed, if it sent one."""
    return cell_key_from_metadata(parent_metadata(shell))


def is_replay_cell(cell) -> bool:
    """Whether a notebook cell is a set-up cell: ``%%replay``, or tagged ``replay``, ``parameters``
    or ``injected-parameters`` (parameters are set-up by definition)."""
    if cell.get("cell_type") != "code":
        return False
    tags = set(cell.get("metadata", {}).get("tags", []) or [])
    return bool(tags & TAGS) or cell.get("source", "").lstrip().startswith(MAGIC)


def split(source: str) -> tuple[str | None, str]:
    """A recorded cell as (its ``%%replay`` line or None, the code to execute)."""
    if source.lstrip().startswith(MAGIC):
        header, _, body = source.lstrip().partition("\n")
        return header, body
    return None, source


class ReplayLog:
    """The ordered record of the set-up cells of this kernel."""

    def __init__(self):
        self._cells: dict[str, ReplayCell] = {}
        # what the names the set-up cells bind held when the last of them ran in this kernel
        # (:func:`.setup_state.fingerprint`): a run that begins compares, for a change since
        self.names: set[str] = set()
        self.prints: dict[str, str] = {}
        # the same with the models and optimizers (setup_state.fingerprint, saved=True): a run that
        # begins tells a --save value nothing changed since they ran from one a cell changed
        self.saved_prints: dict[str, str] = {}

    def ran(self, shell, source: str) -> None:
        """A set-up cell ran in this kernel: fingerprint what the set-up cells bind, as it is now."""
        from . import setup_state

        self.names |= setup_state.setup_names(shell, [source])
        try:
            with setup_state.one_moment():  # the tensors both walk are hashed once
                self.prints = setup_state.fingerprint(shell.user_ns, sorted(self.names))
                self.saved_prints = setup_state.fingerprint(shell.user_ns, sorted(self.names), saved=True)
        except Exception as e:  # a guard: never the cell's failure, but for running out of memory
            from .oom import is_oom

            if is_oom(e):
                raise
            self.prints, self.saved_prints = {}, {}

    def record(self, key: str | None, source: str) -> ReplayCell:
        key = key or source_key(source)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = ReplayCell(key, source)
        else:
            cell.source = source  # dicts keep the first insertion's position
        return cell

    @property
    def cells(self) -> list[ReplayCell]:
        return list(self._cells.values())

    def __contains__(self, key: str) -> bool:
        return key in self._cells

    def __len__(self) -> int:
        return len(self._cells)

    def clear(self) -> None:
        self._cells.clear()


def run_replay_cell(shell, log: ReplayLog, line: str, body: str) -> None:
    """``%%replay``: run the cell as if it had no magic, then record it (errors are the cell's)."""
    header = f"{MAGIC} {line}".rstrip()
    failure = execution.run_body(shell, execution.compile_body(shell, header, body))
    if failure is not None:
        execution.reraise(shell, failure.exc, failure.tb)
    log.record(current_cell_key(shell), header + "\n" + body)
    log.ran(shell, body)


def overwrites(shell, cells: list[ReplayCell], log: ReplayLog) -> tuple[ReplayCell, str, ReplayCell] | None:
    """Whether replaying the run's set-up ``cells`` that this kernel has not run would bind a name
    over what a set-up cell of this kernel's that the run does not know made: ``(the run's cell,
    the name, this kernel's cell)``, else None. Without a cell id from the front end, a set-up
    cell edited and run again is another cell to the run, as is another notebook's cell of the
    same code (its training cell then shares the run): replayed, the run's old version would
    silently undo what this kernel ran. No clash: a cell of the same code (pasted, with a new id),
    and a name both bind alike (:func:`.setup_state.same_definition`: ``import torch`` again)."""
    from .run import code_change
    from .setup_state import all_bound, binding_statement, same_definition

    known = {c.key for c in cells}
    made = {name: cell for cell in log.cells if cell.key not in known for name in all_bound(shell, cell.source)}
    clashes = [(cell, name, made[name]) for cell in cells if made and cell.key not in log
               for name in sorted(all_bound(shell, cell.source))
               if name in made and code_change(split(made[name].source)[1], split(cell.source)[1]) is not None
               and not same_definition(shell, cell.source, made[name].source, name)]
    # of those, one whose binding differs, rather than one of the same line (MARK = ...) in a cell edited elsewhere
    differ = (c for c in clashes
              if binding_statement(shell, c[0].source, c[1]) != binding_statement(shell, c[2].source, c[1]))
    return next(differ, clashes[0] if clashes else None)


def _first_words(body: str) -> str:
    """How the line that says a set-up cell was replayed names it: its first line, and for the
    cell of injected parameters (papermill's ``# Parameters`` header, ``colab-resilience run -p``)
    the values, which say more than the header: "# Parameters: seed = 1; epochs = 20"."""
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    if lines[:1] == ["# Parameters"] and len(lines) > 1:
        return f"# Parameters: {'; '.join(lines[1:])}"
    return lines[0] if lines else ""


def replay(shell, cells: Iterable[ReplayCell], log: ReplayLog, say: Callable[[str], None]) -> int:
    """Execute the ``cells`` this kernel has not run yet, in order, one line each; their output
    is shown only if one fails, whose error is then raised as the cell's own. Returns how many
    ran."""
    from IPython.utils.capture import capture_output

    count = 0
    for cell in cells:
        if cell.key in log:
            continue
        header, body = split(cell.source)
        with capture_output() as captured:
            failure = execution.run_body(shell, execution.compile_body(shell, header, body))
        first = _first_words(body)
        if failure is not None:
            captured.show()
            what = "was interrupted" if isinstance(failure.exc, KeyboardInterrupt) else "failed"
            say(f"colab_resilience: replaying a set-up cell {what} ({first[:60]}); put right what it needs (or run it "
                "yourself), then run this cell again: the replay goes on from that cell")
            execution.reraise(shell, failure.exc, failure.tb)
        log.record(cell.key, cell.source)
        log.ran(shell, body)
        say(f"colab_resilience: replayed {first if len(first) <= 100 else first[:97] + '...'}")
        count += 1
    return count
