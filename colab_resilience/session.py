"""What this kernel remembers between cells: the set-up cells run so far, the planned-restart
policy, the run that ``%resilience resume`` handed to the next cell, and where runs are kept.

One :class:`Session` per IPython shell, made when the extension is loaded and found again with
:func:`session_of`. Its settings (retries, verbosity, the run directory, ...) are the traits of
the ``ResilienceMagics`` instance, so ``%config`` and ``ipython_config.py`` keep working.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

from .checkpoints.staging import Budget, parse_budget
from .errors import NotLoadedError
from .journal import RestartPolicy
from .replay import ReplayLog

RUN_DIR_ENV = "COLAB_RESILIENCE_RUN_DIR"
DRIVE = Path("/content/drive/MyDrive")


def in_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


NOTEBOOK_ENV = "JPY_SESSION_NAME"


def notebook() -> str | None:
    """The notebook this kernel was started for, where the server says (a Jupyter server sets
    ``$JPY_SESSION_NAME`` to the notebook's path in every kernel it starts, and its restarter keeps
    it; Colab, a terminal and a supervisor's kernels have none). Two notebooks in one run
    directory (a notebook and its copy share their cells' ids) keep their runs apart by it."""
    return os.environ.get(NOTEBOOK_ENV) or None


def default_root() -> Path:
    """``$COLAB_RESILIENCE_RUN_DIR``; in Colab a mounted Drive folder; else ./.colab_resilience."""
    env = os.environ.get(RUN_DIR_ENV)
    if env:
        return Path(env).expanduser()
    if in_colab() and DRIVE.is_dir():
        return DRIVE / "colab_resilience"
    return Path.cwd() / ".colab_resilience"


class Session:
    """The extension's state in one shell; ``settings`` holds the configurable traits."""

    def __init__(self, shell, settings):
        self.shell = shell
        self.settings = settings
        self.replay_log = ReplayLog()
        self.policy: RestartPolicy | None = None  # None: not set in this kernel
        self.linted: set[str] = set()  # cells already warned about names a restart would lose
        self.adopt: str | None = None  # the run id the next %%resilient cell continues
        self.last_run: str | None = None  # the run of the last %%resilient cell run here (a bare reset's)
        # a driver brings back the cell a dead kernel was running: if its run had finished, the
        # cell is done (its state was put back), not to be trained again on top of that state
        self.reexecuting = False
        self.saves: dict = {}  # run id -> SaveStats of its last execution in this kernel
        self.putting_back = False  # commands.put_back_finished is at work (a cell it runs again must not)
        self.not_back: set[str] = set()  # saved names of finished runs that could not be put back
        self.said: list[str] | None = None  # what the %%resilient cell running now has said (kept_in_view)

    def root(self) -> Path:
        run_dir = self.settings.run_dir
        return Path(run_dir).expanduser() if run_dir else default_root()

    def saving(self) -> tuple[Budget, str]:
        """How checkpoints are saved: the staging memory's budget, and what a busy safe point does."""
        return parse_budget(self.settings.staging_memory), self.settings.when_busy

    def say(self, line: str) -> None:
        if self.settings.verbose:
            print(line, flush=True)
            if self.said is not None:
                self.said.append(line)

    @contextmanager
    def kept_in_view(self):
        """Say again, at the end of a ``%%resilient`` cell, what was said in it before the cell
        cleared its output: a loop that draws its progress with ``clear_output(wait=True)`` (a
        live loss plot) would take a retry's line, a halved batch, a resume, from view at its
        next iteration, and the notebook would keep no trace of it. Its ``clear_output`` calls
        are counted for the time of the cell (IPython's ``clear_output`` goes through the
        shell's display publisher); nested, the outer cell does it."""
        pub = getattr(self.shell, "display_pub", None)
        if pub is None or self.said is not None:
            yield
            return
        said: list[str] = []
        cleared = 0
        original = pub.clear_output

        def clear_output(*args, **kwargs):
            nonlocal cleared
            cleared = len(said)
            return original(*args, **kwargs)

        self.said, pub.clear_output = said, clear_output
        try:
            yield
        finally:
            self.said = None
            if vars(pub).get("clear_output") is clear_output:
                del pub.clear_output
            if cleared:
                print("colab_resilience: said in this cell before it cleared its output:", *said[:cleared],
                      sep="\n", flush=True)


_sessions: dict[int, Session] = {}


def register(shell, session: Session) -> None:
    _sessions[id(shell)] = session


def unregister(shell) -> Session | None:
    return _sessions.pop(id(shell), None)


def is_loaded(shell) -> bool:
    return id(shell) in _sessions


def session_of(shell=None) -> Session:
    """The session of ``shell`` (default: the running IPython)."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    session = _sessions.get(id(shell)) if shell is not None else None
    if session is None:
        raise NotLoadedError(
            "colab_resilience is not loaded in this IPython; run %load_ext colab_resilience first"
        )
    return session
