"""The extension in real kernels: real OOMs under a memory cap, real interrupts, real front-end ids."""

from __future__ import annotations

import re
import time

import pytest
from nbclient.exceptions import CellExecutionError

from harness import MEMORY_TOOLS, cell_text, notebook, run_notebook

pytestmark = pytest.mark.kernel

# the first cell of these kernels: memory tools (a cap for real OOMs), torch on one thread, the extension
PRELUDE = MEMORY_TOOLS + "\nimport torch\ntorch.set_num_threads(1)\n%load_ext colab_resilience\n"


def test_real_oom_finishes_after_shrink_in_a_headless_notebook():
    """A real CPU OOM under a memory cap, in a notebook run by nbclient: the batch halves at each
    retry, each retry says what was freed, and the cell finishes with the size that fits."""
    nb = notebook(
        PRELUDE,
        "batch_size = 8192\ncap_memory(1 * GiB)  # 8192 and 4096 rows of 64 Ki floats do not fit",
        "%%resilient --retries 3 --shrink batch_size\n"
        "x = torch.ones(batch_size, 65536)\n"
        "total = float(x.sum())\n"
        "del x",
        "print('done', batch_size, total)",
    )
    run_notebook(nb)
    lines = [l for l in cell_text(nb.cells[2]).splitlines() if "— freed" in l]
    assert len(lines) == 2, lines
    assert re.fullmatch(
        r"colab_resilience: OOM \(DefaultCPUAllocator: can't allocate memory\) — freed [\d.]+ \w+; "
        r"batch_size 8192 → 4096; retry 1/3",
        lines[0],
    ), lines[0]
    assert lines[1].endswith("batch_size 4096 → 2048; retry 2/3")
    assert cell_text(nb.cells[3]).strip() == f"done 2048 {2048 * 65536}.0"


def test_recovery_frees_a_gigabyte_held_in_a_local_frame(kernel):
    """Without release() the traceback keeps `held` (1 GiB) alive and the retry fails too."""
    kernel.ok(PRELUDE)
    kernel.ok("batch_size = 8192\nstarts = []\nbefore = rss()\ncap_memory(int(1.5 * GiB) + 128 * MiB)")
    r = kernel.ok(
        "%%resilient --retries 3 --shrink batch_size\n"
        "def step(n):\n"
        "    starts.append(rss())\n"
        "    held = torch.ones(1 << 28)          # 1 GiB, alive in this frame when the OOM comes\n"
        "    work = torch.empty(n, 65536)\n"
        "    work.fill_(1.0)\n"
        "    return float(held[0]) + work.shape[0]\n"
        "result = step(batch_size)\n"
    )
    assert "freed 1.0 GiB" in r.stdout
    before, starts, after = kernel.value("(before, starts, rss())")
    assert len(starts) >= 2
    for rss_at_retry in starts[1:]:
        assert abs(rss_at_retry - before) <= 0.10 * before, (before, starts)
    assert abs(after - before) <= 0.10 * before, (before, after)


def test_a_retry_unbinds_what_the_failed_attempt_bound_since_the_last_safe_point(kernel):
    """`x`, bound to a global by the failed attempt, held 512 MiB through the retry and the half
    batch failed too (the demo's retries all did). A name bound before the safe point the retry
    goes back to (`lookup`, in epoch 0) stays: the retry does not bind it again."""
    kernel.ok(PRELUDE)
    kernel.ok("batch_size = 4096\ncap_memory(768 * MiB)  # 512 MiB fits, 1 GiB does not")
    r = kernel.ok(
        "%%resilient --retries 2 --shrink batch_size\n"
        "for epoch in resume_range(2):\n"
        "    if epoch == 0:\n"
        "        lookup = torch.arange(10)\n"
        "    x = torch.ones(batch_size * (1 + epoch), 16384)  # epoch 1: 512 MiB, bound to a global\n"
        "    y = x * 2                                       # and 512 MiB more: does not fit\n"
        "    total = float(y[0].sum()) + int(lookup.sum())\n"
        "    del x, y\n"
    )
    lines = [l for l in r.stdout.splitlines() if "; retry " in l]
    assert len(lines) == 1, r.stdout
    assert re.fullmatch(
        r"colab_resilience: OOM \(DefaultCPUAllocator: can't allocate memory\) — unbound x \(new since the last "
        r"safe point\) and freed 5\d\d\.\d MiB; batch_size 4096 → 2048; retry 1/2", lines[0]), lines[0]
    # epoch 0 ran with 4096 and is kept: the result is that of a run that changed batch_size there
    assert ("colab_resilience: rolled back to the last safe point; continuing at 1 with batch_size 2048 "
            "(what ran before it ran with batch_size 4096)") in r.stdout.splitlines(), r.stdout
    assert kernel.value("(batch_size, 'x' in globals(), total)") == (2048, False, 2 * 16384.0 + 45)


