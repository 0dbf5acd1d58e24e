"""colab_resilience: notebook training that survives out-of-memory errors and kernel deaths.

Load it in a notebook with ``%load_ext colab_resilience``; then

``%%replay``
    marks a set-up cell (imports, data, model) to re-run after a kernel restart;
``%%resilient [--save NAMES] [--retries N] [--shrink NAME[=FACTOR]] [--max-restarts N] [--every N]``
    runs a cell and recovers from an out-of-memory error: in process first (free what the error
    holds, roll the declared state back, shrink the batch, run again), then by restarting the
    kernel and resuming from the last safe point;
``resume_range(n)``, ``checkpoint()``
    the safe points of a ``%%resilient`` cell;
``%restart_after N`` / ``%restart_after --memory 90%``, ``%resilience status|resume|reset|dir``
    planned restarts, and the runs on disk.

Options are traitlets: ``%config ResilienceMagics.retries = 3`` in a notebook, or
``c.ResilienceMagics.retries = 3`` in ``ipython_config.py``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .oom import classify, is_oom  # noqa: E402  (light: imports no framework)
from .loops import checkpoint, resume_range  # noqa: E402

__all__ = [
    "__version__",
    "checkpoint",
    "classify",
    "is_oom",
    "load_ipython_extension",
    "replay_cells",
    "resume_range",
    "run_notebook",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython) -> None:
    """Register the magics, the configuration and the event callback (idempotent)."""
    import os

    from . import session, standby
    from .magics import ResilienceMagics
    from .restart import SUPERVISED_ENV

    if session.is_loaded(ipython):
        return
    if os.environ.get(SUPERVISED_ENV):  # its driver's standby imports what it imports, and how
        standby.watch_environment(ipython)
    magics = ResilienceMagics(shell=ipython, parent=ipython)
    ipython.register_magics(magics)  # Magics.__init__ already listed it in shell.configurables
    ipython.events.register("post_run_cell", _post_run_cell)
    ipython.input_transformers_post.append(magics.parse_first)
    # as in the examples: `for epoch in resume_range(20)` works without an import
    ipython.push({"resume_range": resume_range, "checkpoint": checkpoint}, interactive=False)
    session.register(ipython, magics.session)


def unload_ipython_extension(ipython) -> None:
    """Unregister every callback and magic that :func:`load_ipython_extension` registered."""
    from . import session

    state = session.unregister(ipython)
    if state is None:
        return
    magics = state.settings
    try:
        ipython.events.unregister("post_run_cell", _post_run_cell)
    except ValueError:
        pass
    if magics.parse_first in ipython.input_transformers_post:
        ipython.input_transformers_post.remove(magics.parse_first)
    for kind, table in magics.magics.items():
        registered = ipython.magics_manager.magics.get(kind, {})
        for name in table:
            registered.pop(name, None)
    ipython.configurables[:] = [c for c in ipython.configurables if c is not magics]
    ipython.magics_manager.registry.pop(type(magics).__name__, None)
    for name, obj in (("resume_range", resume_range), ("checkpoint", checkpoint)):
        if ipython.user_ns.get(name) is obj:
            del ipython.user_ns[name]
            ipython.user_ns_hidden.pop(name, None)


def _post_run_cell(result) -> None:
    from .execution import forget_rendered

    forget_rendered()


def replay_cells(shell=None) -> list[str]:
    """The sources of the recorded ``%%replay`` cells, in the order they will be replayed."""
    from .session import session_of

    return [cell.source for cell in session_of(shell).replay_log.cells]


def __getattr__(name: str):
    # the supervised runner pulls in nbclient and jupyter_client: only when asked for
    if name == "run_notebook":
        from .driver import run_notebook

        return run_notebook
    raise AttributeError(f"module 'colab_resilience' has no attribute {name!r}")
