"""Framework trainers whose own loops become the safe points of a ``%%resilient`` cell.

Each integration is a callback of one line, passed to the framework inside a ``%%resilient``
cell; it drives the cell's :class:`~colab_resilience.loops.Loops` as a ``resume_range`` over the
framework's epochs would, and registers what the framework carries between epochs (its model
and optimizer, restored in place) as state saved with every checkpoint:

- :mod:`colab_resilience.integrations.keras`: Keras 3 ``Model.fit``;
- :mod:`colab_resilience.integrations.transformers`: the Hugging Face ``Trainer.train``;
- :mod:`colab_resilience.integrations.lightning`: Lightning's ``Trainer.fit``.

Importing this package imports no framework.
"""

from __future__ import annotations

import sys


def caller_locals(function: str, owner) -> dict:
    """The local variables of the framework's method ``function`` of ``owner`` (its ``self``) that
    is calling back, or {} when it is not on the stack: what a framework keeps in its loop's
    locals and does not pass to callbacks (Keras ``fit``'s data, the Trainer's steps to skip)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_locals.get("self") is owner:
            return dict(frame.f_locals)
        frame = frame.f_back
    return {}
