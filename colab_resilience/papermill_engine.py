"""A papermill engine with the supervisor's resilience: ``papermill in.ipynb out.ipynb --engine resilient``.

papermill injects the parameters and tracks each cell's state; the cells run through
:func:`colab_resilience.driver.run_notebook`, so a kernel that dies is restarted, the replay
cells are replayed and the interrupted cell resumes. papermill records each cell's start and end
(and so its duration) as the supervisor reports them. papermill itself is not a dependency of
this package: the engine is registered through the ``papermill.engine`` entry point and only
imported by papermill. Runs are kept where ``$COLAB_RESILIENCE_RUN_DIR`` (or the engine option
``run_dir``) says, as ``colab-resilience run --run-dir`` keeps them.
"""

from __future__ import annotations

import os

from papermill.engines import Engine

from .driver import run_notebook
from .session import RUN_DIR_ENV


class ResilientEngine(Engine):
    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, log_output=False, execution_timeout=None,
                                 cwd=None, max_restarts=3, run_dir=None, **kwargs):
        """``run_dir`` (``papermill.execute_notebook(..., run_dir=DIR)``), else
        ``$COLAB_RESILIENCE_RUN_DIR`` (papermill's command line passes no engine options): where
        the runs are kept, so that a run an error stopped goes on with ``colab-resilience resume RUN
        --run-dir DIR`` and papermill run again; else a temporary folder, gone at the end."""
        return run_notebook(
            nb_man.nb, kernel_name=kernel_name, cell_timeout=execution_timeout, cwd=cwd,
            max_restarts=max_restarts, log_output=log_output,
            run_dir=run_dir or os.environ.get(RUN_DIR_ENV) or None, run_dir_named=f"${RUN_DIR_ENV}",
            on_cell_start=lambda index, cell: nb_man.cell_start(cell, index),
            on_cell_complete=lambda index, cell: nb_man.cell_complete(cell, index),
            on_cell_error=lambda index, cell: nb_man.cell_exception(cell, cell_index=index),
        )
