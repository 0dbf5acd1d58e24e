"""What a run's journal file may hold: its typed fields, their validation, the upgrade of version 1.

:func:`validate` refuses anything that is not a journal this package wrote, with
:class:`~colab_resilience.errors.JournalError` and one line that says what is wrong and what to
do; :func:`upgrade` reads a version 1 journal (free-form ``extra``) as version 2 fields. The
journal itself, its signing and its binding to its run are :mod:`colab_resilience.journal`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import JournalError

FORMAT = "colab_resilience.journal"
FORMAT_VERSION = 2
STATUSES = ("pending", "done", "failed")

# field -> (JSON types accepted, how to build the attribute from the JSON value)
SCALARS: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "status": (str,),
    "created": (float, int),
    "updated": (float, int),
    "last_checkpoint": (str, type(None)),
    "interrupted_cell": (str, type(None)),
    "cell_key": (str, type(None)),
    "max_restarts": (int,),
    "restarts_used": (int,),
    "kernel_pid": (int, type(None)),
    "restart_requested": (bool,),
    "phase": (str, type(None)),
    "resume_at": (str, type(None)),
    "oom_kills": (int, type(None)),
    "counted_pid": (int, type(None)),
    "generation": (int,),
    "framework": (str, type(None)),
    "loops": (bool,),
    "notebook": (str, type(None)),
    "stopped": (str, type(None)),
}
# absent from the first journals of version 2
OPTIONAL = {"resume_at": None, "oom_kills": None, "counted_pid": None, "generation": 0, "framework": None,
            "loops": False, "notebook": None, "stopped": None}


def bad(path: Path, why: str):
    raise JournalError(
        f"colab_resilience: {path} is not a usable run journal ({why}); "
        "remove it (or `%resilience reset`) to start the run afresh"
    )


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A version 1 journal (free-form ``extra``) as version 2 fields."""
    data = {**OPTIONAL, **data}
    if data["format_version"] >= 2:
        return data
    extra = data.pop("extra")
    policy = extra.get("policy") if isinstance(extra.get("policy"), dict) else {}
    shrink = extra.get("shrink") if isinstance(extra.get("shrink"), dict) else {}
    names = extra.get("names") if isinstance(extra.get("names"), list) else []
    data.update(
        cell_key=extra.get("cell_key") if is_type(extra.get("cell_key"), (str,)) else None,
        names=[n for n in names if is_type(n, (str,))],
        shrink={k: v for k, v in shrink.items() if is_type(v, (int,))},
        policy={"every": policy.get("every") if is_type(policy.get("every"), (int,)) else None,
                "memory_percent": policy.get("memory_percent")
                if is_type(policy.get("memory_percent"), (int, float)) else None},
        restart_requested=extra.get("restart_requested") is True,
        phase=extra.get("phase") if is_type(extra.get("phase"), (str,)) else None,
    )
    return data


def is_type(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def validate(data: Any, path: Path) -> None:
    if not isinstance(data, dict):
        bad(path, "not a JSON object")
    if data.get("format") != FORMAT:
        bad(path, f"format is {data.get('format')!r}, not {FORMAT!r}")
    version = data.get("format_version")
    if not is_type(version, (int,)) or not 1 <= version <= FORMAT_VERSION:
        bad(path, f"format version {version!r}; this package reads {FORMAT_VERSION}")
    scalars = {k: v for k, v in SCALARS.items() if k not in OPTIONAL or k in data}
    lists = {"restarts": list, "replay_cells": list}
    if version == 1:
        scalars = {k: v for k, v in scalars.items() if k not in ("cell_key", "restart_requested", "phase")}
        lists["extra"] = dict
    else:
        lists.update(names=list, shrink=dict, policy=dict)
    for name, types in [*scalars.items(), *((k, (t,)) for k, t in lists.items())]:
        if name not in data:
            bad(path, f"field {name!r} is missing")
        if not is_type(data[name], types):
            bad(path, f"field {name!r} is {type(data[name]).__name__}")
    if data["status"] not in STATUSES:
        bad(path, f"status {data['status']!r} is not one of {', '.join(STATUSES)}")
    if data["max_restarts"] < 0 or data["restarts_used"] < 0:
        bad(path, "negative restart counts")
    if data.get("generation", 0) < 0:
        bad(path, "a negative generation")
    for cell in data["replay_cells"]:
        if not (isinstance(cell, dict) and is_type(cell.get("key"), (str,)) and is_type(cell.get("source"), (str,))):
            bad(path, "a replay cell is not {key, source} strings")
    for r in data["restarts"]:
        if not (isinstance(r, dict) and is_type(r.get("reason"), (str,)) and is_type(r.get("time"), (int, float))
                and all(is_type(r.get(k, False), (bool,)) for k in ("planned", "refused"))
                and is_type(r.get("at"), (str, type(None)))):
            bad(path, "a restart is not {reason, time, planned, refused, at}")
    if version >= 2:
        if not all(is_type(n, (str,)) for n in data["names"]):
            bad(path, "a saved name is not a string")
        if not all(is_type(v, (int,)) for v in data["shrink"].values()):
            bad(path, "a shrunk value is not an integer")
        setup = data.get("setup", {})
        if not isinstance(setup, dict) or not all(is_type(v, (str,)) for v in setup.values()):
            bad(path, "the set-up cells' fingerprints are not strings")
        saved = data.get("start_saved", {})
        if not isinstance(saved, dict) or not all(is_type(v, (str,)) for v in saved.values()):
            bad(path, "the saved values' fingerprints are not strings")
        same = data.get("start_from_setup", [])
        if not isinstance(same, list) or not all(is_type(n, (str,)) for n in same):
            bad(path, "the names as the set-up cells made them are not strings")
        changed = data.get("setup_changed", [])
        if not isinstance(changed, list) or not all(is_type(n, (str,)) for n in changed):
            bad(path, "the names changed since the set-up cells ran are not strings")
        modules = data.get("modules", {})
        if not isinstance(modules, dict) or not all(is_type(v, (str,)) for v in modules.values()):
            bad(path, "the module files' digests are not strings")
        environment = data.get("environment", {})
        if not isinstance(environment, dict) or not all(v is None or is_type(v, (str,)) for v in environment.values()):
            bad(path, "the environment variables' digests are not strings")
        kernels = data.get("kernels", [])
        if not isinstance(kernels, list) or not all(is_type(k, (str,)) for k in kernels):
            bad(path, "the kernels that held the run are not strings")
        rng = data.get("start_rng")
        if rng is not None and not (isinstance(rng, dict) and isinstance(rng.get("leaves"), list) and "value" in rng):
            bad(path, "the random state of the run's start is not {value, leaves}")
        policy = data["policy"]
        if set(policy) != {"every", "memory_percent"} or not is_type(policy["every"], (int, type(None))) \
                or not is_type(policy["memory_percent"], (int, float, type(None))):
            bad(path, "the restart policy is not {every, memory_percent}")
