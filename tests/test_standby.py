"""The supervisor's standby kernel: warmed with the working kernel's imports, low priority, the OOM
killer's first choice, and in its place when it dies; a dead standby means a cold restart.

The training runs are tests/files/train.ipynb with probe cells inserted, compared with the
`reference` fixture (its uninterrupted run)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import nbformat
import pytest

from colab_resilience import priority, standby
from harness import KERNEL_NAME, cell_text, child_env, events, index, insert, load, notebook, run

# In a kernel: the standby kernels started by the same driver (told by their environment), from /proc.
SIBLINGS = textwrap.dedent("""\
    import os, time
    def siblings():  # the driver's standby kernels: its children started as standbys
        found = []
        for entry in os.listdir('/proc'):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f'/proc/{entry}/stat') as f:
                    fields = f.read().rsplit(')', 1)[1].split()
                with open(f'/proc/{entry}/environ', 'rb') as f:
                    env = f.read().split(b'\\0')
            except OSError:
                continue
            if int(fields[1]) == os.getppid() and fields[0] != 'Z' and b'COLAB_RESILIENCE_STANDBY=1' in env:
                found.append(int(entry))
        return found
    def torch_loaded(pid):
        try:
            with open(f'/proc/{pid}/maps') as f:
                return 'libtorch_cpu' in f.read()
        except OSError:
            return False
    def nice_and_adj(pid):  # nice, oom_score_adj, the nice of its scheduling group ('-': none)
        with open(f'/proc/{pid}/stat') as f:
            nice = int(f.read().rsplit(')', 1)[1].split()[16])
        with open(f'/proc/{pid}/oom_score_adj') as f:
            adj = int(f.read())
        try:
            with open(f'/proc/{pid}/autogroup') as f:
                group = f.read().split()[-1]
        except OSError:
            group = '-'
        return nice, adj, group
""")

WAIT_WARM = (  # until the standby has torch loaded (the driver sent it the working kernel's imports)
    "deadline = time.monotonic() + 90\n"
    "while time.monotonic() < deadline and not (siblings() and torch_loaded(siblings()[0])):\n"
    "    time.sleep(0.1)\n"
    "spare = siblings()[0]\n"
    "print('STANDBY', spare, torch_loaded(spare), *nice_and_adj(spare))"
)


def python(code: str, **kwargs) -> subprocess.CompletedProcess:
    """``code`` run by this interpreter in a process of its own, which must succeed."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, **kwargs)
    assert out.returncode == 0, out.stderr
    return out


def importable(folder, **modules: str) -> str:
    """Each of ``modules`` (name: source) written into ``folder``; the lines that make them
    importable in such a process, with this package's standby module imported."""
    for name, source in modules.items():
        (folder / f"{name}.py").write_text(source)
    return f"import sys, time\nsys.path.insert(0, {str(folder)!r})\nfrom colab_resilience import standby\n"


def line(nb, prefix: str) -> str:
    """The first output line of an executed notebook that starts with ``prefix``."""
    return next(l for c in nb.cells for l in cell_text(c).splitlines() if l.startswith(prefix))


def resumed(how: str, cells: int, iteration: int) -> str:
    """The supervisor's line in a cell after a restart: what it did (``how``: "switched to the
    standby kernel" or "restarted it"), the cells replayed, the iteration it resumed at. One
    wording for the tests here and the GPU ones (tests/test_cuda.py), which CI cannot run."""
    return f"{how}, replayed {cells} cells and resumed at iteration {iteration} in"