def test_spent_retries_and_budget_reraise_the_oom_and_still_free_its_memory(kernel):
    """Retries and restart budget spent: the OOM is raised with its own traceback, the report says
    why, and the memory the failed attempts held is given back."""
    kernel.ok(PRELUDE)
    kernel.ok("before = rss()\ncap_memory(4 * GiB)  # else a kernel that always overcommits grants 64 TiB")
    r = kernel.execute(
        "%%resilient --retries 1 --max-restarts 0\n"
        "def step():\n"
        "    held = torch.ones(1 << 28)\n"
        "    return torch.empty(1 << 44)  # 64 TiB: never fits\n"
        "step()\n"
    )
    assert r.status == "error" and r.ename == "RuntimeError"
    assert "DefaultCPUAllocator: can't allocate memory" in r.evalue
    # the lint line, and the one that says a retry without --save may not be exact
    out = [l for l in r.stdout.splitlines() if "this cell reads" not in l and "(no --save)" not in l]
    assert out[0].endswith("retry 1/1")
    assert "failed: restart budget spent (0/0 restarts) and OOM (DefaultCPUAllocator" in out[1]
    assert out[2].startswith("colab_resilience: still out of memory after 2 attempts; memory was freed")
    assert "----> 4     return torch.empty(1 << 44)" in r.traceback_text
    before, after = kernel.value("(before, rss())")
    assert abs(after - before) <= 0.10 * before, (before, after)


def _frames(traceback_text: str) -> list[str]:
    """The code lines of each frame ('---->' lines), without their line numbers."""
    return [re.sub(r"^-+>\s*\d+\s*", "", line) for line in traceback_text.splitlines() if re.match(r"^-+>", line)]


def test_ordinary_error_is_reported_exactly_as_without_the_magic(kernel):
    """An ordinary error in a %%resilient cell has the same reply and the same traceback frames as
    without the magic, with no frame of the package's."""
    kernel.ok("%load_ext colab_resilience")
    body = "def load(path):\n    return open(path).read()\ndata = load('/nonexistent/file.txt')\n"
    plain = kernel.execute(body)
    wrapped = kernel.execute("%%resilient\n" + body)
    assert (wrapped.status, wrapped.ename, wrapped.evalue) == (plain.status, plain.ename, plain.evalue)
    assert plain.ename == "FileNotFoundError"
    assert _frames(wrapped.traceback_text) == _frames(plain.traceback_text)
    assert len(_frames(plain.traceback_text)) == 2
    for foreign in ("colab_resilience", "interactiveshell", "run_cell_magic"):
        assert foreign not in wrapped.traceback_text
    assert "colab_resilience" not in wrapped.stdout


def test_a_syntax_error_under_either_magic_is_shown_as_a_plain_cells(kernel):
    """A typo in a %%resilient or %%replay cell is shown as in a plain cell: the line, its caret
    and the SyntaxError, without the frames between IPython's run_code and the parser (it showed
    seven: IPython shows a SyntaxError raised while code runs with its whole stack); nothing runs
    and the %%replay cell is not recorded."""
    kernel.ok("%load_ext colab_resilience")
    plain = kernel.execute("for epoch in range(2):\n    history.append(epoch\n")
    assert (plain.status, plain.ename) == ("error", "SyntaxError")
    for magic in ("%%resilient --save history", "%%replay"):
        r = kernel.execute(f"{magic}\nfor epoch in range(2):\n    history.append(epoch\n")
        assert (r.status, r.ename) == (plain.status, plain.ename), r.traceback_text
        text = r.traceback_text
        assert ", line 3" in text and "    history.append(epoch" in text and text.rstrip().endswith(
            "SyntaxError: '(' was never closed"), text
        for foreign in ("colab_resilience", "interactiveshell", "run_cell_magic", "ast.py", "Traceback"):
            assert foreign not in text, text
    assert kernel.value("__import__('colab_resilience').replay_cells()") == []


