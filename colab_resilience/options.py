"""Option values shared by the magics and the command line, as ``argparse`` types: whole
numbers and ``--every``. Each refusal is one line that says what was expected."""

from __future__ import annotations

import argparse
import re
from typing import Callable


def whole_number(like: str = "", if_negative: str = "", if_zero: str = "") -> Callable[[str], int]:
    """An argparse type for a count of 0 or more; ``like`` shows an example (``--retries 2``),
    ``if_negative`` what to write instead of a negative number; ``if_zero``: 0 is refused too, and
    this says why."""

    def convert(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            example = f", like {like}" if like else ""
            raise argparse.ArgumentTypeError(f"needs a whole number{example} (got {text!r})") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"cannot be negative (got {n})" + (f"; {if_negative}" if if_negative else ""))
        if n == 0 and if_zero:
            raise argparse.ArgumentTypeError(f"needs at least 1: {if_zero}")
        return n

    return convert


def parse_every(text: str) -> tuple[int | None, float | None]:
    """``--every 10`` (safe points) or ``--every 5min`` / ``90s`` / ``1h`` (seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)\s*", text)
    if m:
        n, unit = float(m.group(1)), m.group(2)
        seconds = n * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[unit]
        if seconds <= 0:
            raise ValueError(text)
        return None, seconds
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n, None


def every(text: str) -> tuple[int | None, float | None]:
    """The argparse type of ``--every``."""
    try:
        return parse_every(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"needs a number of safe points or a duration, like --every 10 or --every 5min (got {text!r})"
        ) from None