@pytest.mark.kernel
def test_the_warm_standby_takes_over_and_the_run_resumes_exactly(tmp_path, reference):
    """Before any death the standby has the working kernel's imports (torch), the lowest CPU
    priority it can get back from and oom_score_adj 1000; after a SIGKILL mid-epoch it becomes the
    working kernel at normal priority, its replay finds torch imported, and the run ends
    bit-identical."""
    nb = load("train.ipynb", tmp_path, fault="sigkill", fault_epoch=2, staging="off")  # resumed at 2, below
    after = ("print('AFTER', os.getpid(), *nice_and_adj(os.getpid()), "
             "sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')}))")
    insert(nb, "train", SIBLINGS + WAIT_WARM, "standby-probe")
    insert(nb, "result", SIBLINGS + after, "after-probe")
    own_group = priority.autogroup_nice()
    result = run(nb, tmp_path)
    assert result.status == 0, result.message
    assert line(nb, "RESULT") == reference.result
    assert priority.autogroup_nice() == own_group  # the driver's own scheduling group untouched

    _, spare, warm, nice, adj, group = line(nb, "STANDBY").split()
    assert warm == "True"  # torch was imported there before any death
    assert adj == "1000"  # the OOM killer's first choice
    assert int(nice) == (19 if priority.may_raise_priority() else 0)  # low priority, where it can be undone
    if priority.may_raise_priority() and priority.autogroup_nice() is not None:
        assert group == "19"  # its session's scheduling group too (autogroups share CPUs first)
    _, pid, nice_after, adj_after, group_after, threads = line(nb, "AFTER").split(maxsplit=5)
    assert pid == spare  # the standby became the working kernel
    assert adj_after == "0" and nice_after == "0" and group_after in ("0", "-")
    if priority.may_raise_priority():
        assert threads == "[0]"
    # the replay in the standby found torch already imported; the first kernel did not
    first, second = [(e.pid, e.arg) for e in events(tmp_path / "events.log") if e.name == "setup-start"]
    assert first[1] == "torch-imported=False" and second == (int(spare), "torch-imported=True")

    [restart] = result.restarts
    assert restart.standby and restart.exit_code == -9
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert "the kernel died (killed by SIGKILL); " + resumed("switched to the standby kernel", cells=3, iteration=2) \
        in cell_text(out.cells[index(out, "train")])
    assert out.metadata["colab_resilience"]["restarts"][0]["kernel"] == "standby"


@pytest.mark.kernel
@pytest.mark.skipif(priority.autogroup_nice() is None, reason="needs Linux scheduling autogroups")
def test_a_driver_in_a_niced_session_leaves_its_group_alone_and_the_new_kernel_at_0(tmp_path):
    """CI runs the suite from a session whose scheduling group may be niced (as `nice` does for a
    process): the standby that takes over must get a fresh kernel's group nice 0, not the driver's,
    and the driver's own group must not be touched."""
    mark = tmp_path / "mark"
    nb = notebook(
        SIBLINGS + "deadline = time.monotonic() + 60\n"
        "while not siblings() and time.monotonic() < deadline:\n    time.sleep(0.1)\n"
        "print('STANDBY', siblings()[0])",
        f"import os, signal\nif not os.path.exists({str(mark)!r}):\n"
        f"    open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)",
        SIBLINGS + "print('AFTER', os.getpid(), *nice_and_adj(os.getpid()))",
    )
    nbformat.write(nb, tmp_path / "in.ipynb")
    code = textwrap.dedent(f"""
        import nbformat
        from colab_resilience import driver, priority
        if not priority.set_autogroup_nice(19):
            raise SystemExit('SKIP cannot nice its own group')
        nb = nbformat.read({str(tmp_path / "in.ipynb")!r}, 4)
        result = driver.run_notebook(nb, {str(tmp_path / "out.ipynb")!r}, cwd={str(tmp_path)!r},
                                     run_dir={str(tmp_path / "runs")!r}, kernel_name={KERNEL_NAME!r})
        print('RESULT', result.status, [r.standby for r in result.restarts], priority.autogroup_nice())
    """)
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), start_new_session=True,
                         capture_output=True, text=True, timeout=180)
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-4:] == ["RESULT", "0", "[True]", "19"], out.stdout  # its own group kept
    executed = nbformat.read(tmp_path / "out.ipynb", 4)
    _, pid, nice, adj, group = line(executed, "AFTER").split()
    assert pid == line(executed, "STANDBY").split()[1]  # the standby took over
    assert (adj, group) == ("0", "0")  # ... as an ordinary kernel in a group of its own at nice 0


