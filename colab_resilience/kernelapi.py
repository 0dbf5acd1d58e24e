"""The few calls a supervising driver makes inside a kernel.

A driver (:mod:`colab_resilience.driver`) talks to its kernels only through these functions: it
sends the line :func:`colab_resilience.client.api_call` spells, which imports this module and
calls one of them. Each takes and returns plain values (literals).
"""

from __future__ import annotations

from . import standby

__all__ = [
    "adopt_standby",
    "become_standby",
    "declare_replay_cell",
    "new_modules",
    "preload",
    "restore_finished_runs",
]


def restore_finished_runs() -> list[str]:
    """Put back the final state of every run that finished, oldest first, and return the names
    restored. After a restart in a cell that follows a finished ``%%resilient`` cell, replaying
    the set-up cells alone would hand that cell an untrained model."""
    from .commands import restore_finished_runs as restore
    from .session import session_of

    return restore(session_of())


def declare_replay_cell(source: str) -> None:
    """Record a cell the driver already executed as a set-up cell (a cell tagged ``replay``:
    nbclient sends no cell metadata, so the kernel cannot see the tag)."""
    from .session import session_of

    session_of().replay_log.record(None, source)


def new_modules() -> str:
    """The installed modules imported since the last call, space-separated (see
    :func:`colab_resilience.standby.new_modules`)."""
    return " ".join(standby.new_modules())


def become_standby(whole: bool = False) -> None:
    standby.become(whole)


def preload(names: list[str]) -> None:
    standby.preload(names)


def adopt_standby(nice: int | None = None) -> None:
    standby.adopt(nice)
