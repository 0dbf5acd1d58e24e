"""``%resilience isolate`` behind a real Jupyter server, as JupyterLab uses it: the kernel started
through the server's REST API, every cell sent over the server's websocket, all of them at once
(what Run All does), and a worker SIGKILLed mid-training.

What a JupyterLab user would see is read off the same messages the page receives: every cell's
reply, the kernel's status messages (a kernel that dies or restarts shows up as
``execution_state`` "dead", "restarting" or "autorestarting", which is where JupyterLab's "The
kernel appears to have died" dialog comes from) and the kernel model the server reports.
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


def message(session: str, code: str) -> dict:
    return {"header": {"msg_id": uuid.uuid4().hex, "msg_type": "execute_request", "session": session,
                       "username": "test", "date": "", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}


async def run_all(url: str, kernel_id: str, sources: list[str], timeout: float = 300) -> tuple[list[dict], list[str]]:
    """Send every cell at once over the kernel's websocket, as Run All does; each cell's reply and
    text (streams, results, errors), and every execution state the kernel reported. A cell is
    done, as for JupyterLab, when its reply (shell) and its 'idle' (iopub) have both come: the
    server relays the two channels as they arrive, so a cell's last output may follow its reply."""
    ws = await websocket.websocket_connect(
        f"{url.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?token={TOKEN}")
    session = uuid.uuid4().hex
    requests = [message(session, s) for s in sources]
    for m in requests:
        ws.write_message(json.dumps(m))
    ids = {m["header"]["msg_id"]: i for i, m in enumerate(requests)}
    cells = [{"reply": None, "text": "", "idle": False} for _ in sources]
    states: list[str] = []
    deadline = time.monotonic() + timeout
    while any(c["reply"] is None or not c["idle"] for c in cells):
        raw = await asyncio.wait_for(ws.read_message(), max(1.0, deadline - time.monotonic()))
        assert raw is not None, "the server closed the websocket"
        msg = json.loads(raw)
        kind, content = msg.get("msg_type") or msg["header"]["msg_type"], msg.get("content", {})
        if kind == "status":
            states.append(content.get("execution_state"))
        i = ids.get(msg.get("parent_header", {}).get("msg_id"))
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
    assert "colab_resilience: the kernel died (killed by SIGKILL); switched to the standby kernel, replayed 3 cells" in train
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
