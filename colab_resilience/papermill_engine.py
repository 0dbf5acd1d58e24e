"""A papermill engine with the supervisor's resilience: ``papermill in.ipynb out.ipynb --engine resilient``.

papermill injects the parameters and tracks each cell's state; the cells run through
:func:`colab_resilience.driver.run_notebook`, so a kernel that dies is restarted, the replay
cells are replayed and the interrupted cell resumes. papermill records each cell's start and end
(and so its duration) as the supervisor reports them. papermill itself is not a dependency of
this package: the engine is registered through the ``papermill.engine`` entry point and only
imported by papermill.
"""

from __future__ import annotations

from papermill.engines import Engine

from .driver import run_notebook


class ResilientEngine(Engine):
    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, log_output=False, execution_timeout=None,
                                 cwd=None, max_restarts=3, **kwargs):
        return run_notebook(
            nb_man.nb, kernel_name=kernel_name, cell_timeout=execution_timeout, cwd=cwd,
            max_restarts=max_restarts, log_output=log_output,
            on_cell_start=lambda index, cell: nb_man.cell_start(cell, index),
            on_cell_complete=lambda index, cell: nb_man.cell_complete(cell, index),
            on_cell_error=lambda index, cell: nb_man.cell_exception(cell, cell_index=index),
        )
