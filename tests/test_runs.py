"""Runs in an in-process shell: --save and rollback, safe points, the line magics, bad input.

The training is tests/files/train.ipynb, its cells run in this process's IPython shell
(harness.run_in_shell); tests/test_golden.py proves that its uninterrupted run here ends with the
`reference` fixture's RESULT line, as in a kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import colab_resilience
from harness import epochs, events, load, result, run_in_shell, user_cell


@pytest.fixture
def root(ip, tmp_path):
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    return tmp_path / "runs"


def train(ip, tmp_path, **parameters):
    """train.ipynb with ``parameters`` (its fault record and log in ``tmp_path``), run to its end
    in the shell; returns the notebook."""
    nb = load("train.ipynb", tmp_path, **parameters)
    run_in_shell(ip, nb)
    return nb


@pytest.mark.kernel  # the reference is a kernel's run
def test_retry_rolls_back_to_the_last_safe_point_bit_identical(ip, root, tmp_path, capsys, reference):
    """A (simulated) CUDA OOM half-way through epochs 1 and 3, once each: each retry rolls the run
    back to the safe point before that epoch, and the run ends bit-identical to the reference,
    every epoch run to its end exactly once."""
    train(ip, tmp_path, fault="oom-error", fault_epoch=[1, 3], strikes=1, retries=2)
    out = capsys.readouterr().out
    assert result(out) == reference.result
    assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]  # every epoch ran to its end exactly once
    assert out.count("rolled back to the last safe point; continuing at 1") == 1
    assert out.count("rolled back to the last safe point; continuing at 3") == 1


def test_modules_and_optimizers_are_restored_in_place(ip, root, tmp_path):
    """A rollback puts the saved state into the objects the names already hold: the optimizer
    still steps the model's own parameters."""
    nb = load("train.ipynb", tmp_path, fault="oom-error", fault_epoch=2, strikes=1)
    run_in_shell(ip, nb, stop="train")
    model, opt = ip.user_ns["model"], ip.user_ns["opt"]
    assert ip.run_cell(user_cell(nb, "train")).success
    assert ip.user_ns["model"] is model and ip.user_ns["opt"] is opt
    assert opt.param_groups[0]["params"][0] is next(model.parameters())


def test_done_run_journal_and_status(ip, root, tmp_path, capsys):
    """A finished run's journal (done, no restarts, the saved names, signed) and `%resilience
    status`'s line for it."""
    train(ip, tmp_path)
    journals = list(root.glob("run-*/journal.json"))
    assert len(journals) == 1
    j = json.loads(journals[0].read_text())
    assert j["status"] == "done" and j["restarts_used"] == 0
    assert j["names"] == ["model", "opt", "history"]
    assert "signature" in j
    capsys.readouterr()
    ip.run_line_magic("resilience", "status")
    out = capsys.readouterr().out
    assert f"run directory {root}" in out
    assert f"run {j['run_id']}: done; restarts 0/3 (last: none); saves model, opt, history; last checkpoint ckpt-" in out
    # a kill between LATEST and the journal's write leaves the journal a checkpoint behind: status
    # shows the newest, which a resume restores
    from colab_resilience.journal import Journal
    from colab_resilience.signing import load_or_create_key

    run_dir = journals[0].parent
    newest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    behind = Journal.load(run_dir, key=load_or_create_key())
    behind.last_checkpoint = None
    behind.save()
    ip.run_line_magic("resilience", "status")
    assert f"saves model, opt, history; last checkpoint {newest}; " in capsys.readouterr().out


def test_explicit_checkpoint_saves_at_the_end_of_its_iteration(ip, root, capsys):
    """checkpoint() inside an iteration asks for a save that --every would skip; it is made at the
    end of that iteration, where the state is whole: a retry of the next iteration resumes there,
    and nothing is done twice. (It used to save on the spot, and the retry redid the iteration on
    top of its own half-done update.)"""
    ip.user_ns.update(state={"step": 0}, tries=[0])
    cell = (
        "%%resilient --save state --every 10\n"
        "for i in resume_range(3):\n"
        "    state['step'] += 1\n"
        "    if i == 1:\n"
        "        checkpoint()\n"
        "        state['step'] += 10\n"
        "    if i == 2 and tries[0] == 0:\n"
        "        tries[0] += 1\n"
        "        state['step'] += 100\n"
        "        raise MemoryError()\n"
    )
    assert ip.run_cell(cell).success
    assert ip.user_ns["state"] == {"step": 13}  # as without the error
    assert "rolled back to the last safe point; continuing at 2" in capsys.readouterr().out


