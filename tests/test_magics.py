"""Argument parsing, messages, configuration and loading, in an in-process IPython shell."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from traitlets.config import Config

import colab_resilience
from colab_resilience.magics import ResilienceMagics


def usage_error(ip, cell: str) -> str:
    """Run ``cell`` and return the one-line UsageError it must raise."""
    with pytest.raises(UsageError) as info:
        header, _, body = cell.partition("\n")
        name, _, line = header[2:].partition(" ")
        ip.run_cell_magic(name, line, body)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "cell,expected",
    [
        ("%%resilient --bogus\nx = 1", "%%resilient: unknown option --bogus; the options are --save NAMES, --retries N, --shrink NAME[=FACTOR], --max-restarts N and --every N|5min"),
        ("%%resilient --retries many\nx = 1", "--retries: needs a whole number, like --retries 2 (got 'many')"),
        ("%%resilient --retries -1\nx = 1", "--retries: cannot be negative (got -1); use --retries 0"),
        ("%%resilient --retries 1.5\nx = 1", "needs a whole number, like --retries 2 (got '1.5')"),
        ("%%resilient --retries\nx = 1", "--retries: expected one argument"),
        ("%%resilient --every -5min\nx = 1", "%%resilient: --every -5min: the value cannot begin with '-'"),
        ("%%resilient --shrink nope\nx = 1", "--shrink nope: no variable 'nope' exists; set it in an earlier cell, e.g. nope = 256"),
        ("%%resilient --shrink batch_sise\nx = 1", "(did you mean 'batch_size'?)"),
        ("%%resilient --shrink lr\nx = 1", "--shrink lr: lr is a float (0.001), but --shrink needs an integer such as a batch size"),
        ("%%resilient --shrink flag\nx = 1", "flag is a bool (True), but --shrink needs an integer"),
        ("%%resilient --shrink batch_size=2\nx = 1", "the factor must be a number between 0 and 1 (got '2'), e.g. --shrink batch_size=0.5"),
        ("%%resilient --shrink batch_size=half\nx = 1", "(got 'half')"),
        ("%%resilient --shrink cfg.batch\nx = 1", "--shrink cfg.batch: no variable 'cfg' exists; make it in a %%replay cell"),
        ("%%resilient --shrink lr.real.size\nx = 1", "--shrink lr.real.size: lr (float) has no attribute path 'real.size'; "
         "name the attribute that holds the batch size"),
        ("%%resilient --shrink lr.real\nx = 1", "--shrink lr.real: lr.real is a float (0.001), but --shrink needs an integer"),
        ("%%resilient --shrink 3d\nx = 1", "'3d' is not a variable name or an attribute path; write --shrink NAME or --shrink NAME=FACTOR"),
        ("%%resilient --shrink batch_size\nbatch_size = 64\nx = 1", "the cell assigns batch_size, so every retry would undo the shrink"),
        ("%%resilient\n   \n", "%%resilient: the cell has no code under the %%resilient line"),
        ("%%replay --x\ny = 1", "%%replay: unknown option --x; %%replay takes no options (see %%replay? for help)"),
        ("%%replay\n\n", "%%replay: the cell has no code under the %%replay line"),
    ],
)
def test_bad_input_is_one_clear_line_and_runs_nothing(ip, cell, expected):
    """A bad %%resilient or %%replay cell is one UsageError line that says what to write; the body
    does not run and no variable changes."""
    ip.user_ns.update(batch_size=64, lr=0.001, flag=True, ran=[])
    message = usage_error(ip, cell.replace("x = 1", "ran.append(1)"))
    assert expected in message
    assert ip.user_ns["ran"] == []
    assert ip.user_ns["batch_size"] == 64


def test_a_cell_refused_for_its_options_leaves_no_run(ip, tmp_path, monkeypatch):
    """A %%resilient cell refused for a name its options give (a --save name nothing makes, a
    typo) ran nothing: it leaves no run behind (it was a 'failed' run in %resilience status, and
    its folder stayed); the cell put right then runs as a new run."""
    monkeypatch.setenv("COLAB_RESILIENCE_RUN_DIR", str(tmp_path / "runs"))
    ip.user_ns.update(history=[])
    cell = "%%resilient --save {}\nfor epoch in resume_range(2):\n    history.append(epoch)"
    assert "(did you mean 'history'?)" in usage_error(ip, cell.format("histroy"))
    assert ip.user_ns["history"] == [] and not list((tmp_path / "runs").glob("run-*"))
    assert ip.run_cell(cell.format("history")).success
    assert ip.user_ns["history"] == [0, 1]
    assert len(list((tmp_path / "runs").glob("run-*"))) == 1


def test_a_syntax_error_in_the_cell_touches_no_run_and_names_its_line(ip, tmp_path, monkeypatch):
    """A %%resilient cell that does not parse is the SyntaxError of its line in the notebook, as
    without the magic, before any run is opened (it left a 'failed' run; after a death, it took
    the pending run over first). Top-level await, which a cell has and a cell magic's body has
    not, says so in the error."""
    monkeypatch.setenv("COLAB_RESILIENCE_RUN_DIR", str(tmp_path / "runs"))
    ip.user_ns.update(history=[])
    r = ip.run_cell("%%resilient --save history\nfor epoch in resume_range(2):\n    history.append(epoch\n")
    assert isinstance(r.error_before_exec, SyntaxError) and r.error_before_exec.lineno == 3, r.error_before_exec
    assert ip.user_ns["history"] == [] and not (tmp_path / "runs").exists()
    r = ip.run_cell("%%resilient --save history\nfor epoch in resume_range(2):\n    history.append(await f(epoch))\n")
    assert isinstance(r.error_before_exec, SyntaxError) and r.error_before_exec.lineno == 3, r.error_before_exec
    assert "(the code under a %%resilient line runs as plain Python, without top-level await)" in str(r.error_before_exec)
    assert not (tmp_path / "runs").exists()


def test_empty_cell_body_is_a_usage_error(ip):
    """%%resilient with nothing under it is a UsageError."""
    result = ip.run_cell("%%resilient\n")
    assert isinstance(result.error_in_exec, UsageError)


def test_successful_cell_runs_once_and_displays_last_expression(ip, capsys):
    """A cell that succeeds runs once, its last expression is its result as without the magic, no
    OOM message; a name the cell reads that a restart would lose is named."""
    ip.user_ns.update(batch_size=8, calls=[])
    result = ip.run_cell("%%resilient --shrink batch_size\ncalls.append(batch_size)\nbatch_size * 3")
    assert result.success
    assert result.result == 24
    assert ip.user_ns["calls"] == [8]
    out = capsys.readouterr().out
    assert "OOM" not in out and "retry" not in out
    # the lint: `calls` would not exist after a restart (batch_size is kept by --shrink)
    assert "colab_resilience: this cell reads calls, which neither --save nor a %%replay cell" in out


def test_a_name_a_restart_would_lose_is_said_to_be_imported_where_it_is_code(ip, capsys):
    """What a plain cell imported or defined (a module, a class, a function: an import in the
    notebook's first cell) goes in a %%replay cell, not in --save, which refuses a class; a value
    may go in either."""
    import collections
    import json as json_module

    ip.user_ns.update(json_module=json_module, Counter=collections.Counter, lr=0.1)
    ip.user_ns["scale"] = lambda x: x * 2
    assert ip.run_cell("%%resilient\nout = json_module.dumps([Counter('ab'), scale(lr)])").success
    out = capsys.readouterr().out
    assert ("colab_resilience: this cell reads json_module, Counter, scale, lr, which neither --save nor a %%replay "
            "cell would bring back after a restart; import or define json_module, Counter, scale in a %%replay cell "
            "(--save holds values, not code); add lr to --save or define it in a %%replay cell") in out, out


def test_shrink_list_and_repeat_forms(ip):
    """--shrink a=0.25,b: each variable shrinks by its own factor (default a half) at every retry."""
    ip.user_ns.update(a=16, b=10, n=[0])
    body = (
        "n[0] += 1\n"
        "if n[0] < 3:\n"
        "    raise MemoryError()\n"
    )
    result = ip.run_cell(f"%%resilient --retries 2 --shrink a=0.25,b --shrink n2\n{body}".replace(" --shrink n2", ""))
    assert result.success
    assert (ip.user_ns["a"], ip.user_ns["b"]) == (1, 2)  # 16 → 4 → 1; 10 → 5 → 2


def test_shrink_never_below_one_and_message_per_attempt(ip, capsys):
    """A shrunk variable stops at 1; every retry prints one line saying what was freed and shrunk."""
    ip.user_ns.update(bs=2, n=[0])
    result = ip.run_cell("%%resilient --retries 3 --shrink bs\nn[0] += 1\nif n[0] <= 3:\n    raise MemoryError()")
    assert result.success
    lines = [l for l in capsys.readouterr().out.splitlines() if "— freed" in l]
    assert len(lines) == 3
    assert "OOM (MemoryError) — freed" in lines[0]
    assert "bs 2 → 1; retry 1/3" in lines[0]
    assert "bs already 1; retry 2/3" in lines[1]
    assert lines[2].endswith("retry 3/3")
    assert ip.user_ns["bs"] == 1


def test_retries_spent_reraises_last_oom_with_summary(ip, capsys):
    """Past its retries the cell raises the last attempt's OOM, after one line summing up the
    attempts and the shrinking."""
    ip.user_ns.update(bs=8, n=[0])
    result = ip.run_cell("%%resilient --retries 1 --shrink bs\nn[0] += 1\nraise MemoryError(f'attempt {n[0]}')")
    assert isinstance(result.error_in_exec, MemoryError)
    assert str(result.error_in_exec) == "attempt 2"
    out = capsys.readouterr().out
    assert "colab_resilience: still out of memory after 2 attempts (bs 8 → 4)" in out
    assert ip.user_ns["n"] == [2]


def test_retries_zero_means_one_attempt(ip, capsys):
    """--retries 0: one attempt, the OOM raised at once."""
    ip.user_ns.update(n=[0])
    result = ip.run_cell("%%resilient --retries 0\nn[0] += 1\nraise MemoryError()")
    assert isinstance(result.error_in_exec, MemoryError)
    assert ip.user_ns["n"] == [1]
    assert "after 1 attempt;" in capsys.readouterr().out


def test_poisoned_cuda_error_is_not_retried(ip, capsys):
    """A device-side assert poisons the CUDA context: never retried, and said why."""
    ip.user_ns.update(n=[0])
    result = ip.run_cell(
        "%%resilient --retries 3\nn[0] += 1\nraise RuntimeError('CUDA error: device-side assert triggered')"
    )
    assert isinstance(result.error_in_exec, RuntimeError)
    assert ip.user_ns["n"] == [1]
    assert "CUDA device-side assert triggered: the CUDA context cannot recover" in capsys.readouterr().out


def test_non_oom_error_is_untouched(ip, capsys):
    """An ordinary exception goes through untouched: one attempt, no message."""
    ip.user_ns.update(n=[0])
    result = ip.run_cell("%%resilient --save n\nn[0] += 1\nraise KeyError('missing')")
    assert isinstance(result.error_in_exec, KeyError)
    assert ip.user_ns["n"] == [1]
    assert "colab_resilience" not in capsys.readouterr().out


def test_syntax_error_reports_the_notebook_line(ip):
    """A syntax error in the body points at its line in the cell, magic line included."""
    result = ip.run_cell("%%resilient\nx = 1\ny = = 2")
    assert isinstance(result.error_before_exec, SyntaxError)
    assert result.error_before_exec.lineno == 3


def test_config_magic_sets_default_retries(ip):
    """`%config ResilienceMagics.retries = 0` changes the default of later cells."""
    ip.run_line_magic("config", "ResilienceMagics.retries = 0")
    assert ip.magics_manager.registry["ResilienceMagics"].retries == 0
    ip.user_ns["n"] = [0]
    ip.run_cell("%%resilient\nn[0] += 1\nraise MemoryError()")
    assert ip.user_ns["n"] == [1]


def test_config_file_values_are_read():
    """ResilienceMagics reads its defaults from an IPython configuration."""
    cfg = Config()
    cfg.ResilienceMagics.retries = 5
    cfg.ResilienceMagics.verbose = False
    magics = ResilienceMagics(shell=None, config=cfg)
    assert (magics.retries, magics.verbose) == (5, False)


def test_load_twice_is_harmless_and_unload_removes_everything(ip):
    """Loading the extension twice registers nothing twice; unloading removes its magics, hooks and
    configurable, and it loads again."""
    before = len(ip.events.callbacks["post_run_cell"])
    colab_resilience.load_ipython_extension(ip)
    assert len(ip.events.callbacks["post_run_cell"]) == before
    ip.run_line_magic("unload_ext", "colab_resilience")
    assert len(ip.events.callbacks["post_run_cell"]) == before - 1
    assert "resilient" not in ip.magics_manager.magics["cell"]
    assert "replay" not in ip.magics_manager.magics["cell"]
    assert not any(type(c).__name__ == "ResilienceMagics" for c in ip.configurables)
    ip.run_line_magic("load_ext", "colab_resilience")
    assert "resilient" in ip.magics_manager.magics["cell"]


def test_replay_records_in_order_and_replaces_rerun_cells(ip):
    """%%replay cells are recorded in the order they first ran; running one again replaces its
    record in place."""
    ip.run_cell("%%replay\nsetup_a = 1")
    ip.run_cell("%%replay\nsetup_b = 2")
    ip.run_cell("%%replay\nsetup_a = 1")  # the same cell again (no id: same source)
    assert [c.rstrip() for c in colab_resilience.replay_cells(ip)] == ["%%replay\nsetup_a = 1", "%%replay\nsetup_b = 2"]
    assert (ip.user_ns["setup_a"], ip.user_ns["setup_b"]) == (1, 2)


def test_failing_replay_cell_is_not_recorded(ip):
    """A %%replay cell that raises is not recorded: it would fail again at every replay."""
    result = ip.run_cell("%%replay\nraise ValueError('bad setup')")
    assert isinstance(result.error_in_exec, ValueError)
    assert [c.rstrip() for c in colab_resilience.replay_cells(ip)] == []


def test_a_shrink_path_that_cannot_be_set_is_refused_before_the_cell_runs(ip):
    """A torch DataLoader refuses a new batch_size once made: --shrink loader.batch_size would fail
    the retry, so it is refused in one line when the cell starts, and the body does not run."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    ip.user_ns.update(ran=[], loader=torch.utils.data.DataLoader(list(range(8)), batch_size=4))
    message = usage_error(ip, "%%resilient --shrink loader.batch_size\nran.append(1)")
    assert message.endswith("--shrink loader.batch_size: it cannot be set (ValueError: batch_size attribute should not be "
                            "set after DataLoader is initialized); shrink the variable it is made from instead"), message
    assert ip.user_ns["ran"] == [] and ip.user_ns["loader"].batch_size == 4