@pytest.mark.kernel
def test_the_standby_imports_under_the_environment_the_working_kernel_imported_under(tmp_path):
    """A library may read a variable once, when it is imported (torch reads PYTORCH_JIT; Keras
    KERAS_BACKEND, JAX JAX_ENABLE_X64), and a set-up cell sets it just before the import. The
    standby imported torch ahead with the environment it was started with: after taking over,
    TorchScript was on, and the replay's setting came too late (a silent difference from the
    run before the kill). It imports each module under the environment the working kernel had
    then; once it takes over, its environment is a fresh kernel's, which the replay sets as in a
    cold restart: a variable a plain cell set before the kill is gone, as after a cold restart.
    A second kill, with the next standby dead, restarts the kernel that took over cold: it is
    started with a working kernel's environment, not with the standby's it was first started with."""
    mark, again = tmp_path / "killed", tmp_path / "killed-again"
    probe = "print({label!r}, torch.jit._state._enabled.enabled, os.environ.get('PYTORCH_JIT'), " \
            "os.environ.get('SET_IN_A_PLAIN_CELL'), os.environ.get('COLAB_RESILIENCE_STANDBY'), " \
            "standby.is_standby(os.getpid()))"
    nb = notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport os\nos.environ['PYTORCH_JIT'] = '0'\nimport torch\nfrom colab_resilience import standby",
        "os.environ['SET_IN_A_PLAIN_CELL'] = '1'\n" + SIBLINGS + WAIT_WARM + "\n" + probe.format(label="BEFORE"),
        f"%%resilient --save total\nimport signal\n{SIBLINGS}total = 0\nfor i in resume_range(4):\n    total += 1\n"
        f"    if i == 1 and not os.path.exists({str(mark)!r}):\n"
        f"        open({str(mark)!r}, 'w').close()\n        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"    if i == 2 and not os.path.exists({str(again)!r}):  # in the kernel that took over\n"
        f"        open({str(again)!r}, 'w').close()\n"
        "        deadline = time.monotonic() + 90\n"
        "        while time.monotonic() < deadline and not (siblings() and torch_loaded(siblings()[0])):\n"
        "            time.sleep(0.1)\n"
        "        os.kill(siblings()[0], signal.SIGKILL)  # the next standby first, as the OOM killer would\n"
        "        time.sleep(0.5)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)",
        probe.format(label="AFTER"),
    )
    result = run(nb, tmp_path, standbys=None)  # a standby after each takeover, as by default
    assert result.status == 0, result.message
    assert [r.standby for r in result.restarts] == [True, False]
    assert line(nb, "STANDBY").split()[2] == "True"  # torch was imported ahead, before the kill
    assert line(nb, "BEFORE") == "BEFORE False 0 1 None False"
    assert line(nb, "AFTER") == "AFTER False 0 None None False", line(nb, "AFTER")


@pytest.mark.kernel
def test_a_dead_standby_means_a_cold_restart_and_the_same_result(tmp_path, reference):
    """The OOM killer takes the standby first (oom_score_adj 1000); the driver finds it dead when it
    needs it, restarts a kernel instead, and starts a new standby."""
    nb = load("train.ipynb", tmp_path, fault="sigkill", fault_epoch=2)
    # the standby killed once it is warm, in a plain cell before the training (not by a new FAULTS
    # entry: FAULTS is read by the training, and a function changed in a plain cell stops the resume)
    insert(nb, "train", SIBLINGS + WAIT_WARM + "\nos.kill(spare, signal.SIGKILL)", "standby-probe")
    insert(nb, "result", SIBLINGS + WAIT_WARM.replace("STANDBY", "NEXT"), "next-probe")
    result = run(nb, tmp_path, standbys=None)  # a standby after each takeover, as by default
    assert result.status == 0, result.message
    assert line(nb, "RESULT") == reference.result
    [restart] = result.restarts
    assert not restart.standby
    assert "the kernel died (killed by SIGKILL); restarted it, replayed 3 cells" \
        in cell_text(nb.cells[index(nb, "train")])
    pids = [e.pid for e in events(tmp_path / "events.log") if e.name == "setup-start"]
    assert len(pids) == 2 and pids[1] != int(line(nb, "STANDBY").split()[1])  # a new kernel, not the killed standby
    assert line(nb, "NEXT").split()[2] == "True"  # and a new standby is warm again