def test_resume_range_outside_a_resilient_cell_is_range(ip, capsys):
    """resume_range outside %%resilient is plain range (the same object as the package's)."""
    ip.run_cell("seen = list(resume_range(2, 8, 3))")
    assert ip.user_ns["seen"] == [2, 5]
    assert colab_resilience.resume_range is ip.user_ns["resume_range"]


def test_reset_forgets_a_run_and_resume_marks_it_pending(ip, root, tmp_path, capsys):
    """`%resilience resume` restores a finished run's names and makes it pending again;
    `%resilience reset RUN` deletes it."""
    train(ip, tmp_path)
    run_dir = next(root.glob("run-*"))
    ip.run_line_magic("resilience", "resume")
    j = json.loads((run_dir / "journal.json").read_text())
    assert j["status"] == "pending"
    assert "restored model, opt, history; the next %%resilient cell you run continues it" in capsys.readouterr().out
    ip.run_line_magic("resilience", f"reset {run_dir.name}")
    assert not run_dir.exists()
    assert "forgot run-" in capsys.readouterr().out


def test_a_bare_reset_forgets_this_kernels_run_and_asks_which_when_it_has_none(ip, root, capsys):
    """`%resilience reset` without RUN (as the refusals advise) deleted the newest run in the
    folder, whoever's: Colab's runs share one Drive folder, and another notebook's killed run,
    pending with its checkpoints, was the newest. It forgets the run of this kernel's last
    %%resilient cell; in a kernel that ran none, with more than one run there, it asks which and
    deletes nothing. A bare `%resilience resume` likewise (the next cell continues the run it picks)."""
    import os

    ip.user_ns.update(history=[])
    for n in (2, 3):
        assert ip.run_cell(f"%%resilient --save history\nfor epoch in resume_range({n}):\n    history.append(epoch)").success
    first, second = sorted(root.glob("run-*"), key=lambda p: (p / "journal.json").stat().st_mtime)
    ip.run_line_magic("unload_ext", "colab_resilience")  # a new kernel: no %%resilient cell run in it
    ip.run_line_magic("load_ext", "colab_resilience")
    ip.run_line_magic("resilience", f"dir {root}")
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", "reset")
    assert str(info.value).startswith(f"%resilience reset: which run? {root} holds 2 runs ("), info.value
    assert first.exists() and second.exists()
    # resume, the same: the next %%resilient cell continues what it picks (it picked the newest, whoever's)
    journals = {p: (p / "journal.json").read_bytes() for p in (first, second)}
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", "resume")
    assert str(info.value).startswith(f"%resilience resume: which run? {root} holds 2 runs ("), info.value
    assert {p: (p / "journal.json").read_bytes() for p in (first, second)} == journals
    assert ip.run_cell("%%resilient --save history\nfor epoch in resume_range(2):\n    history.append(epoch)").success
    later = (second / "journal.json").stat().st_mtime + 10
    os.utime(second / "journal.json", (later, later))  # another kernel's run, written since
    capsys.readouterr()
    ip.run_line_magic("resilience", "reset")
    assert f"forgot {first.name}" in capsys.readouterr().out
    assert not first.exists() and second.exists()


def test_damaged_journal_is_refused_with_one_line(ip, root, tmp_path):
    """A journal edited without the key (a replay cell swapped for evil code) is refused by the
    cell that would resume it, in one line, and nothing of it runs."""
    nb = train(ip, tmp_path)
    path = next(root.glob("run-*/journal.json"))
    data = json.loads(path.read_text())
    data["replay_cells"] = [{"key": "x", "source": "%%replay\nimport os; os.system('echo pwned')"}]
    path.write_text(json.dumps(data))  # edited without the key: its signature no longer matches
    run_in_shell(ip, nb, stop="train")
    line, body = user_cell(nb, "train").removeprefix("%%resilient ").split("\n", 1)
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("resilient", line, body)
    assert "is not signed by this installation's key" in str(info.value)
    said = str(info.value)
    assert "so its 1 set-up cell (beginning: \"import os; os.system('echo pwned')\") did not run" in said, said
    assert "review them with `%resilience show" in said and "\n" not in said


