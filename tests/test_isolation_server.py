"""``%resilience isolate`` behind a real Jupyter server, as JupyterLab uses it: the kernel started
through the server's REST API, every cell sent over the server's websocket, all of them at once
(what Run All does), and a worker SIGKILLed mid-training.

What a JupyterLab user would see is read off the same messages the page receives: every cell's
reply, the kernel's status messages (a kernel that dies or restarts shows up as
``execution_state`` "dead", "restarting" or "autorestarting", which is where JupyterLab's "The
kernel appears to have died" dialog comes from) and the kernel model the server reports.

Also behind the same server, without isolation: two notebooks open at once (a notebook and its
copy, sessions made through the REST API as JupyterLab makes them) keep their runs apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

from harness import KERNEL_NAME, epochs, load, result, user_cells

pytest.importorskip("jupyter_server")
websocket = pytest.importorskip("tornado.websocket")

TOKEN = uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter(module: str, folder, wait: float = 60):
    """``python -m MODULE`` (jupyter_server, jupyterlab) serving ``folder`` on a free port with
    the test's token, its runtime files and configuration in ``folder``; yields its URL."""
    port = free_port()
    log_path = folder / f"{module}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", module, f"--port={port}", "--ip=127.0.0.1", "--no-browser", "--allow-root",
             f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={folder}"],
            cwd=folder, stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, JUPYTER_RUNTIME_DIR=str(folder / "runtime"), JUPYTER_CONFIG_DIR=str(folder / "config")))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + wait
        while True:
            try:
                api(url, "GET", "/api/status")
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    raise AssertionError(log_path.read_text()[-3000:]) from None
                time.sleep(0.2)
        try:
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture
def server(tmp_path):
    with jupyter("jupyter_server", tmp_path) as url:
        yield url


def api(url: str, method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"{}")


def listed_kernels(url: str) -> list[dict]:
    """The server's kernels. jupyter_server lists a kernel the moment jupyter_client has started it,
    before it sets the kernel's ``last_activity``; a listing in between answers 500 (AttributeError
    in ``kernel_model``). That race is the server's, while a page starts its kernel: ask again."""
    for attempt in range(20):
        try:
            return api(url, "GET", "/api/kernels")
        except urllib.error.HTTPError as error:
            if error.code != 500 or attempt == 19:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