@pytest.mark.kernel
def test_a_run_given_one_standby_starts_no_other_after_it_took_over(tmp_path, reference):
    """standbys=1 (what `colab-resilience check` gives a run with its one fault): the standby takes
    over after the SIGKILL, the run ends bit-identical, and no new standby is started beside the
    kernel it became (by default one is, at once: the test above)."""
    nb = load("train.ipynb", tmp_path, fault="sigkill", fault_epoch=2)
    insert(nb, "train", SIBLINGS + WAIT_WARM, "standby-probe")
    insert(nb, "result", SIBLINGS + "print('SIBLINGS', siblings())", "after-probe")
    result = run(nb, tmp_path, standbys=1)
    assert result.status == 0, result.message
    assert line(nb, "RESULT") == reference.result
    [restart] = result.restarts
    assert restart.standby
    assert line(nb, "SIBLINGS") == "SIBLINGS []"


@pytest.mark.kernel
def test_no_standby_means_no_second_kernel(tmp_path):
    """standby=False: the driver starts no kernel besides the working one."""
    nb = notebook("import time\ntime.sleep(2)", SIBLINGS + "print('SIBLINGS', siblings())")
    assert run(nb, tmp_path, standby=False).status == 0
    assert line(nb, "SIBLINGS") == "SIBLINGS []"


