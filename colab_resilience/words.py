"""How the messages say things: a type's name with its article, a count with its noun."""

from __future__ import annotations

import difflib
import re

SAID = "colab_resilience: "  # how each line this package says in a cell begins


def a(name: str) -> str:
    """``name`` (a type's) with its indefinite article, as it is said: "an int", "an AdamW",
    "an ndarray", "an SGD" and "an LSTM" (said letter by letter), "a Linear", "a GRU", "a uint8"."""
    if not name:
        return "a"
    first, rest = name[0], name[1:]
    if first.isupper() and (rest[:1].isupper() or rest[:1].isdigit()):  # an acronym: its first letter's name
        vowel = first in "AEFHILMNORSX"
    elif first in "uU":  # "a Union", "a uint8", "a UserDict"; "an Upsample", "an Undefined"
        vowel = not name.lower().startswith(("uni", "uin", "use", "usa", "uti"))
    else:
        vowel = first in "aeioAEIO" or name.startswith("nd")  # "an ndarray"
    return f"{'an' if vowel else 'a'} {name}"


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, plural but for one: "1 cell", "3 cells"."""
    return f"{n} {word}{'s' if n != 1 else ''}"


def did_you_mean(name: str, candidates: list[str], *, quoted: bool = True) -> str:
    """" (did you mean 'epochs'?)" for the candidate closest to ``name`` (difflib's rule), or ""."""
    close = difflib.get_close_matches(name, candidates, n=1)
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if quoted else f" (did you mean {close[0]}?)"


DIGEST = "digest:"  # a record's value that stands for what something holds, not shown


def differences(saved: dict[str, str], now: dict[str, str], most: int = 3, longest: int = 60) -> str | None:
    """The entries of two settings' records (name -> value as shown) that both have and that
    differ, in words: ``"loss "mse" now, "mae" saved; ..."``, the first ``most``, each value cut
    to ``longest`` characters (a :data:`DIGEST` is not shown: ``"what train_dataset holds
    differs"``); None where none differ. An entry only one has (a library of another version) is
    not a difference."""
    differ = [k for k in sorted(saved.keys() & now.keys()) if saved[k] != now[k]]
    if not differ:
        return None

    def short(value: str) -> str:
        return value if len(value) <= longest else value[:longest - 3] + "..."

    def one(k: str) -> str:
        if now[k].startswith(DIGEST) or saved[k].startswith(DIGEST):
            return f"{k} differs"
        return f"{k} {short(now[k])} now, {short(saved[k])} saved"

    shown = "; ".join(one(k) for k in differ[:most])
    return shown + (f" and {len(differ) - most} more" if len(differ) > most else "")


# a magic that a line advises, with its run where it names one: the command does the same headless
_MAGIC = re.compile(r"`?%resilience (reset|show|resume)((?: --trust)?)(?: ([0-9a-f]{8})\b)?`?")
_RUN = re.compile(r"\brun ([0-9a-f]{8})\b")
# what a notebook's user does after the magic, and what a headless one does
_THEN = [("then run this cell again", "then run the command again"), ("and run this cell again", "and run the command again"),
         ("run this cell again", "run the command again"), ("then run this cell", "then run the command again"),
         ("before running its cell", "before running the command again"),
         ("restart the kernel and run the cells again", "run the command again"),
         ("run its set-up cell as it was", "run the command with the set-up it began with (the notebook, the -p values)")]


def headless(line: str, run_dir: str | None, without: str = "--run-dir") -> str:
    """A line this package said in a kernel of ``colab-resilience run`` (or papermill's
    ``--engine resilient``), as its user there does what it says: a notebook's ``%resilience
    reset | show | resume [--trust] RUN`` is ``colab-resilience reset | show | resume [--trust] RUN
    --run-dir DIR`` (:mod:`.headless_runs`), and "run this cell again" is the command run again;
    without a run directory (``without``: how that user gives one) the run went with the command's
    temporary folder, and the command run again starts it afresh. Other lines are returned as they
    are."""
    if _MAGIC.search(line) is None:
        return line
    if run_dir is None:
        said = f" (headless, without {without}: the run went with this command's temporary folder; the command run " \
               "again starts it afresh)"
        return line if line.endswith(said) else line + said  # (said once, where a line is said again)
    named = next(iter(_RUN.findall(line)), "RUN")
    line = _MAGIC.sub(lambda m: f"`colab-resilience {m[1]}{m[2]} {m[3] or named} --run-dir {run_dir}`", line)
    for notebook, command in _THEN:
        line = line.replace(notebook, command)
    return line
