"""Which cells run again after a restart, and in which order.

A cell marked ``%%replay`` is recorded when it runs successfully. Cells are identified by the id
the front end sends with the execute request (JupyterLab/Notebook: ``metadata.cellId``; Colab:
``metadata.colab.cell_id``; IPython 8+ also passes ``cell_id`` to ``pre_run_cell``). Without an
id (nbclient, the terminal), the source itself is the identity. Re-running a recorded cell
replaces its record in place, so the order is the order in which the cells first ran, which is
notebook order for a notebook run top to bottom.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass
class ReplayCell:
    key: str
    source: str  # the full cell, ``%%replay`` line included: what a new kernel re-runs


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


class ReplayLog:
    """The ordered record of replay cells of this kernel."""

    def __init__(self):
        self._cells: dict[str, ReplayCell] = {}

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

    def __len__(self) -> int:
        return len(self._cells)

    def clear(self) -> None:
        self._cells.clear()
