"""Random-number states, saved with every checkpoint and restored with it.

Python's ``random``, NumPy's global generator (if NumPy is imported), torch's CPU generator and
that of every initialised CUDA device (if torch is imported): a training resumed from a checkpoint
draws the same numbers it would have drawn without the interruption.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Mapping

from ..errors import CheckpointWarning


def capture_rng() -> dict[str, Any]:
    """The random-number states: Python, NumPy (if imported), torch CPU and initialised CUDA."""
    import random

    state: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state(legacy=True)
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned (CUDA states for the devices that exist)."""
    import random

    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "torch" in state or "cuda" in state:
        import torch

        if "torch" in state:
            torch.set_rng_state(state["torch"].contiguous())
        cuda = state.get("cuda") or []
        if cuda:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            for i, s in enumerate(cuda[:count]):
                torch.cuda.set_rng_state(s.contiguous(), i)
            if len(cuda) > count:
                warnings.warn(
                    f"colab_resilience: the checkpoint holds random states of {len(cuda)} CUDA "
                    f"devices; this machine has {count}; the others were not restored",
                    CheckpointWarning,
                    stacklevel=3,
                )
