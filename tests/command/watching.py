"""Helpers of the watch tests: a command running with --watch, its page's URL, JSON requests to it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

from toy import COMMAND, ROOT


class Watched:
    """``flowvm ARGS --watch 127.0.0.1:0``, started; ``url`` is the page the command printed."""

    def __init__(self, *args, cwd=None, address="127.0.0.1:0"):
        self.proc = subprocess.Popen(COMMAND + [str(a) for a in args] + ["--watch", address, "--progress", "none"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd or ROOT)
        self.lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            if "watching at " in line:
                self.url = line.split("watching at ", 1)[1].strip()
                return
        self.proc.kill()
        raise AssertionError("the command printed no page address:\n" + "".join(self.lines) + self.proc.stderr.read())

    def api(self, path: str, body: dict | None = None, method: str | None = None) -> tuple[int, dict]:
        base, _, query = self.url.partition("?")
        url = base + "api/" + path + (("?" + query) if query else "")
        data = None if body is None and method != "POST" else json.dumps(body or {}).encode()
        req = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def state(self) -> dict:
        return self.api("state")[1]

    def wait(self, check, timeout: float = 60, what: str = "") -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.state()
            if check(s):
                return s
            time.sleep(0.1)
        raise AssertionError(f"waited {timeout} s for {what or check}: {self.state()}")

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, "".join(self.lines) + err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