def on_a_new_vm(ip, root, tmp_path, monkeypatch) -> None:
    """The shell as a new Colab VM's kernel with the run directory on Drive: an empty namespace, a
    new installation key, the extension loaded again on ``root``."""
    ip.run_line_magic("unload_ext", "colab_resilience")
    for name in [n for n in ip.user_ns if not n.startswith("_") and n not in ip.user_ns_hidden]:
        ip.user_ns.pop(name)
    monkeypatch.setenv("COLAB_RESILIENCE_HOME", str(tmp_path / "new-vm-home"))  # a new key
    ip.run_line_magic("load_ext", "colab_resilience")
    ip.run_line_magic("resilience", f"dir {root}")


def test_a_run_written_under_another_key_resumes_only_when_trusted(ip, root, tmp_path, monkeypatch, capsys):
    """A new Colab VM with the run directory on Drive: the key in ~ is new. Nothing from the old
    run is executed until the user vouches for it; then it resumes and is signed with the new key."""
    from colab_resilience.checkpoints import CheckpointStore
    from colab_resilience.journal import Journal
    from colab_resilience.signing import load_or_create_key

    nb = load("train.ipynb", tmp_path, fault="interrupt", fault_epoch=2, strikes=1)

    def setups() -> int:  # how many times the set-up cell ran: it logs its start
        return sum(e.name == "setup-start" for e in events(tmp_path / "events.log"))

    run_in_shell(ip, nb, stop="train")
    ip.run_cell(user_cell(nb, "train"))  # interrupted in epoch 2: the run ends, its checkpoint is kept
    assert setups() == 1
    want = ip.user_ns["history"]
    run_dir = next(root.glob("run-*"))
    on_a_new_vm(ip, root, tmp_path, monkeypatch)
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", "resume")
    assert f"`%resilience resume --trust {run_dir.name[4:]}` runs them" in str(info.value)
    assert setups() == 1  # the old set-up cell did not run
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", "resume --trusted")
    assert "%resilience resume: unexpected '--trusted'; write %resilience resume [--trust] [RUN]" in str(info.value)
    capsys.readouterr()
    ip.run_line_magic("resilience", "resume --trust")
    out = capsys.readouterr().out
    assert f"run {run_dir.name[4:]} trusted and signed with this installation's key (journal and 2 checkpoints)" in out
    assert setups() == 2  # replayed now, because the user said so
    assert ip.user_ns["history"] == want[:2]
    key = load_or_create_key()
    Journal.load(run_dir, key=key)  # signed with the new key now
    CheckpointStore(run_dir / "checkpoints", key=key).load()
    assert ip.run_cell(user_cell(nb, "train")).success  # the fault struck its one time
    assert epochs(tmp_path / "events.log") == [0, 1] + [2, 3]  # before the interrupt; after the resume


def test_the_cell_run_again_under_a_new_key_names_the_run_the_old_key_signed(ip, root, tmp_path, monkeypatch, capsys):
    """A new Colab VM, the run directory on Drive: the cell's run id is an HMAC under the new key,
    so the cell run again begins a run of its own from the beginning (the same result). One line
    names the run the old key signed, which could go on, and how to go on with it, and `%resilience
    status` marks it; nothing of it runs; after `%resilience resume --trust` the cell continues it."""
    nb = load("train.ipynb", tmp_path, fault="interrupt", fault_epoch=2, strikes=1)
    run_in_shell(ip, nb, stop="train")
    ip.run_cell(user_cell(nb, "train"))  # interrupted in epoch 2: the run stops, its checkpoint is kept
    (old,) = [p.name.removeprefix("run-") for p in root.glob("run-*")]
    on_a_new_vm(ip, root, tmp_path, monkeypatch)
    nb = load("train.ipynb", tmp_path)  # no fault now
    run_in_shell(ip, nb, stop="train")
    capsys.readouterr()
    assert ip.run_cell(user_cell(nb, "train")).success
    said = [line for line in capsys.readouterr().out.splitlines() if f"run {old} " in line]
    assert said == [
        f"colab_resilience: run {old} of this cell in {root}, stopped before its end, was written under another "
        "installation key "
        "(another machine, a new Colab VM, a lost key), so this cell begins a run of its own from the beginning; "
        f"to go on with that one instead, review it with `%resilience show {old}`, then "
        f"`%resilience resume --trust {old}` and run this cell again; `%resilience reset {old}` forgets it"]
    assert epochs(tmp_path / "events.log") == [0, 1] + [0, 1, 2, 3]  # from the beginning, not from its epoch 2
    ip.run_line_magic("resilience", "status")  # not "run its cell again to continue", which would not
    shown = capsys.readouterr().out.splitlines()
    at = shown.index(next(line for line in shown if line.startswith(f"colab_resilience:   run {old}: failed;")))
    assert shown[at + 1] == (
        "colab_resilience:     written under another installation key (another machine, a new Colab VM, a lost key): "
        f"its cell run again begins a run of its own; review it with `%resilience show {old}`, then `%resilience "
        f"resume --trust {old}` goes on with it"), shown
    assert sum("another installation key" in line for line in shown) == 1, shown  # not the run done here
    ip.run_line_magic("resilience", f"resume --trust {old}")
    capsys.readouterr()
    assert ip.run_cell(user_cell(nb, "train")).success
    assert f"run {old} of this cell" not in capsys.readouterr().out
    assert epochs(tmp_path / "events.log") == [0, 1] + [0, 1, 2, 3] + [2, 3]  # that one went on from its epoch 2