def test_only_installed_modules_are_offered_to_the_standby(tmp_path, monkeypatch):
    """new_modules: the interpreter's own modules (stdlib, site-packages), in import order, each once;
    never the notebook's own files, never a module that makes a CUDA context on import."""
    (tmp_path / "my_notebook_helpers.py").write_text("VALUE = 1\n")
    (tmp_path / "fakecuda").mkdir()
    (tmp_path / "fakecuda" / "__init__.py").write_text("")
    (tmp_path / "fakecuda" / "autoinit.py").write_text("")
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from colab_resilience import standby
        [(env, first, untouched)] = standby.new_modules()
        assert untouched is False  # not watched: never said to be
        assert env is None  # the environment is not watched here
        assert 'json' in first and 'colab_resilience' not in first, first
        assert standby.new_modules() == []
        import my_notebook_helpers, fakecuda.autoinit
        fresh = [m for m in ('colorsys', 'wave', 'fractions') if m not in sys.modules]
        for m in fresh:
            __import__(m)
        [(env, got, _)] = standby.new_modules()
        assert env is None
        assert [m for m in got if m in fresh] == fresh, got
        assert 'my_notebook_helpers' not in got and 'fakecuda.autoinit' not in got, got
        print('OK', len(first))
    """)
    out = python(code)
    assert out.stdout.startswith("OK")


def test_modules_are_offered_with_the_environment_they_were_imported_under():
    """With the environment watched (a supervised kernel), each group of modules comes with the
    environment it was imported under, where that changed since the last one offered; a standby
    imports each group under its environment, and once adopted has its own start environment back."""
    code = textwrap.dedent("""
        import os, sys, time
        from colab_resilience import standby
        standby.watch_environment()
        start = dict(os.environ)
        [(env, _, _)] = standby.new_modules()
        assert env == start, 'the first group comes with the environment'
        os.environ['IMPORTED_UNDER'] = 'one'
        import colorsys
        os.environ['IMPORTED_UNDER'] = 'two'
        import wave
        import fractions
        del os.environ['IMPORTED_UNDER']
        groups = standby.new_modules()
        names = [(env and env.get('IMPORTED_UNDER'), [n for n in ns if n in ('colorsys', 'wave', 'fractions')])
                 for env, ns, _ in groups]
        assert [g for g in names if g[1]] == [('one', ['colorsys']), ('two', ['wave', 'fractions'])], names
        assert standby.new_modules() == []
        # the other side: a standby importing those groups
        for name in ('colorsys', 'wave', 'fractions'):
            del sys.modules[name]
        seen = {}
        class Spy:
            def find_spec(self, name, path=None, target=None):
                seen.setdefault(name, os.environ.get('IMPORTED_UNDER'))
        sys.meta_path.insert(0, Spy())
        os.environ['COLAB_RESILIENCE_STANDBY'] = '1'
        standby.become()
        standby.preload(groups)
        deadline = time.monotonic() + 30
        while 'fractions' not in sys.modules and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {n: seen.get(n) for n in ('colorsys', 'wave', 'fractions')} == \
            {'colorsys': 'one', 'wave': 'two', 'fractions': 'two'}, seen
        standby.adopt()
        assert 'IMPORTED_UNDER' not in os.environ and 'COLAB_RESILIENCE_STANDBY' not in os.environ
        assert dict(os.environ) == {k: v for k, v in start.items() if k != 'COLAB_RESILIENCE_STANDBY'}
        print('OK')
    """)
    out = python(code)
    assert out.stdout.strip() == "OK"


@pytest.mark.parametrize("groups, drew, imported", [
    ("['quiet_module', 'drawing_module', 'colorsys']", "drawing_module", "quiet_module drawing_module"),
    ("[(None, ['quiet_module', 'drawing_module'], False), (None, ['colorsys'], True)]", "drawing_module",
     "quiet_module drawing_module"),
    ("[(None, ['quiet_module', 'drawing_module', 'colorsys'], True)]", "", "quiet_module drawing_module colorsys"),
    ("[(None, ['bringing_module'], True), (None, ['wave'], False)]", "bringing_module", "bringing_module"),
    ("[(None, ['bringing_module', 'wave'], True)]", "", "bringing_module"),
], ids=["names", "imported-after-a-change", "imported-before-any-change", "brings-one-imported-after",
        "brings-one-imported-before"])
def test_a_standby_whose_import_draws_from_a_global_random_state_says_so_when_stopped(tmp_path, groups, drew,
                                                                                      imported):
    """A module whose import draws from Python's or NumPy's global random state (TensorFlow,
    Lightning) cannot be imported ahead where the working kernel imported it after its states had
    changed (the notebook may have seeded them): a replay would draw other numbers after the
    takeover. The standby stops importing there, and names it when the driver stops its imports
    before a takeover. Where the working kernel imported it before any change, it drew from states
    nothing had seeded, and the standby goes on, unless the import brought along a module that the
    working kernel imported after a change (wave here). A standby that imported only modules that
    draw nothing names none."""
    code = importable(tmp_path, quiet_module="VALUE = 1\n", drawing_module="import random\nSALT = random.random()\n",
                      bringing_module="import random, wave\nSALT = random.random()\n") + textwrap.dedent(f"""
        standby.become()
        groups = {groups}
        last = groups[-1] if isinstance(groups[-1], str) else groups[-1][1][-1]
        standby.preload(groups)
        deadline = time.monotonic() + 30
        while not (last in sys.modules or standby._drew_on) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(repr(standby.stop_importing()), *standby._imported, sep='\\n')
    """)
    out = python(code)
    assert out.stdout.splitlines() == [repr(drew), *imported.split()], out.stdout


def test_modules_imported_before_the_random_states_changed_are_offered_as_untouched(tmp_path):
    """A working kernel offers each module with whether the global random states were still the
    ones it started with where the import began: NumPy's as its random module was made; an
    installed module's import that draws does not count against the modules it imports itself (a
    standby imports it whole), but against every later one; what a notebook's own module seeded
    before it imports an installed one counts (a standby does not import the notebook's module);
    a seed counts as a change."""
    header = importable(tmp_path, drawing_module="import random\nSALT = random.random()\nimport inner_module\n",
                        inner_module="VALUE = 1\n", later_module="VALUE = 2\n")
    code = header + textwrap.dedent("""
        standby.watch_environment()
        standby.new_modules()
        import colorsys
        import numpy.random
        import wave
        numpy.random.seed(0)
        import fractions
        flags = {n: u for env, names, u in standby.new_modules() for n in names}
        print({n: flags.get(n) for n in ('colorsys', 'numpy.random', 'wave', 'fractions')})
        watched = standby._watcher
        print(watched.untouched('wave', sys.modules['wave']), watched.untouched('fractions', sys.modules['fractions']))
    """)
    out = python(code)
    assert out.stdout.splitlines() == [
        "{'colorsys': True, 'numpy.random': True, 'wave': True, 'fractions': False}", "True False"], out.stdout
    (tmp_path / "own").mkdir()  # a notebook's own module: seeds, then imports an installed one
    (tmp_path / "own" / "seeding_helper.py").write_text("import random\nrandom.seed(0)\nimport colorsys\n")
    code = header + textwrap.dedent(f"""
        import random
        installed = standby.installed_roots()
        standby.installed_roots = lambda: (*installed, {str(tmp_path) + "/"!r})  # its modules as if installed
        standby.watch_environment()
        import drawing_module
        import later_module
        print(*[standby._watcher.untouched(n, sys.modules[n]) for n in ('drawing_module', 'inner_module', 'later_module')])
        # a notebook's own module that seeds, then imports: the seed counts
        standby.installed_roots = lambda: installed
        standby._watcher = None
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_EnvironmentAtImport']
        standby.watch_environment()
        sys.path.insert(0, {str(tmp_path / "own")!r})
        import seeding_helper
        print(standby._watcher.untouched('colorsys', sys.modules['colorsys']))
        # a seed where nothing drew yet
        standby._watcher = None
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_EnvironmentAtImport']
        standby.watch_environment()
        random.seed(1)  # (the state is seed 0's: the helper above seeded it so)
        import importlib
        fresh = next(m for m in ('wave', 'fractions', 'tabnanny', 'colorsys') if m not in sys.modules)
        print(standby._watcher.untouched(fresh, importlib.import_module(fresh)))
    """)
    out = python(code)
    assert out.stdout.splitlines() == ["True True False", "False", "False"], out.stdout


def test_a_standby_imports_in_the_background_and_stops_when_adopted():
    """A standby (oom_score_adj 1000) imports what it is offered in a background thread, skipping
    what does not exist; once adopted it is an ordinary process and imports nothing ahead."""
    code = textwrap.dedent("""
        import sys, time, os
        from colab_resilience import standby
        standby.become()
        assert open('/proc/self/oom_score_adj').read().strip() == '1000'
        standby.preload(['colorsys', 'no_such_module_anywhere', 'wave'])
        deadline = time.monotonic() + 30
        while 'wave' not in sys.modules and time.monotonic() < deadline:
            time.sleep(0.01)
        assert standby._imported == ['colorsys', 'wave'], standby._imported
        assert standby.stop_importing() == ''  # neither drew from a global random state
        standby.adopt(nice=0)
        assert open('/proc/self/oom_score_adj').read().strip() == '0'
        standby.preload(['fractions'])  # after adoption: nothing more is imported ahead of need
        time.sleep(0.3)
        assert 'fractions' not in sys.modules
        print('OK')
    """)
    assert python(code).stdout.strip() == "OK"
    assert priority.OOM_SCORE_ADJ == 1000


def test_the_standbys_memory_is_not_counted_as_in_use(tmp_path):
    """standby_bytes: the resident memory of the driver's standby kernels (children of the same
    parent, started with COLAB_RESILIENCE_STANDBY=1), which %restart_after --memory leaves out."""
    hold = ("import sys, time, numpy as np\n"
            "a = np.ones(int(sys.argv[1]) << 20, dtype=np.uint8)\n"
            "print('ready', flush=True)\ntime.sleep(60)")
    env = {k: v for k, v in os.environ.items() if k != standby.ENV}
    spare = subprocess.Popen([sys.executable, "-c", hold, "96"], env={**env, standby.ENV: "1"},
                             stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", hold, "192"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert spare.stdout.readline().strip() == "ready" and other.stdout.readline().strip() == "ready"
        code = textwrap.dedent("""
            import os
            from colab_resilience import memory, standby
            print(standby.standby_bytes())
            total = os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
            share = 100.0 * (48 << 20) / total  # half the standby's 96 MiB, in percent
            def reading(supervised):
                return memory.memory_in_use_percent(discount_standby=supervised)[0]
            # other processes move memory too: one of five paired readings must show the gap
            print(any(reading(True) < min(reading(False), reading(False)) - share for _ in range(5)))
        """)
        out = python(code, env=env)
        counted, lower = out.stdout.split()
        assert 96 << 20 <= int(counted) < 192 << 20  # the standby's 96 MiB, not the other child's
        assert lower == "True"
    finally:
        for p in (spare, other):
            p.kill()
            p.wait()
