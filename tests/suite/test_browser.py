"""The report in a real browser: headless Chromium over the DevTools protocol.

Chromium comes from Debian (scripts/install_chromium.sh installs it when `chromium` is not on PATH);
the test is skipped only when apt itself is unavailable. The page is loaded from file://, every
image must decode (naturalWidth > 0), the console must stay free of errors, no request may leave
file:/data:, and a full-page screenshot is written to <report>/screenshot.png. The first test uses a
report built from fake runs; the second builds the real report from this session's smoke runs (the
`smoke_runs` fixture of conftest.py, shared with the notebooks' invariant tests) on every `make test`.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from test_report import PNG_MAGIC, make_fake_results

from decodelab.suite import records, registry, report, runner

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install_chromium.sh"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--disable-quic", "--no-first-run",
    "--no-default-browser-check", "--mute-audio", "--hide-scrollbars", "--window-size=1280,900",
]
STEP_TIMEOUT = 30.0


def chromium_binary() -> str:
    """A Chromium that runs: on PATH already, else installed by scripts/install_chromium.sh (apt).

    Skipped only where there is no apt-get; any other failure (no rights, apt errors) fails the test.
    """
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=900)
    if done.returncode == 3:
        pytest.skip(f"cannot install Chromium: {done.stderr.strip()}")
    assert done.returncode == 0, f"{INSTALL} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page target's websocket."""

    def __init__(self, ws_url: str):
        import websocket  # websocket-client (a jupyter_server dependency)

        self.ws = websocket.create_connection(ws_url, timeout=STEP_TIMEOUT, suppress_origin=True)
        self.events: list[dict] = []
        self._id = 0

    def _receive(self) -> dict:
        message = json.loads(self.ws.recv())
        if "id" not in message:
            self.events.append(message)
        return message

    def call(self, method: str, **params) -> dict:
        self._id += 1
        call_id = self._id
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = self._receive()
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def wait_for(self, method: str, since: int = 0) -> dict:
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            for event in self.events[since:]:
                if event.get("method") == method:
                    return event
            self._receive()
        raise TimeoutError(f"no {method} event within {STEP_TIMEOUT} s")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def close(self) -> None:
        self.ws.close()