@pytest.mark.kernel  # the reference is a kernel's run
def test_the_commands_resume_of_a_notebooks_run_says_that_its_cell_run_again_goes_on(ip, root, tmp_path, capsys,
                                                                                     reference):
    """`colab-resilience resume RUN` without --run-dir marks a notebook's run (in
    $COLAB_RESILIENCE_RUN_DIR, else ./.colab_resilience): its line says the run goes on when its
    cell runs again in its notebook, not when `colab-resilience run NOTEBOOK` runs it (that command
    without --run-dir begins afresh in a temporary folder); and the cell run again goes on from its
    checkpoint, the epochs before the error not trained again."""
    nb = load("train.ipynb", tmp_path, fault="error", fault_epoch=2, strikes=1)
    run_in_shell(ip, nb, stop="train")
    assert not ip.run_cell(user_cell(nb, "train")).success  # stopped by the error in epoch 2
    (run,) = [p.name.removeprefix("run-") for p in root.glob("run-*")]

    def command(*args):
        return subprocess.run([sys.executable, "-m", "colab_resilience", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env=dict(os.environ, COLAB_RESILIENCE_RUN_DIR=str(root)))

    marked = command("resume", run)
    assert (marked.returncode, marked.stderr) == (0, ""), marked.stdout + marked.stderr
    assert marked.stdout == (f"colab-resilience resume: run {run} goes on at 2 when its cell runs again in its notebook "
                             f"(the set-up cells run first); nothing was run here; `colab-resilience reset {run}` "
                             "forgets it\n")
    again = command("resume", run)
    assert again.stdout == (f"colab-resilience resume: run {run} is pending already: it goes on at 2 when its cell runs "
                            "again in its notebook; nothing was run\n"), again.stdout + again.stderr
    shown = command("show", run)
    assert shown.stdout.splitlines()[-1] == (
        f"colab-resilience show: nothing was run; `colab-resilience resume {run}` marks the run to go on when its cell "
        f"runs again in its notebook; `colab-resilience reset {run}` forgets it"), shown.stdout + shown.stderr
    capsys.readouterr()
    assert ip.run_cell(user_cell(nb, "train")).success
    assert ip.run_cell(user_cell(nb, "result")).success
    assert result(capsys.readouterr().out) == reference.result
    assert epochs(tmp_path / "events.log") == [0, 1] + [2, 3]  # before the error; from its checkpoint


@pytest.mark.parametrize(
    "line,expected",
    [
        ("--save 3x", "--save '3x': '3x' is not a variable name; write --save model,opt,history"),
        ("--save modle", "--save modle: no variable 'modle' exists and the cell does not assign it (did you mean 'model'?)"),
        ("--max-restarts lots", "--max-restarts: needs a whole number, like --max-restarts 3 (got 'lots')"),
        ("--every 0", "--every: needs a number of safe points or a duration, like --every 10 or --every 5min (got '0')"),
        ("--every soon", "(got 'soon')"),
    ],
)
def test_bad_run_options(ip, root, tmp_path, line, expected):
    """A bad %%resilient option is a one-line UsageError that says how to write it."""
    run_in_shell(ip, load("train.ipynb", tmp_path), stop="train")
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("resilient", line, "x = 1\n")
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "line,expected",
    [
        ("2", "planned restarts every 2 safe points"),
        ("--memory 90%", "planned restarts when memory in use reaches 90%"),
        ("--memory=85", "when memory in use reaches 85%"),
        ("off", "planned restarts off"),
    ],
)
def test_restart_after(ip, capsys, line, expected):
    """%restart_after confirms the policy it set."""
    ip.run_line_magic("restart_after", line)
    assert expected in capsys.readouterr().out
    ip.run_line_magic("restart_after", "off")


