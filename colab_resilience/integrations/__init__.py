"""Framework trainers whose own loops become the safe points of a ``%%resilient`` cell.

Each integration is a callback of one line, passed to the framework inside a ``%%resilient``
cell; it drives the cell's :class:`~colab_resilience.loops.Loops` as a ``resume_range`` over the
framework's epochs would, and registers what the framework carries between epochs (its model
and optimizer, restored in place) as state saved with every checkpoint:

- :mod:`colab_resilience.integrations.keras`: Keras 3 ``Model.fit``.

Importing this package imports no framework.
"""