@pytest.fixture
def browser(tmp_path):
    """A headless Chromium with a fresh profile; yields a DevTools client on its first page."""
    pytest.importorskip("websocket", reason="websocket-client is needed to speak the DevTools protocol")
    binary = chromium_binary()
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    log = open(tmp_path / "chromium.log", "wb")
    proc = subprocess.Popen(
        [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--remote-debugging-address=127.0.0.1", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
    )
    client = None
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, f"chromium exited: {(tmp_path / 'chromium.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port within 60 s"
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
        with direct.open(f"http://127.0.0.1:{port}/json/list", timeout=STEP_TIMEOUT) as response:
            targets = json.load(response)
        page = next(t for t in targets if t.get("type") == "page")
        client = DevTools(page["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log", "Network"):
            client.call(f"{domain}.enable")
        yield client
    finally:
        if client is not None:
            client.close()
        # Chromium's helpers share its process group (start_new_session), so this ends all of them.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=15)
        log.close()


def load(client: DevTools, url: str) -> None:
    since = len(client.events)
    client.call("Page.navigate", url=url)
    client.wait_for("Page.loadEventFired", since)


def problems(client: DevTools) -> dict[str, list]:
    """Console errors, uncaught exceptions, failed loads, and any request that is not file: or data:."""
    found: dict[str, list] = {"console": [], "exceptions": [], "failed": [], "remote": []}
    for event in client.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            found["console"].append([a.get("value", a.get("description")) for a in params.get("args", [])])
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            found["console"].append(params["entry"].get("text"))
        elif method == "Runtime.exceptionThrown":
            found["exceptions"].append(params["exceptionDetails"].get("text"))
        elif method == "Network.loadingFailed":
            found["failed"].append(params.get("errorText"))
        elif method == "Network.requestWillBeSent":
            url = params["request"]["url"]
            if not url.startswith(("file:", "data:", "about:")):
                found["remote"].append(url)
    return found


IMAGES_JS = "Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth}))"
NO_PROBLEMS = {"console": [], "exceptions": [], "failed": [], "remote": []}


def assert_images_load(client: DevTools) -> list[dict]:
    images = client.evaluate(IMAGES_JS)
    broken = [img for img in images if not (img["complete"] and img["w"] > 0)]
    assert broken == [], broken
    return images


def screenshot(client: DevTools, index: Path) -> Path:
    """Full-page PNG of `index` written next to it as screenshot.png."""
    load(client, index.as_uri())
    size = client.call("Page.getLayoutMetrics")["cssContentSize"]
    shot = client.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                       clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
    path = index.parent / "screenshot.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def test_report_renders_offline_with_every_image_loaded(browser, tmp_path):
    root = tmp_path / "results"
    make_fake_results(root)
    index = report.build_report(root=root)

    load(browser, index.as_uri())
    assert len(assert_images_load(browser)) == 5
    text = browser.evaluate("document.body.innerText")
    for question in registry.NOTEBOOKS.values():
        assert question.question in text
    assert "decodelab run masking --profile cpu" in text

    # the linked notebook export loads too, with its output image
    link = browser.evaluate("document.querySelector('a[href=\"notebooks/speculation.html\"]').href")
    load(browser, link)
    assert assert_images_load(browser)
    assert "answer 42" in browser.evaluate("document.body.innerText")

    assert problems(browser) == NO_PROBLEMS
    shot = screenshot(browser, index)
    assert shot.read_bytes().startswith(PNG_MAGIC) and shot.stat().st_size > 10_000


SECTIONS_JS = """Array.from(document.querySelectorAll('main > section')).map(s => ({
  id: s.id, missing: s.classList.contains('missing'),
  goals: s.querySelectorAll('table.goals tbody tr').length,
  answer: (s.querySelector('p.answer') || {}).innerText || '',
  status: Array.from(s.querySelectorAll('table.goals tbody tr td:nth-child(4)')).map(td => td.innerText)}))"""


def test_report_from_smoke_runs_answers_every_question_offline(browser, smoke_runs, tmp_path):
    """The real report over every notebook's smoke run: each section has its answer and goal table,
    every image decodes, nothing is fetched, the console stays clean."""
    names = [n for n in registry.NOTEBOOKS if (records.notebooks_dir() / registry.NOTEBOOKS[n].file).is_file()]
    assert names, f"no notebook files under {records.notebooks_dir()}"
    failed = {}
    for name in names:
        try:
            smoke_runs(name)
        except runner.RunFailed as error:
            failed[name] = str(error).splitlines()[0]
    assert failed == {}, f"smoke runs failed, so the report cannot show them: {failed}"
    index = report.build_report(root=smoke_runs.root, out_dir=tmp_path / "report")

    load(browser, index.as_uri())
    assert len(assert_images_load(browser)) >= len(names)
    sections = {s["id"]: s for s in browser.evaluate(SECTIONS_JS)}
    for name in names:
        shown = sections[name]
        assert not shown["missing"], f"{name}: no successful smoke run shown"
        assert shown["goals"] >= 1, f"{name}: no goal table in its section"
        assert shown["answer"].startswith("Answer."), shown
        assert set(shown["status"]) <= {"met", "not met", "not measured", "met (moonshot)", "not met (moonshot)",
                                        "not measured (moonshot)"}, f"{name}: malformed goal rows {shown['status']}"
    links = browser.evaluate("Array.from(document.querySelectorAll('a[href^=\"notebooks/\"]')).map(a => a.href)")
    assert len(links) == len(names)
    for link in links:
        load(browser, link)
        assert_images_load(browser)
    assert problems(browser) == NO_PROBLEMS
    shot = screenshot(browser, index)
    assert shot.read_bytes().startswith(PNG_MAGIC) and shot.stat().st_size > 10_000
    kept = os.environ.get("DECODELAB_SCREENSHOT")  # where to keep a copy for a reader (tmp_path is removed)
    if kept:
        shutil.copyfile(shot, kept)
