"""The kernel side of the supervisor's standby kernel: a second kernel, started ahead of need and
warmed with the working kernel's imports, that takes the working kernel's place when it dies
(the driver side is :mod:`colab_resilience.standby_driver`).

The driver calls these through :mod:`colab_resilience.kernelapi`: it asks the working kernel for
the installed modules it imported since the last cell (:func:`new_modules`), has the standby
import them too (:func:`preload`), and when the working kernel dies makes the standby an ordinary
kernel (:func:`adopt`). A standby must cost the run as little as possible:

- it runs at the lowest CPU priority (:mod:`colab_resilience.priority`): the whole process where
  the kernel that takes over may raise its priority back, else only the thread that imports;
- it is the OOM killer's first choice: when host RAM runs out it is killed before the working
  kernel and gives its memory back;
- it imports only modules installed in the interpreter's own folders (the standard library and
  site-packages), never the notebook's own files, and never a module that starts a CUDA context
  on import (``pycuda.autoinit``): a standby holds no GPU memory.

A standby is started with ``COLAB_RESILIENCE_STANDBY=1`` in its environment (:func:`adopt` removes
it). Nothing here runs unless a driver asks.
"""

from __future__ import annotations

import functools
import importlib
import os
import queue
import sys
import sysconfig
import threading

from . import priority

# modules that must not be imported ahead of need: they create a CUDA context (GPU memory) on import
_NEVER = (".autoinit",)
ENV = "COLAB_RESILIENCE_STANDBY"

_reported: set[str] = set()
_queue: queue.SimpleQueue | None = None
_stop = threading.Event()
_worker: threading.Thread | None = None
_saved_adj: str | None = None
_imported: list[str] = []  # what the standby imported ahead of need (for tests and reports)
_start_env: dict[str, str] | None = None  # the standby's environment when it was started
_drew_on: str | None = None  # the import ahead that drew from a global random state, if one did
_untouched: set[str] = set()  # what the working kernel imported before its random states changed
_adopted = False  # it took over: an ordinary kernel now



@functools.lru_cache(maxsize=None)
def installed_roots() -> tuple[str, ...]:
    """The folders of the standard library and of installed packages (site-packages, the user's
    too), by real and absolute path, each ending in a separator: a module under one is installed
    code, not the notebook's."""
    import site

    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # virtualenv's old site.py
        pass
    user = getattr(site, "getusersitepackages", lambda: None)()
    if user:
        paths.add(user)
    roots = set()
    for p in paths:
        if p:
            roots.add(os.path.join(os.path.realpath(p), ""))
            roots.add(os.path.join(os.path.abspath(p), ""))
    return tuple(roots)


_seen_count = -1  # len(sys.modules) at the last new_modules()