@pytest.mark.parametrize(
    "line,expected",
    [
        ("soon", "%restart_after: 'soon' is not a number of safe points; write %restart_after N"),
        ("--memory lots", "--memory needs a percentage (got 'lots')"),
        ("--memory 120%", "--memory 120% is not between 0 and 100"),
    ],
)
def test_restart_after_bad_input(ip, line, expected):
    """Bad %restart_after input is a one-line UsageError."""
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("restart_after", line)
    assert expected in str(info.value)


def test_resilience_bad_input(ip, root, tmp_path):
    """Bad %resilience input is a UsageError that lists what is possible."""
    for line, expected in [
        ("frobnicate", "%resilience: unknown command 'frobnicate'; write %resilience status, show [RUN], resume [--trust] [RUN], reset [RUN], dir PATH, isolate [off] or help"),
        ("resume", f"%resilience resume: no runs in {root}; a %%resilient cell creates one"),
        ("reset nope", f"%resilience reset: no run 'nope' in {root} (runs: none)"),
        ("dir a b", "%resilience dir: give one folder"),
    ]:
        with pytest.raises(UsageError) as info:
            ip.run_line_magic("resilience", line)
        assert expected in str(info.value), line
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", f"dir {tmp_path / 'file' / 'sub'}")
    assert str(info.value) == (f"%resilience dir: {tmp_path / 'file' / 'sub'} cannot be made ({tmp_path / 'file'} is a "
                               "file, not a folder), so nothing is written there; choose another folder")


def test_resilience_help_says_what_every_magic_does(ip, capsys):
    """``%resilience help`` (what users type before ``%resilience?``): one summary line per magic
    and every ``%resilience`` command, without IPython's usage block or argparse's option list."""
    ip.run_line_magic("resilience", "help")
    out = capsys.readouterr().out
    for line in ["  %%resilient: Run the cell; on an out-of-memory error, free memory and run it again; past the",
                 "  %%replay: Run the cell and record it as a set-up cell to replay after a kernel restart.",
                 "  %restart_after: Plan kernel restarts at safe points: the leak guard.",
                 "  %resilience: What the runs are doing and what is on disk."]:
        assert line in out.splitlines(), out
    for command in ["status", "show [RUN]", "resume [RUN]", "resume --trust [RUN]", "reset [RUN]", "dir PATH",
                    "isolate", "help"]:
        assert f"    %resilience {command}: " in out, command
    assert "::" not in out and "positional arguments" not in out and "``" not in out, out
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", "help me")
    assert str(info.value) == "%resilience help: unexpected 'me'; write %resilience help"


def test_run_directories_are_owner_only(ip, root, tmp_path):
    """The run folder and every run directory in it are 0700."""
    train(ip, tmp_path)
    run_dir = next(root.glob("run-*"))
    assert run_dir.stat().st_mode & 0o777 == 0o700
    assert Path(root).stat().st_mode & 0o777 == 0o700


def test_terminal_ipython_cannot_restart_and_says_so(ip, root, capsys):
    """An OOM beyond the retries outside a Jupyter kernel: said so, the OOM raised, the run failed."""
    ip.user_ns["n"] = [0]
    result = ip.run_cell("%%resilient --retries 0\nn[0] += 1\nraise MemoryError()")
    assert isinstance(result.error_in_exec, MemoryError)
    assert "this IPython is not a Jupyter kernel, so it cannot be restarted" in capsys.readouterr().out
    j = json.loads(next(root.glob("run-*/journal.json")).read_text())
    assert j["status"] == "failed"