def message(session: str, code: str, metadata: dict | None = None) -> dict:
    return {"header": {"msg_id": uuid.uuid4().hex, "msg_type": "execute_request", "session": session,
                       "username": "test", "date": "", "version": "5.3"},
            "parent_header": {}, "metadata": metadata or {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}


async def run_all(url: str, kernel_id: str, sources: list[str], timeout: float = 200,
                  ids: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """Send every cell at once over the kernel's websocket, as Run All does; each cell's reply and
    text (streams, results, errors), and every execution state the kernel reported. A cell is
    done, as for JupyterLab, when its reply (shell) and its 'idle' (iopub) have both come: the
    server relays the two channels as they arrive, so a cell's last output may follow its reply."""
    ws = await websocket.websocket_connect(
        f"{url.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?token={TOKEN}")
    session = uuid.uuid4().hex
    requests = [message(session, s, {"cellId": i} if i else None) for s, i in zip(sources, ids or [None] * len(sources))]
    for m in requests:
        ws.write_message(json.dumps(m))
    numbers = {m["header"]["msg_id"]: i for i, m in enumerate(requests)}
    cells = [{"reply": None, "text": "", "idle": False} for _ in sources]
    states: list[str] = []
    deadline = time.monotonic() + timeout
    while any(c["reply"] is None or not c["idle"] for c in cells):
        try:
            raw = await asyncio.wait_for(ws.read_message(), max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:  # said before pytest's own timeout, with what each cell got
            waiting = [i for i, c in enumerate(cells) if c["reply"] is None or not c["idle"]]
            raise AssertionError(f"cells {waiting} not done after {timeout} s; states {states[-20:]}; " + "; ".join(
                f"cell {i}: reply {(c['reply'] or {}).get('status')}, idle {c['idle']}, output ...{c['text'][-800:]!r}"
                for i, c in enumerate(cells))) from None
        assert raw is not None, "the server closed the websocket"
        msg = json.loads(raw)
        kind, content = msg.get("msg_type") or msg["header"]["msg_type"], msg.get("content", {})
        if kind == "status":
            states.append(content.get("execution_state"))
        i = numbers.get(msg.get("parent_header", {}).get("msg_id"))
        if i is None:
            continue
        if kind == "status" and content.get("execution_state") == "idle":
            cells[i]["idle"] = True
        elif kind == "execute_reply":
            cells[i]["reply"] = content
        elif kind == "stream":
            cells[i]["text"] += content["text"]
        elif kind in ("execute_result", "display_data"):
            cells[i]["text"] += content["data"].get("text/plain", "")
        elif kind == "error":
            cells[i]["text"] += "\n".join(content.get("traceback", []))
    ws.close()
    return cells, states


def test_run_all_in_jupyter_survives_a_worker_kill_with_no_click(server, tmp_path, reference):
    """Run All on train.ipynb with isolation on, its worker SIGKILLed in epoch 2: every cell
    replies ok in order, the kernel the page talks to never dies or restarts (no dialog), the
    server counts no restart, and the result is the uninterrupted one, bit for bit."""
    nb = load("train.ipynb", tmp_path, fault="sigkill", fault_epoch=2, staging="off")
    cells = [s for _, s in user_cells(nb)]
    assert cells[0] == "%load_ext colab_resilience"
    sources = [cells[0], "%resilience isolate", *cells[1:]]
    kernel = api(server, "POST", "/api/kernels", {"name": KERNEL_NAME, "path": str(tmp_path)})
    replies, states = asyncio.run(run_all(server, kernel["id"], sources))
    assert [c["reply"]["status"] for c in replies] == ["ok"] * len(sources), [c["text"][-2000:] for c in replies]
    train = next(c["text"] for c, s in zip(replies, sources) if s.startswith("%%resilient"))
    assert "colab_resilience: the kernel died (killed by SIGKILL); switched to the standby kernel and replayed 3 cells in " in train
    assert result(replies[-1]["text"]) == reference.result
    assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]
    assert not set(states) & {"dead", "restarting", "autorestarting", "starting"}, states
    deadline = time.monotonic() + 10  # the kernel's 'idle' follows its last reply to the server
    while (model := api(server, "GET", f"/api/kernels/{kernel['id']}"))["execution_state"] != "idle":
        assert time.monotonic() < deadline, model
        time.sleep(0.1)
    assert model["id"] == kernel["id"]
    assert [k["id"] for k in listed_kernels(server)] == [kernel["id"]]
    api(server, "DELETE", f"/api/kernels/{kernel['id']}")


async def until_restarted(url: str, kernel_id: str, source: str, cell_id: str, timeout: float = 120) -> list[str]:
    """Send one cell that kills its kernel; the execution states the page sees until the server
    says its restarter is at work ('restarting'; 'dead' where it gave up). The new kernel's own
    'starting' may come before the server's channels to it are up: cells sent after this wait for
    it, as a page's do."""
    ws = await websocket.websocket_connect(
        f"{url.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?token={TOKEN}")
    ws.write_message(json.dumps(message(uuid.uuid4().hex, source, {"cellId": cell_id})))
    states: list[str] = []
    deadline = time.monotonic() + timeout
    while not set(states) & {"restarting", "autorestarting", "dead"}:
        raw = await asyncio.wait_for(ws.read_message(), max(1.0, deadline - time.monotonic()))
        assert raw is not None, "the server closed the websocket"
        msg = json.loads(raw)
        if (msg.get("msg_type") or msg["header"]["msg_type"]) == "status":
            states.append(msg["content"].get("execution_state"))
    ws.close()
    return states


def test_each_notebook_a_jupyter_server_runs_has_runs_of_its_own(server, tmp_path):
    """Two notebooks open in one folder, the second a copy of the first (their cells have the same
    ids), as JupyterLab opens them: a session each, through the server's REST API. The server
    tells each kernel its notebook ($JPY_SESSION_NAME), and keeps it in the kernel its restarter
    starts after a death: the copy, its lr changed, trains from its start, not on from the
    original's killed run; the original, its cell run again after its kernel died, resumes its own."""
    kill = "\n    if epoch == 2 and not os.path.exists('killed'):\n        open('killed', 'w').close(); os.kill(os.getpid(), 9)"
    cells = ["%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'",
             "%%replay\nimport os\nhistory = []\nlr = {lr}",
             "%%resilient --save history\nfor epoch in resume_range(4):\n    history.append(epoch * lr)" + kill,
             "print(history, os.environ['JPY_SESSION_NAME'])"]
    ids = ["load", "set-up", "train", "show"]
    for name in ("train.ipynb", "train-Copy1.ipynb"):
        (tmp_path / name).write_text("{}")  # open in the page: there (the server does not read them here)
    sessions = {name: api(server, "POST", "/api/sessions", {"path": name, "name": name, "type": "notebook",
                                                           "kernel": {"name": KERNEL_NAME}})
                for name in ("train.ipynb", "train-Copy1.ipynb")}
    original, copy = (sessions[n]["kernel"]["id"] for n in ("train.ipynb", "train-Copy1.ipynb"))
    replies, _ = asyncio.run(run_all(server, original, [c.format(lr=1) for c in cells[:2]], ids=ids[:2]))
    assert [c["reply"]["status"] for c in replies] == ["ok"] * 2, [c["text"] for c in replies]
    states = asyncio.run(until_restarted(server, original, cells[2], "train"))
    assert "dead" not in states, states
    replies, _ = asyncio.run(run_all(server, copy, [c.format(lr=100) for c in cells], ids=ids))
    assert [c["reply"]["status"] for c in replies] == ["ok"] * 4, [c["text"] for c in replies]
    assert "colab_resilience" not in replies[2]["text"], replies[2]["text"]  # nothing resumed
    assert replies[3]["text"] == f"[0, 100, 200, 300] {tmp_path / 'train-Copy1.ipynb'}\n"
    replies, _ = asyncio.run(run_all(server, original, cells[2:], ids=ids[2:]))
    assert [c["reply"]["status"] for c in replies] == ["ok"] * 2, [c["text"] for c in replies]
    assert "continuing at 2" in replies[0]["text"], replies[0]["text"]
    assert replies[1]["text"] == f"[0, 1, 2, 3] {tmp_path / 'train.ipynb'}\n"
    for session in sessions.values():
        api(server, "DELETE", f"/api/sessions/{session['id']}")