class _EnvironmentAtImport:
    """(In a working kernel.) A finder that finds nothing: at every import it notes whether the
    environment changed since the one before, and where in ``sys.modules`` (in import order) the
    modules imported under the new one begin. A library may read a variable once, when it is
    imported (``KERAS_BACKEND``, ``JAX_ENABLE_X64``, ``PYTORCH_JIT``, ``TF_CPP_MIN_LOG_LEVEL``),
    and a notebook sets it just before: the standby must import it under the same environment.

    It also notes which modules were imported before the global random states
    (:func:`_random_states`) first differed, where an import began, from the ones the kernel
    started with. An import among those that draws from them (TensorFlow's, Lightning's) drew from
    states nothing had seeded: a replay in a standby that imported it ahead draws no differently
    from a cold restart's. After that, the notebook may have seeded them before the import, and a
    standby that imported it ahead cannot take over exactly."""

    def __init__(self):
        self._raw: dict | None = None
        self.env = dict(os.environ)
        self.marks: list[tuple[int, dict[str, str]]] = [(0, self.env)]  # (position, environment)
        importlib.import_module("random")  # its global state: the kernel's own, not yet drawn from
        self._start = _random_states()  # NumPy's, where its random module comes later: when it is made
        self.touched: dict | None = None  # sys.modules when the states were first found changed

    def find_spec(self, name, path=None, target=None):
        raw = getattr(os.environ, "_data", None)  # compared as it is stored: cheap, at every import
        if raw is None or raw != self._raw:
            self._raw = dict(raw) if raw is not None else None
            env = dict(os.environ)
            if env != self.env:
                self.env = env
                self.marks.append((len(sys.modules), env))
        if self.touched is None:
            # judged where an import begins in the notebook's code (a module that an installed one
            # imports shares its judgement: TensorFlow's draws do not count against its keras)
            if not _within_an_import() and self._random_states_changed():
                self.touched = dict(sys.modules)
            elif name == "numpy.random" and "numpy" not in self._start:
                return self._noting_numpy_random(name, path, target)
        return None

    def restart_random_states(self) -> None:
        """What the global random states are now is where they start (nothing changed them yet)."""
        self._start, self.touched = _random_states(), None

    def untouched(self, name: str, module) -> bool:
        """Whether module ``name`` was imported before the global random states first changed."""
        return self.touched is None or self.touched.get(name) is module

    def _random_states_changed(self) -> bool:
        # a NumPy whose random module was made where none noted its state counts as changed
        return any(state != self._start.get(kind) for kind, state in _random_states().items())

    def _noting_numpy_random(self, name, path, target):
        """The spec that the finders after this one give ``numpy.random``, its loader noting
        NumPy's global random state as it is made (seeded from the OS), before any code can draw
        from it or seed it."""
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        exec_module = getattr(getattr(spec, "loader", None), "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_note(module):
            exec_module(module)
            state = _random_states().get("numpy")
            if state is not None and "numpy" not in self._start:
                self._start["numpy"] = state

        try:
            spec.loader.exec_module = exec_and_note
        except (AttributeError, TypeError):  # a loader that takes no attributes: NumPy's counts as touched
            pass
        return spec

    # an import system that asks finders to invalidate their caches finds nothing cached here
    def invalidate_caches(self) -> None:
        pass


def _within_an_import() -> bool:
    """Whether the import under way comes from the body of an installed module being imported
    (which a standby imports whole, this import with it), not from a cell's code, a function it
    called, or a notebook's own module (which a standby does not import: what that module seeded
    before this import counts)."""
    roots = installed_roots()
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            module = sys.modules.get(name)
            if getattr(getattr(module, "__spec__", None), "_initializing", False) and _offered(name, module, roots):
                return True
        frame = frame.f_back
    return False


_watcher: _EnvironmentAtImport | None = None
_sent_env: dict | None = None  # the environment last reported with new_modules()


def watch_environment(ipython=None) -> None:
    """(In a working kernel, at start.) Note the environment each module is imported under, and
    whether the global random states had changed; with ``ipython``, from its first cell on (what
    the kernel drew before that, as IPython's banner does to pick a tip for a frontend's
    kernel_info request, is no notebook's seed)."""
    global _watcher
    if _watcher is None:
        _watcher = _EnvironmentAtImport()
        sys.meta_path.insert(0, _watcher)
        if ipython is not None:
            ipython.events.register("pre_run_cell", _first_cell)


def _first_cell(*_info) -> None:
    """(In a working kernel, as its first cell begins.) The global random states start here."""
    from IPython import get_ipython

    if _watcher is not None:
        _watcher.restart_random_states()
    shell = get_ipython()
    if shell is not None:
        try:
            shell.events.unregister("pre_run_cell", _first_cell)
        except ValueError:
            pass


def new_modules() -> list[tuple[dict | None, list[str], bool]]:
    """(In the working kernel.) The installed modules imported since the last call, in the order
    they were imported, in groups: ``(environment, names, untouched)``, the environment they were
    imported under (None where it is the one reported last; without :func:`watch_environment`,
    always), and whether the global random states were still the ones the kernel started with when
    they were imported (without :func:`watch_environment`, never). The first call lists every one."""
    global _seen_count, _sent_env
    if len(sys.modules) == _seen_count:  # nothing imported since (asked after every cell: be quick)
        return []
    _seen_count = len(sys.modules)
    roots = installed_roots()
    marks = _watcher.marks if _watcher is not None else []
    groups: list[tuple[dict | None, list[str], bool]] = []
    env, m = None, 0
    for index, (name, module) in enumerate(list(sys.modules.items())):
        while m < len(marks) and marks[m][0] <= index:
            env, m = marks[m][1], m + 1
        if name in _reported:
            continue
        _reported.add(name)
        if not _offered(name, module, roots):
            continue
        untouched = _watcher is not None and _watcher.untouched(name, module)
        if env is not None and env != _sent_env:
            _sent_env = env
            groups.append((env, [], untouched))
        elif not groups or groups[-1][2] != untouched:
            groups.append((None, [], untouched))
        groups[-1][1].append(name)
    return groups


def _offered(name: str, module, roots: tuple[str, ...]) -> bool:
    """Whether a working kernel offers module ``name`` to the standby: installed (under ``roots``),
    not this package, not one that starts a CUDA context on import."""
    path = getattr(module, "__file__", None)
    if not path or name == "__main__" or name.endswith(_NEVER) or name.startswith("colab_resilience"):
        return False
    return path.startswith(roots) or os.path.realpath(path).startswith(roots)


def become(whole: bool = False) -> None:
    """(In a new standby.) Volunteer for the OOM killer; start the low-priority import thread;
    ``whole``: the whole process at low priority (the driver found that it may be undone)."""
    global _queue, _worker, _saved_adj, _start_env
    if _worker is not None:
        return
    _start_env = dict(os.environ)
    if whole:
        priority.renice_all(priority.NICE)
        if priority.autogroup_nice() != priority.NICE:  # the driver usually did it already
            priority.set_autogroup_nice(priority.NICE)
    _saved_adj = priority.set_oom_score_adj(priority.OOM_SCORE_ADJ)
    _queue = queue.SimpleQueue()
    _worker = threading.Thread(target=_import_forever, args=(_queue,), name="colab_resilience-standby", daemon=True)
    _worker.start()


def preload(groups: list) -> None:
    """(In a standby.) Import in the background, in order, the modules of ``groups`` (what
    :func:`new_modules` returns: ``(environment, names, untouched)``, each group's names imported
    under its environment, where one is given; or plain names); failures are ignored."""
    if _stop.is_set():  # adopted: it imports what it needs itself
        return
    if _queue is None:
        become()
    assert _queue is not None
    if groups and isinstance(groups[0], str):
        groups = [(None, groups, False)]
    for env, names, *untouched in groups:
        if untouched and untouched[0]:
            _untouched.update(names)
        _queue.put((env, list(names), bool(untouched and untouched[0])))


def _set_environ(env: dict[str, str]) -> None:
    """This process's environment to ``env``, the standby's mark kept."""
    keep = os.environ.get(ENV)
    for name in [n for n in os.environ if n not in env and n != ENV]:
        del os.environ[name]
    for name, value in env.items():
        if name != ENV and os.environ.get(name) != value:
            os.environ[name] = value
    if keep is not None:
        os.environ[ENV] = keep


def _import_forever(q: queue.SimpleQueue) -> None:
    global _drew_on
    priority.renice_this_thread(priority.NICE)
    roots = installed_roots()
    while True:
        item = q.get()
        if item is None:
            return
        env, names, untouched = item
        if env is not None and not _stop.is_set():
            _set_environ(env)
        for name in names:
            if _stop.is_set():
                return
            if name in sys.modules or name.endswith(_NEVER):
                continue
            before, present = _random_states(), set(sys.modules)
            try:
                importlib.import_module(name)
                _imported.append(name)
            except BaseException:  # an import that only works in its own context: the replay does it
                pass
            after = _random_states()
            # a state the import created (NumPy's, seeded from the OS) was drawn from by nothing else yet
            if any(after[kind] != state for kind, state in before.items()):
                # Where the working kernel imported it (and what it brought along here) before its
                # random states had changed, it drew from states nothing had seeded, there as here.
                # Otherwise the notebook may have seeded them before that import, and what it drew
                # next depends on it: a replay here, where the import is done already, would draw
                # other numbers. This standby cannot take over exactly (stop_importing says so to
                # the driver): no use importing more.
                brought = {n for n in set(sys.modules) - present if _offered(n, sys.modules.get(n), roots)}
                if untouched and brought <= _untouched | {name}:
                    continue
                _drew_on = name.partition(".")[0]  # the package the user imports
                return


def _random_states() -> dict:
    """Python's global random state, and NumPy's global one where it exists."""
    import random

    states: dict = {"python": random.getstate()}
    get = getattr(sys.modules.get("numpy.random"), "get_state", None)
    if get is not None:
        try:
            kind, key, *rest = get()
            states["numpy"] = (kind, key.tobytes(), *rest)
        except Exception:
            pass
    return states


def keep_for_adoption(oom_score_adj: int) -> bool:
    """(In a standby.) The OOM score to take when adopted, instead of the one it had before; False
    when this kernel is no standby (any more)."""
    global _saved_adj
    if _worker is None or _adopted:
        return False
    _saved_adj = oom_score_adj
    return True


def stop_importing() -> str:
    """(In a standby about to take over.) Import nothing more ahead, the import under way finished
    first (two threads importing one package at once can hand one of them the package half made:
    transformers' lazy module raised "cannot import name 'GPT2Config'" in the replay); return the
    module whose import drew from Python's or NumPy's global random state after the working
    kernel's had changed, seeded perhaps ('' where none did): TensorFlow's import draws from both,
    Lightning's from Python's. Such a standby cannot take over exactly, and the driver restarts
    cold instead."""
    global _queue
    _stop.set()
    if _queue is not None:
        _queue.put(None)
        _queue = None
    if _worker is not None and _worker is not threading.current_thread():
        _worker.join()
    return _drew_on or ""


def adopt(nice: int | None = None) -> None:
    """(In the standby that replaces a dead kernel.) Be an ordinary kernel again: the OOM score
    it had, the priority ``nice`` where allowed, the scheduling group's nice value 0 (what the
    session of a freshly started kernel gets, whatever the driver's group has), and no more
    imports (the one under way is waited for: the replay may need it, and must not import beside it)."""
    global _adopted
    _adopted = True
    stop_importing()
    os.environ.pop(ENV, None)
    if _saved_adj is not None:
        priority.set_oom_score_adj(_saved_adj)
    if _start_env is not None:
        # the environment a kernel started afresh has: the replay sets what the set-up cells set,
        # as in a cold restart (what was imported ahead was imported under the working kernel's)
        _set_environ(_start_env)
    if nice is not None:  # allowed for root (CAP_SYS_NICE) or within RLIMIT_NICE
        priority.renice_all(nice)
    if priority.autogroup_nice() not in (None, 0):
        priority.set_autogroup_nice(0)


def is_standby(pid: int) -> bool:
    """Whether process ``pid`` was started as a standby (it may have taken over since)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{ENV}=1".encode() in f.read().split(b"\0")
    except OSError:
        return False


def standby_bytes() -> int:
    """(In a working kernel.) The resident memory of the standby kernels beside this one (started
    by the same driver)."""
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    me, parent = os.getpid(), os.getppid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != parent or not is_standby(int(entry)):
                continue
            with open(f"/proc/{entry}/statm", "rb") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total
