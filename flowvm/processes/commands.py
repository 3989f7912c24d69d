"""A POPEN's command while it runs: its arguments read from the registers, the process launched in its own
process group, its output collected (and teed to this process's stderr), and its whole group killed when the
leaf is abandoned, its driver is garbage-collected or the interpreter exits (flowvm/processes/leaves.py has
the leaf)."""

from __future__ import annotations

import codecs
import concurrent.futures as cf
import numbers
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from ..base.errors import TAIL_CHARS, CommandError
from ..program.registers import Register, resolve

if TYPE_CHECKING:
    from .leaves import POPEN

KILL_GRACE = 0.5
"""Seconds a killed POPEN's process group has between SIGTERM and SIGKILL."""


_TEXT = (str, bytes, os.PathLike)


def _source(value: Any, what: str) -> str:
    return f"{what} (register {value.name!r})" if isinstance(value, Register) else what


def _as_arg(value: Any, raw: Any, what: str) -> Any:
    """A command-line item: text and paths as they are, numbers as text; anything else is an error."""
    if isinstance(value, _TEXT):
        return value
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return str(value)
    raise TypeError(f"POPEN: {_source(raw, what)} is {type(value).__name__} {value!r:.60}; it must be "
                    "a str, bytes, path or number")


def launch_args(el: "POPEN", registers) -> tuple[list, Any, Any]:
    """argv, cwd and env of el with its Registers read, checked so that an error names the item at fault."""
    argv = [_as_arg(resolve(a, registers), a, f"argument {i}") for i, a in enumerate(el.args)]
    cwd = resolve(el.cwd, registers)
    if cwd is not None and not isinstance(cwd, _TEXT):
        raise TypeError(f"POPEN: {_source(el.cwd, 'cwd')} is {type(cwd).__name__} {cwd!r:.60}; it must be a path")
    env = resolve(el.env, registers)
    if env is not None:
        if not isinstance(env, dict):
            raise TypeError(f"POPEN: {_source(el.env, 'env')} is {type(env).__name__} {env!r:.60}; it must be "
                            "a dict of variable names to values")
        env = {(k if isinstance(k, str) else _as_arg(k, el.env, f"env name {k!r}")):
               _as_arg(v, el.env, f"env[{k!r}]") for k, v in env.items()}
    return argv, cwd, env


def _terminate(popen: subprocess.Popen, files) -> None:
    """Kill a command's process group (SIGTERM, then SIGKILL) and reap it; close its capture files."""
    try:
        if not hasattr(os, "killpg"):  # pragma: no cover - not POSIX: no process groups
            if popen.poll() is None:
                popen.kill()
        else:
            if popen.poll() is None:
                _signal_group(popen.pid, signal.SIGTERM)
                try:
                    popen.wait(KILL_GRACE)
                except subprocess.TimeoutExpired:
                    pass
            _signal_group(popen.pid, signal.SIGKILL)  # whatever of the group is left
        popen.wait()
    except Exception:  # pragma: no cover - never raise from a finalizer
        pass
    finally:
        for f in files:
            if f is not None:
                f.close()


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_then_set(popen: subprocess.Popen, future: cf.Future) -> None:
    try:
        popen.wait()
    except Exception:  # pragma: no cover
        pass
    if not future.done():
        future.set_result(None)


class _Tee:
    """Copies a command's stderr to this process's stderr as it comes, keeping its tail for error messages.

    The thread owns the pipe and closes it at end of file (once the command's
    process group is gone), so no other thread ever closes it under a read.
    """

    def __init__(self, pipe):
        self.tail = bytearray()
        self._pipe = pipe
        self._thread = threading.Thread(target=self._copy, daemon=True, name="flowvm-popen-stderr")
        self._thread.start()

    def _copy(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            fd = self._pipe.fileno()
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self.tail += chunk
                del self.tail[:-4 * TAIL_CHARS]
                try:
                    sys.stderr.write(decoder.decode(chunk))
                    sys.stderr.flush()
                except Exception:  # pragma: no cover - a closed or odd sys.stderr
                    pass
        except OSError:  # pragma: no cover
            pass
        finally:
            self._pipe.close()

    def result(self, wait: float) -> bytes:
        self._thread.join(wait)  # normally at once: the command has exited
        return bytes(self.tail)


class RunningCommand:
    """A running POPEN command: the live handle, killed with its group when dropped."""

    def __init__(self, popen, argv, out, err, text: bool):
        self.popen, self.argv, self.out, self.err, self.text = popen, argv, out, err, text
        self.tee = _Tee(popen.stderr) if popen.stderr is not None else None
        self.started = time.monotonic()
        self._future: cf.Future | None = None
        self._finalizer = weakref.finalize(self, _terminate, popen, (out, err))

    @classmethod
    def launch(cls, el: POPEN, registers) -> "RunningCommand":
        argv, cwd, env = launch_args(el, registers)
        out = tempfile.TemporaryFile() if el.capture else None
        err = tempfile.TemporaryFile() if el.capture else None
        try:
            popen = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.PIPE if el.check and not el.capture else err,
                                     start_new_session=True)
        except BaseException:
            for f in (out, err):
                if f is not None:
                    f.close()
            raise
        return cls(popen, argv, out, err, el.text)

    def ready_future(self) -> cf.Future:
        if self._future is None:
            self._future = cf.Future()
            threading.Thread(target=_wait_then_set, args=(self.popen, self._future), daemon=True,
                             name=f"flowvm-popen-{self.popen.pid}").start()
        return self._future

    def output(self) -> tuple[Any, Any]:
        texts = []
        for k, f in enumerate((self.out, self.err)):
            if f is None:  # not captured; stderr's tail is kept by the tee (for check=True's message)
                data = self.tee.result(0.5) if k == 1 and self.tee is not None else None
            else:
                f.seek(0)
                data = f.read()
            texts.append(data.decode(errors="replace") if self.text and data is not None else data)
        return texts[0], texts[1]

    def kill(self) -> None:
        self._finalizer()

    def finish(self, el: POPEN) -> Any:
        out, err = self.output()
        self._finalizer()  # the leader has exited: only reaps it and closes the files
        rc = self.popen.returncode
        if el.check and rc != 0:
            raise CommandError(rc, self.argv, out, err)
        if el.capture:
            return subprocess.CompletedProcess(self.argv, rc, out, err)
        return rc
