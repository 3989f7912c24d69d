"""``flowvm run PROGRAM --watch [HOST:]PORT`` and ``flowvm watch CHECKPOINT``: a live page of a running program,
with its controls.

The run stays where the command runs it: the Runner's loop in the main thread steps the driver in chunks of
about 50 ms (runner.py) and, between two chunks, calls ``Watch.between_chunks``.  The page is served by an
asyncio event loop (aiohttp) in a thread of its own, so that it answers while a long leaf runs; it never
touches the driver.  What it shows is a ``snapshot`` the main thread publishes between chunks, and only
while a page has asked for one in the last few seconds (nobody watching: one time check per chunk).  What it
asks (pause, one step, run, checkpoint now, stop, fork) is a request queued for the main thread, which
carries it out between two chunks and answers through a future.

Every control is an HTTP endpoint taking and giving JSON (docs/watch.md): ``GET /api/state``, ``POST
/api/pause``, ``/api/run``, ``/api/step``, ``/api/checkpoint``, ``/api/stop`` and ``/api/fork`` (``{"path":
..., "registers": {"lr": 0.01}}``: an exact copy of the half-run program, those registers changed, saved where
``flowvm resume`` continues it).  The server binds 127.0.0.1 unless told otherwise; bound elsewhere, each
request must carry the token the command prints (``?token=...``).
"""

from __future__ import annotations

import concurrent.futures
import json
import numbers
import queue
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..base.errors import UsageError
from ..base.version import __version__

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SNAPSHOT_EVERY = 0.25  # seconds between two snapshots while a page watches
WATCHED_FOR = 5.0  # a page that asked in the last this many seconds is watching
PAGE = Path(__file__).with_name("watchpage.html")


