"""`make lab`: JupyterLab on loopback with a token, the project's notebooks, the "decodelab" kernel.

One server (module fixture) started the way `make lab` starts it (notebook dir = notebooks/), on
127.0.0.1 with a random free port and a random token; every test talks to it over its REST and
websocket APIs, and the server is shut down through its API (then its process group is killed,
should it linger).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
KERNEL = "decodelab"
DISPLAY_NAME = "decodelab (Python 3)"
TIMEOUT = 60.0

requests = pytest.importorskip("requests")


def ensure_kernel() -> None:
    """Register the project kernel into this venv (what `make setup` does) when it is missing."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(KERNEL)
        return
    except NoSuchKernel:
        pass
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", KERNEL,
                    "--display-name", DISPLAY_NAME], check=True, capture_output=True, timeout=120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def same_venv(python_a: str, python_b: str) -> bool:
    """Same bin/ folder (python vs python3 in one venv are the same interpreter)."""
    return Path(python_a).absolute().parent == Path(python_b).absolute().parent


class Lab:
    def __init__(self, url: str, token: str):
        self.url, self.token = url, token
        self.session = requests.Session()
        self.session.trust_env = False  # loopback: never via a proxy from the environment
        self.session.headers["Authorization"] = f"token {token}"

    def api(self, method: str, path: str, **kwargs):
        response = self.session.request(method, f"{self.url}{path}", timeout=TIMEOUT, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    ensure_kernel()
    tmp = tmp_path_factory.mktemp("lab")
    port, token = free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        # keep the user's Jupyter config and runtime files out of it; kernelspecs still come from the venv
        "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser", f"--notebook-dir={NOTEBOOKS}",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", "--ServerApp.allow_root=True",
    ]
    log = open(tmp / "lab.log", "wb")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Lab(f"http://127.0.0.1:{port}", token)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, f"jupyter lab exited:\n{(tmp / 'lab.log').read_text()[-3000:]}"
            try:
                server.api("GET", "/api/status")
                break
            except requests.RequestException:
                assert time.monotonic() < deadline, f"jupyter lab not up in {TIMEOUT} s"
                time.sleep(0.5)
        yield server
    finally:
        try:
            server.api("POST", "/api/shutdown")  # stops kernels and the server
            proc.wait(timeout=30)
        except Exception:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        log.close()


def test_lab_requires_the_token(lab):
    anonymous = requests.Session()
    anonymous.trust_env = False
    anonymous = anonymous.get(f"{lab.url}/api/contents", timeout=TIMEOUT)
    assert anonymous.status_code == 403
    page = lab.session.get(f"{lab.url}/lab", timeout=TIMEOUT)
    assert page.status_code == 200 and "jupyter-config-data" in page.text


def test_contents_api_lists_the_project_notebooks(lab):
    listing = lab.api("GET", "/api/contents")
    listed = sorted(item["name"] for item in listing["content"] if item["type"] == "notebook")
    assert listed == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert "params" in [item["name"] for item in listing["content"] if item["type"] == "directory"]


def test_project_kernel_is_registered_with_a_clear_name(lab):
    specs = lab.api("GET", "/api/kernelspecs")["kernelspecs"]
    assert KERNEL in specs
    assert specs[KERNEL]["spec"]["display_name"] == DISPLAY_NAME
    # it runs this very interpreter (the venv), not some other python3
    assert same_venv(specs[KERNEL]["spec"]["argv"][0], sys.executable)


def test_every_notebook_opens_with_the_decodelab_kernel(lab):
    names = [p.name for p in sorted(NOTEBOOKS.glob("*.ipynb"))]
    if not names:
        pytest.skip("no notebooks yet")
    wrong = {}
    for name in names:
        model = lab.api("GET", f"/api/contents/{name}")
        kernelspec = model["content"]["metadata"].get("kernelspec", {})
        if kernelspec.get("name") != KERNEL:
            wrong[name] = kernelspec.get("name")
    assert wrong == {}, f"notebooks whose metadata.kernelspec.name is not {KERNEL!r}: {wrong}"


def execute(lab: Lab, kernel_id: str, code: str) -> tuple[str, str]:
    """Run `code` through the kernel's websocket; return (stdout, final status of the reply)."""
    import websocket  # websocket-client (a jupyter_server dependency)

    ws = websocket.create_connection(
        f"ws://127.0.0.1:{lab.url.rsplit(':', 1)[1]}/api/kernels/{kernel_id}/channels",
        header=[f"Authorization: token {lab.token}"], timeout=TIMEOUT,
    )
    try:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                       "session": uuid.uuid4().hex, "date": datetime.now(timezone.utc).isoformat(), "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }))
        stdout, reply, idle = [], None, False
        deadline = time.monotonic() + TIMEOUT
        while not (reply and idle):
            assert time.monotonic() < deadline, "no execute_reply within the timeout"
            message = json.loads(ws.recv())
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["header"]["msg_type"]
            if kind == "stream" and message["content"]["name"] == "stdout":
                stdout.append(message["content"]["text"])
            elif kind == "error":
                stdout.append("\n".join(message["content"]["traceback"]))
            elif kind == "execute_reply":
                reply = message["content"]["status"]
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                idle = True
        return "".join(stdout), reply
    finally:
        ws.close()


def test_decodelab_kernel_imports_the_package(lab):
    kernel = lab.api("POST", "/api/kernels", json={"name": KERNEL})
    try:
        assert kernel["name"] == KERNEL
        out, status = execute(lab, kernel["id"],
                              "import decodelab, sys; print(decodelab.__name__); print(sys.executable)")
        assert status == "ok", out
        name, executable = out.split()
        assert name == "decodelab"
        assert same_venv(executable, sys.executable)
    finally:
        lab.api("DELETE", f"/api/kernels/{kernel['id']}")
    assert kernel["id"] not in [k["id"] for k in lab.api("GET", "/api/kernels")]