def test_ordinary_error_aborts_queued_cells(kernel):
    """An error in a %%resilient cell aborts the requests queued behind it, as any error does."""
    kernel.ok("%load_ext colab_resilience\nimport time")
    # the pause makes sure the second request is queued when the error comes: ipykernel 6.17
    # aborts only what has arrived by then (stop_on_error_timeout 0), with or without the magic
    first = kernel.submit("%%resilient\ntime.sleep(0.5)\nraise ValueError('bad config')")
    second = kernel.submit("reached = True")
    assert kernel.collect(first).ename == "ValueError"
    assert kernel.collect(second).status == "aborted"
    assert kernel.execute("reached").ename == "NameError"


def test_keyboard_interrupt_is_never_caught(kernel):
    """An interrupt stops the cell at once: never taken for an OOM, never retried; its traceback is
    the cell's, as without the magic (it showed the frames of the package's magic machinery)."""
    kernel.ok("%load_ext colab_resilience\nimport time\nattempts = 0")
    msg_id = kernel.submit("%%resilient --retries 5\nattempts += 1\nfor _ in range(600):\n    time.sleep(0.05)")
    time.sleep(1.5)
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id, timeout=60)
    assert (r.status, r.ename) == ("error", "KeyboardInterrupt")
    assert "OOM" not in r.stdout and "retry" not in r.stdout
    assert kernel.value("attempts") == 1
    assert _frames(r.traceback_text) == ["time.sleep(0.05)"], r.traceback_text
    for foreign in ("colab_resilience", "interactiveshell", "run_cell_magic"):
        assert foreign not in r.traceback_text, r.traceback_text


def test_what_was_said_in_a_cell_that_clears_its_output_is_said_again_at_its_end():
    """A loop that redraws its progress with ``clear_output(wait=True)`` (a live loss plot) took
    each recovery's line from view at its next iteration: the notebook kept 'step 2 2048' and no
    trace of two out-of-memory errors and a batch size cut to a quarter. What the cell said before
    its last clear is said again at its end, once (the test above: a cell that does not clear
    says each line once)."""
    nb = notebook(
        PRELUDE + "from IPython.display import clear_output",
        "batch_size = 8192\ntotals = []\ncap_memory(1 * GiB)  # 8192 and 4096 rows of 64 Ki floats do not fit",
        "%%resilient --retries 3 --shrink batch_size --save totals\n"
        "for i in resume_range(3):\n"
        "    clear_output(wait=True)\n"
        "    x = torch.ones(batch_size, 65536)\n"
        "    totals.append(float(x.sum()))\n"
        "    del x\n"
        "    print('step', i, batch_size)",
    )
    run_notebook(nb)
    lines = cell_text(nb.cells[2]).splitlines()
    assert lines[:2] == ["step 2 2048", "colab_resilience: said in this cell before it cleared its output:"], lines
    ooms = [line for line in lines if line.startswith("colab_resilience: OOM (")]
    assert len(ooms) == 2 and ooms[0].endswith("batch_size 8192 → 4096; retry 1/3"), lines
    assert ooms[1].endswith("batch_size 4096 → 2048; retry 2/3"), lines
    assert all(line.startswith("colab_resilience: ") for line in lines[1:]), lines


def test_notebook_stops_at_an_ordinary_error_in_a_resilient_cell():
    """Headless (nbclient), an ordinary error in a %%resilient cell stops the notebook there."""
    nb = notebook(
        "%load_ext colab_resilience",
        "%%resilient\nx = [1, 2, 3]\nx[10]",
        "print('not reached')",
    )
    with pytest.raises(CellExecutionError) as info:
        run_notebook(nb)
    assert "IndexError" in str(info.value)
    assert nb.cells[2].get("outputs", []) == []


def test_replay_cells_follow_front_end_cell_ids(kernel):
    """JupyterLab sends metadata.cellId, Colab metadata.colab.cell_id: an edited re-run replaces."""
    kernel.ok("%load_ext colab_resilience")
    kernel.ok("%%replay\nimport math\nlr = 0.1", metadata={"cellId": "lab-1"})
    kernel.ok("%%replay\nsteps = 10", metadata={"colab": {"cell_id": "colab-2"}})
    kernel.ok("%%replay\nimport math\nlr = 0.01", metadata={"cellId": "lab-1"})  # edited, same cell
    kernel.ok("%%replay\nsteps = 10", metadata={"colab": {"cell_id": "colab-2"}})
    cells = kernel.value("[c.rstrip() for c in __import__('colab_resilience').replay_cells()]")
    assert cells == ["%%replay\nimport math\nlr = 0.01", "%%replay\nsteps = 10"]
    assert kernel.value("lr") == 0.01