def parse_address(text: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (``[::1]:PORT`` for an IPv6 host) as (host, port); the host defaults to 127.0.0.1."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise UsageError(f"--watch {text}: give a port (8765) or HOST:PORT (127.0.0.1:8765)") from None
    if not 0 <= number <= 65535:
        raise UsageError(f"--watch {text}: a port is a number from 0 to 65535")
    return host or "127.0.0.1", number


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a UsageError saying why not (taken, not allowed, no such host)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise UsageError(f"--watch {host}:{port}: no such host here ({err.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(16)
    except OSError as err:
        sock.close()
        why = {98: "the port is taken by another program", 13: "this user may not open that port",
               99: "that address is not one of this machine's"}.get(err.errno, err.strerror)
        raise UsageError(f"--watch {host}:{port}: cannot serve the page there: {why}") from None
    sock.setblocking(False)
    return sock


class Request:
    """A control asked by the page, carried out by the main thread between two chunks."""

    def __init__(self, action: str, body: dict):
        self.action, self.body = action, body
        self.done: concurrent.futures.Future = concurrent.futures.Future()


class Watch:
    """The page's server and the run's side of it (see the module docstring)."""

    def __init__(self, host: str, port: int, paused: bool = False):
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise UsageError("--watch needs the page's server, aiohttp: pip install 'flowvm[watch]'") from None
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.token = None if host in LOOPBACK else secrets.token_urlsafe(16)
        self.requests: "queue.Queue[Request]" = queue.Queue()
        self.paused, self.stop_asked = paused, False
        self.snapshot: dict = {"steps": 0, "listing": "", "registers": [], "history": {}, "header": {},
                               "paused": paused, "done": False, "pages": 0}
        self.asked = 0.0  # when a page last asked for the state
        self.pages: dict[str, float] = {}  # a page's id -> when it last asked
        self.published = 0.0
        self.rate = (time.monotonic(), 0)
        self.loop = self.app_runner = None
        self.inflight = 0  # controls whose answers are not sent yet
        self.thread = threading.Thread(target=self._serve, name="flowvm-watch", daemon=True)
        self.ready = threading.Event()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/" + (f"?token={self.token}" if self.token else "")

    # ------------------------------------------------------------------ the server's thread
    def start(self) -> "Watch":
        self.thread.start()
        self.ready.wait(30)
        print(f"flowvm: watching at {self.url}", file=sys.stderr, flush=True)
        return self

    def _serve(self) -> None:
        import asyncio

        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        app = web.Application(middlewares=[self._middleware()])
        app.router.add_get("/", self._page)
        app.router.add_get("/api/state", self._state)
        for action in ("pause", "run", "step", "checkpoint", "stop", "fork"):
            app.router.add_post(f"/api/{action}", self._control(action))
        runner = self.app_runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.SockSite(runner, self.sock).start())
        self.ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        """Stop serving, once the answers to the controls already carried out (a stop's) are sent."""
        deadline = time.monotonic() + 5
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.loop is not None:
            import asyncio

            async def shut():
                await self.app_runner.cleanup()  # ends open connections after their responses
                self.loop.stop()

            asyncio.run_coroutine_threadsafe(shut(), self.loop)
        self.thread.join(5)
        self.sock.close()

    def _middleware(self):
        """Each request: the token checked (when bound beyond this machine); an error of a request's own said
        to the page as JSON, the run unharmed."""
        from aiohttp import web

        @web.middleware
        async def checked(request, handler):
            if self.token is not None and request.query.get("token") != self.token:
                return web.json_response({"error": "this page needs the token the command printed (?token=...)"},
                                         status=403)
            try:
                return await handler(request)
            except web.HTTPException:
                raise
            except Exception as err:
                return web.json_response({"error": f"{type(err).__name__}: {err}"}, status=500)

        return checked

    async def _page(self, request):
        from aiohttp import web

        return web.Response(text=PAGE.read_text(), content_type="text/html")

    async def _state(self, request):
        from aiohttp import web

        now = time.monotonic()
        self.asked = now
        page = request.query.get("page")
        if page:
            self.pages[page] = now
        self.pages = {p: t for p, t in self.pages.items() if now - t < WATCHED_FOR}
        return web.json_response(dict(self.snapshot, pages=len(self.pages)))

    def _control(self, action: str):
        from aiohttp import web

        async def handle(request):
            import asyncio

            body = {}
            if request.can_read_body:
                try:
                    body = await request.json()
                except json.JSONDecodeError:
                    return web.json_response({"error": "the request's body is no JSON"}, status=400)
                if not isinstance(body, dict):
                    return web.json_response({"error": "the request's body must be a JSON object"}, status=400)
            req = Request(action, body)
            self.inflight += 1
            try:
                self.requests.put(req)
                try:
                    answer = await asyncio.wait_for(asyncio.wrap_future(req.done), timeout=120)
                except asyncio.TimeoutError:
                    return web.json_response({"error": f"{action}: the run did not answer in 120 s"}, status=504)
                response = web.json_response(answer, status=400 if "error" in answer else 200)
                await response.prepare(request)
                await response.write_eof()
                return response
            finally:
                self.inflight -= 1

        return handle

    # ------------------------------------------------------------------ the run's side (main thread)
    def watching(self) -> bool:
        return time.monotonic() - self.asked < WATCHED_FOR

    def _due(self) -> bool:
        """Whether a snapshot is due: a page watches and the last one is SNAPSHOT_EVERY old."""
        return self.watching() and time.monotonic() - self.published >= SNAPSHOT_EVERY

    def between_chunks(self, runner) -> bool:
        """Carry out what the page asked, wait while paused, and publish a snapshot when one is due; False
        when the page stopped the run."""
        if not self.published:  # the first: what a page opened before the first chunk shows
            self.publish(runner)
        if not self.requests.empty() or self.paused:
            self._serve_requests(runner)
        if self._due():
            self.publish(runner)
        return not self.stop_asked

    def _serve_requests(self, runner) -> None:
        stop = runner.signalled
        while True:
            try:
                req = self.requests.get(timeout=0.05 if self.paused else 0)
            except queue.Empty:
                if not self.paused or self.stop_asked or stop() is not None or runner.drv.done:
                    return
                if self._due():
                    self.publish(runner)
                continue
            try:
                answer = self.carry_out(req, runner)
            except Exception as err:  # the request's fault: the run goes on as it was
                answer = {"error": f"{req.action}: {err}"}
            self.publish(runner)
            req.done.set_result(dict(answer, steps=runner.drv.steps, paused=self.paused))
            if self.stop_asked or (not self.paused and self.requests.empty()):
                return

    def carry_out(self, req: Request, runner) -> dict:
        drv = runner.drv
        if req.action == "pause":
            self.paused = True
        elif req.action == "run":
            self.paused = False
        elif req.action == "step":
            self.paused = True
            if not drv.done:
                drv.step()
        elif req.action == "checkpoint":
            if runner.ckpt is None:
                return {"error": "checkpoint: this run has no --checkpoint to save to"}
            runner.save()
            return {"saved": str(runner.ckpt)}
        elif req.action == "stop":
            self.stop_asked = True
            self.paused = False
        elif req.action == "fork":
            return fork(runner, req.body)
        return {}

    def publish(self, runner) -> None:
        from .values import describe_value

        drv = runner.drv
        now = time.monotonic()
        then, steps = self.rate
        rate = (drv.steps - steps) / (now - then) if now > then else 0.0
        self.rate = (now, drv.steps)
        registers = []
        for name in sorted(drv.registers):
            kind, text = describe_value(drv.registers[name])
            registers.append({"name": name, "type": kind, "value": text, "editable": editable(drv.registers[name])})
        self.snapshot = {
            "steps": drv.steps, "rate": rate if not self.paused else 0.0, "done": drv.done, "paused": self.paused,
            "listing": str(drv), "registers": registers, "history": history_of(drv),
            "header": {"program": runner.meta.get("target"), "options": runner.meta.get("sets", []),
                       "checkpoint": None if runner.ckpt is None else str(runner.ckpt), "flowvm": __version__,
                       "python": sys.version.split()[0], "torch": _torch_version()},
        }
        self.published = now


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    return None if torch is None else torch.__version__


def editable(value: Any) -> bool:
    """A register the page may change in a fork: a number (not a bool's other kinds) or a string."""
    return isinstance(value, (str, bool)) or (isinstance(value, numbers.Real) and not hasattr(value, "shape"))


def history_of(drv) -> dict:
    """The run's metric history as {name: [[step, value], ...]}, numbers only (what the page plots)."""
    watched = drv.watched or {}
    out = {}
    for name, points in (watched.get("points") or {}).items():
        pts = [[s, float(v)] for s, v in points if isinstance(v, numbers.Real) and not isinstance(v, bool)]
        if pts:
            out[name] = pts
    return out


def fork(runner, body: dict) -> dict:
    """An exact copy of the half-run program with the registers given changed, saved at body["path"]."""
    from copy import deepcopy

    from ..persist.formats import format_of
    from ..persist.location import Location

    drv = runner.drv
    path, changes = body.get("path"), body.get("registers") or {}
    if not isinstance(path, str) or not path:
        return {"error": "fork: give the new checkpoint's path (\"path\")"}
    if not isinstance(changes, dict):
        return {"error": "fork: \"registers\" maps register names to new values"}
    for name, value in changes.items():
        if name not in drv.registers:
            return {"error": f"fork: the run has no register {name!r}"}
        old = drv.registers[name]
        if not editable(old):
            return {"error": f"fork: register {name!r} holds {type(old).__name__}; only numbers and strings "
                             "can be changed from the page"}
        if not _same_kind(old, value):
            return {"error": f"fork: register {name!r} holds {type(old).__name__} {old!r:.40}; "
                             f"{value!r:.40} is {type(value).__name__}"}
    if Path(path).exists():
        return {"error": f"fork: {path} exists; give a new path"}
    runner.exact()  # a copy resumes exactly only off an autograd graph: step on to such a step first
    copy = deepcopy(drv)
    for name, value in changes.items():
        copy.registers[name] = float(value) if isinstance(drv.registers[name], float) else value
    place = Location.of(path)
    meta = dict(runner.meta, forked_from=None if runner.ckpt is None else str(runner.ckpt), forked_at=drv.steps)
    format_of(place).save(copy, place, key=runner.key, meta=meta)
    return {"forked": path, "at_step": drv.steps, "changed": sorted(changes)}


def _same_kind(old: Any, new: Any) -> bool:
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, str):
        return isinstance(new, str)
    if isinstance(old, numbers.Integral):
        return isinstance(new, int)
    return isinstance(new, (int, float))