def test_an_ordinary_error_ends_the_run_with_a_hint_to_resume_it(ip, root, tmp_path, capsys):
    """An ordinary exception in epoch 2 fails the run with a hint; `%resilience resume`, then the
    cell run again (now without the error), continues from the last safe point."""
    nb = load("train.ipynb", tmp_path, fault="error", fault_epoch=2, strikes=1)
    run_in_shell(ip, nb, stop="train")
    outcome = ip.run_cell(user_cell(nb, "train"))
    assert isinstance(outcome.error_in_exec, ValueError)
    out = capsys.readouterr().out
    j = json.loads(next(root.glob("run-*/journal.json")).read_text())
    assert (f"colab_resilience: run {j['run_id']} stopped by ValueError; to go on anyway: %resilience resume "
            f"{j['run_id']}, then run this cell again: it goes on at 2\n") in out, out
    assert j["status"] == "failed"
    # and status, which had only "failed", says it too, in this kernel as in any other
    ip.run_line_magic("resilience", "status")
    status = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(status) if line.startswith(f"colab_resilience:   run {j['run_id']}: failed;"))
    assert status[at + 1] == (f"colab_resilience:     stopped by ValueError; to go on anyway: %resilience resume "
                              f"{j['run_id']}, then run this cell again: it goes on at 2"), status
    ip.run_line_magic("resilience", "resume")  # bare: the run of this kernel's last %%resilient cell
    outcome = ip.run_cell(user_cell(nb, "train"))  # the "fixed" cell: the fault struck its one time
    assert outcome.success
    assert "rolled back to the last safe point; continuing at 2" in capsys.readouterr().out
    assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]


SET_UP = ("%%replay\nimport torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(2, 2)\n"
          "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\nhistory = []")
STOPPED = ("%%resilient --save model,opt,history\nfor epoch in resume_range(4):\n"
           "    opt.zero_grad(); model(torch.ones(1, 2)).pow(2).sum().backward(); opt.step()\n    history.append(epoch)\n"
           "    if epoch == 2 and fail:\n        raise ValueError('a bug')\n")


def _uninterrupted_weights(ip) -> list:
    ip.run_cell("torch.manual_seed(0)\ntwin = torch.nn.Linear(2, 2)\n"
                "o = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)\nfor epoch in range(4):\n"
                "    o.zero_grad(); twin(torch.ones(1, 2)).pow(2).sum().backward(); o.step()")
    return [ip.user_ns["twin"].weight.tolist(), ip.user_ns["twin"].bias.tolist()]


@pytest.mark.parametrize("then", ["resume", "set-up again"])
def test_a_stopped_runs_cell_run_again_on_what_its_training_left_is_refused(ip, root, capsys, then):
    """A run stopped by an error in epoch 2, its cell run again (the bug fixed) without running the
    set-up cells: it started from epoch 0 on the model, optimizer and history the stopped run had
    trained and appended to, dropped the checkpoint, and ended "done" with 7 steps and
    [0, 1, 2, 0, 1, 2, 3] (as plain Jupyter does, silently). Refused in one line that names what
    its training left and the two ways on, the checkpoint kept; either ends as an uninterrupted
    run, bit for bit."""
    ip.user_ns["fail"] = True
    assert ip.run_cell(SET_UP).success
    assert isinstance(ip.run_cell(STOPPED).error_in_exec, ValueError)
    run_id = next(root.glob("run-*")).name.removeprefix("run-")
    ip.user_ns["fail"] = False  # the bug fixed
    refused = ip.run_cell(STOPPED).error_in_exec
    assert isinstance(refused, UsageError) and str(refused) == (
        f"colab_resilience: run {run_id} of this cell stopped at 2, and model, opt, history hold what its training "
        "left, not what the set-up cells made: from its beginning on that, the cell would not give an uninterrupted "
        f"run's result. To go on from its checkpoint: %resilience resume {run_id}, then run this cell; to start over: "
        f"run the set-up cells first (or %resilience reset {run_id} to train on the values as they are)"), refused
    assert ip.user_ns["history"] == [0, 1, 2]
    capsys.readouterr()
    if then == "resume":
        ip.run_line_magic("resilience", f"resume {run_id}")
        assert ip.run_cell(STOPPED).success
        assert "continuing at 2" in capsys.readouterr().out
    else:
        assert ip.run_cell(SET_UP).success
        assert ip.run_cell(STOPPED).success
        assert (f"colab_resilience: run {run_id} of this cell had stopped before its end, with a checkpoint to go on "
                "at 2; it starts again from its beginning now") in capsys.readouterr().out
    assert ip.user_ns["history"] == [0, 1, 2, 3]
    model = ip.user_ns["model"]
    assert [model.weight.tolist(), model.bias.tolist()] == _uninterrupted_weights(ip)


