"""A headless Chromium driven over the DevTools protocol, for the HTML report's tests.

Chromium's ``--remote-debugging-pipe`` speaks the protocol as NUL-separated JSON on
file descriptors 3 (commands in) and 4 (replies and events out), so the standard
library is enough: no websocket client, no Selenium or chromedriver.

Also a command: ``python tests/report_browser.py report.html shot.png [width height]``
writes a screenshot of the top of a report (the README's pictures in docs/).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    env = os.environ.get("PYPTO_INDUCTOR_CHROMIUM")
    if env:
        return env
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class Browser:
    """One headless Chromium with one page; ``with Browser() as b: b.open(path)``."""

    def __init__(self, binary: str | None = None, width: int = 1280, height: int = 900,
                 timeout: float = 60.0):
        self.binary = binary or find_chromium()
        if self.binary is None:
            raise FileNotFoundError("no chromium found (apt-get install chromium)")
        self.width, self.height, self.timeout = width, height, timeout
        self.events: list[dict] = []
        self._id = 0

    def __enter__(self) -> "Browser":
        self._profile = tempfile.mkdtemp(prefix="pypto_chromium_")
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        # the protocol's fixed descriptors in the child: copies above 4 first, so moving
        # one to 3 or 4 cannot overwrite the other; 3 and 4 are kept open past exec
        high_r, high_w = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)

        def child_fds():
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--disable-extensions", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={self._profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            pass_fds=(3, 4, high_r, high_w), preexec_fn=child_fds,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in (cmd_r, out_w, high_r, high_w):
            os.close(fd)
        self._buf = b""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width,
                  height=self.height, deviceScaleFactor=1, mobile=False)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call("Browser.close")
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)
        shutil.rmtree(self._profile, ignore_errors=True)

    # --- the protocol ----------------------------------------------------------------
    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._out_r, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        seen = next((e for e in self.events if e.get("method") == method), None)
        while seen is None:
            e = self._read()
            self.events.append(e)
            if e.get("method") == method:
                seen = e
        return seen

    # --- what the tests use ----------------------------------------------------------
    def open(self, path: str | Path) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=Path(path).resolve().as_uri())
        self.wait_event("Page.loadEventFired")

    def eval(self, expression: str):
        r = self.call("Runtime.evaluate", session=True, expression=expression,
                      returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} raised: {r['exceptionDetails']}")
        return r["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions of the page so far."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')} "
                           f"{p['exceptionDetails'].get('exception', {}).get('description', '')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                        for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def requests(self) -> list[str]:
        """URLs the page asked for (the report must need nothing beyond its own file)."""
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, out: str | Path) -> Path:
        import base64

        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        out = Path(out)
        out.write_bytes(base64.b64decode(data))
        return out


if __name__ == "__main__":
    page, shot = sys.argv[1], sys.argv[2]
    w, h = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (1280, 900)
    with Browser(width=w, height=h) as b:
        b.open(page)
        print(b.screenshot(shot), b.errors())