def test_a_stopped_runs_cell_run_again_on_a_model_it_trained_without_save_is_refused(ip, root, capsys):
    """The same with a model and optimizer the training trains that no --save names: they were not
    compared, and the cell run again trained on from them, said nothing and ended "done" with 7
    steps for 4 (a Keras model a fit's callback keeps is such a value: tests/test_keras.py).
    Refused naming them; the set-up cells run first, it starts over and ends as an uninterrupted
    run, bit for bit."""
    stopped = STOPPED.replace(" --save model,opt,history", "").replace("    history.append(epoch)\n", "")
    ip.user_ns["fail"] = True
    assert ip.run_cell(SET_UP).success
    assert isinstance(ip.run_cell(stopped).error_in_exec, ValueError)
    run_id = next(root.glob("run-*")).name.removeprefix("run-")
    ip.user_ns["fail"] = False
    refused = ip.run_cell(stopped).error_in_exec
    assert isinstance(refused, UsageError) and str(refused).startswith(
        f"colab_resilience: run {run_id} of this cell stopped at 2, and model, opt hold what its training "
        "left, not what the set-up cells made"), refused
    assert ip.run_cell(SET_UP).success
    assert ip.run_cell(stopped).success
    model = ip.user_ns["model"]
    assert [model.weight.tolist(), model.bias.tolist()] == _uninterrupted_weights(ip)


def test_resuming_a_stopped_run_says_what_it_trains_that_no_checkpoint_holds(ip, root, capsys):
    """`%resilience resume` of a stopped run whose loop trains a model and optimizer no --save
    names: the history went back to the safe point, the model went on as the error left it (one
    step more), and nothing said so but the lint at the run's start. One line names them and
    says the run can end otherwise; a run that saves them says nothing of the kind."""
    ip.user_ns["fail"] = True
    assert ip.run_cell(SET_UP).success
    stopped = STOPPED.replace("--save model,opt,history", "--save history")
    assert isinstance(ip.run_cell(stopped).error_in_exec, ValueError)
    run_id = next(root.glob("run-*")).name.removeprefix("run-")
    capsys.readouterr()
    ip.run_line_magic("resilience", f"resume {run_id}")
    assert (f"colab_resilience: run {run_id}: model, opt are not in --save, so no checkpoint holds them: the run goes "
            "on with them as they are now, not as at its safe point, and can end otherwise than an uninterrupted run; "
            f"for that result, `%resilience reset {run_id}`, add them to --save and run the cells again\n"
            ) in capsys.readouterr().out
    ip.run_line_magic("resilience", f"reset {run_id}")
    assert ip.run_cell(SET_UP).success
    assert isinstance(ip.run_cell(STOPPED).error_in_exec, ValueError)
    run_id = next(p for p in root.glob("run-*")).name.removeprefix("run-")
    capsys.readouterr()
    ip.run_line_magic("resilience", f"resume {run_id}")
    out = capsys.readouterr().out
    assert "restored model, opt, history;" in out and "not in --save" not in out, out


def test_a_reset_stopped_run_trains_on_the_values_as_they_are(ip, root, capsys):
    """The refusal's third way: %resilience reset RUN, and the cell trains on what the stopped run
    left, as the user chose (a new run; nothing compared)."""
    ip.user_ns["fail"] = True
    assert ip.run_cell(SET_UP).success
    assert isinstance(ip.run_cell(STOPPED).error_in_exec, ValueError)
    run_id = next(root.glob("run-*")).name.removeprefix("run-")
    ip.user_ns["fail"] = False
    assert not ip.run_cell(STOPPED).success
    ip.run_line_magic("resilience", f"reset {run_id}")
    assert ip.run_cell(STOPPED).success
    assert ip.user_ns["history"] == [0, 1, 2, 0, 1, 2, 3]


def test_a_resumed_run_stays_adopted_when_the_cell_is_refused_for_its_options(ip, root, capsys):
    """`%resilience resume RUN`, then the cell, edited (no cell id: another cell to the package),
    refused for a misspelt option: the cell put right still continues RUN (the refusal let go of
    the adoption, and the cell began a run of its own from the start)."""
    ip.user_ns.update(history=[], fail=[True])
    cell = ("%%resilient --save {}\nfor epoch in resume_range(4):\n    history.append(epoch)\n"
            "    if epoch == 2 and fail[0]:\n        fail[0] = False\n        raise ValueError('fault')\n")
    assert isinstance(ip.run_cell(cell.format("history")).error_in_exec, ValueError)
    run_id = next(root.glob("run-*")).name.removeprefix("run-")
    ip.run_line_magic("resilience", f"resume {run_id}")
    edited = cell.replace("history.append(epoch)", "history.append(10 * epoch)")
    assert isinstance(ip.run_cell(edited.format("histroy")).error_in_exec, UsageError)
    capsys.readouterr()
    assert ip.run_cell(edited.format("history")).success
    assert "continuing at 2" in capsys.readouterr().out
    assert ip.user_ns["history"] == [0, 1, 20, 30]
    assert [d.name for d in root.glob("run-*")] == [f"run-{run_id}"]


def test_names_the_cell_assigns_later_and_unsaveable_values_stop_the_cell(ip, root, capsys):
    """A name the cell assigns is not "missing" before it runs; a value that cannot be saved stops
    the cell at its first safe point, naming it once; suggestions come from the user's names, not
    IPython's."""
    cell = (
        "%%resilient --save total,gen\n"
        "total = 0\n"
        "gen = (i for i in range(3))\n"
        "for step in resume_range(4):\n"
        "    total += step\n"
    )
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("resilient", "--save total,gen", cell.split("\n", 1)[1])
    out = capsys.readouterr().out
    assert "no variable of that name" not in out
    assert str(info.value).startswith("colab_resilience: cannot save 'gen': generator objects cannot be checkpointed")
    assert ip.user_ns["total"] == 0  # stopped at the loop start: no step ran
    ip.user_ns["batch_size"] = 8
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("resilient", "--save opn", "x = 1\n")
    assert "did you mean" not in str(info.value)  # not IPython's `open`
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("resilient", "--shrink batch_siz", "x = 1\n")
    assert "(did you mean 'batch_size'?)" in str(info.value)


def test_a_saved_name_deleted_later_is_said_once_and_the_rest_is_saved(ip, root, capsys):
    """A --save name deleted mid-run is said once; the checkpoints hold the others."""
    ip.user_ns.update(a=1, b=2)
    cell = "%%resilient --save a,b\nfor i in resume_range(3):\n    a += 1\n    if i == 0:\n        del b\n"
    assert ip.run_cell(cell).success
    out = capsys.readouterr().out
    assert out.count("colab_resilience: b is not defined at this safe point; the checkpoint holds the other names") == 1
    run_dir = next(root.glob("run-*"))
    from colab_resilience.checkpoints import CheckpointStore

    ns: dict = {}
    CheckpointStore(run_dir / "checkpoints").load().restore(ns, rng=False)
    assert ns == {"a": 4}


def test_default_run_folder_is_on_a_mounted_drive_in_colab(tmp_path, monkeypatch):
    """In Colab (detected by google.colab or COLAB_RELEASE_TAG) runs go to the mounted Drive
    folder, which outlives the VM; without Drive, or outside Colab, to ./.colab_resilience."""
    from colab_resilience import session as runs

    drive = tmp_path / "drive" / "MyDrive"
    monkeypatch.setattr(runs, "DRIVE", drive)
    monkeypatch.delenv(runs.RUN_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261120-060000_RC00")
    assert runs.in_colab()
    assert runs.default_root() == tmp_path / ".colab_resilience"  # Drive not mounted
    drive.mkdir(parents=True)
    assert runs.default_root() == drive / "colab_resilience"
    monkeypatch.setenv(runs.RUN_DIR_ENV, str(tmp_path / "mine"))
    assert runs.default_root() == tmp_path / "mine"  # an explicit folder wins
    monkeypatch.delenv(runs.RUN_DIR_ENV)
    monkeypatch.delenv("COLAB_RELEASE_TAG")
    if "google.colab" not in sys.modules:
        assert not runs.in_colab()
        assert runs.default_root() == tmp_path / ".colab_resilience"  # Drive ignored outside Colab
