"""Every exception and warning class of flowvm, in one place.

User exceptions raised inside a CALL keep their own type; flowvm only adds a
note saying where they happened.  The classes here are for errors that are
flowvm's own: a program that cannot run, a checkpoint that cannot be read.
"""

from __future__ import annotations

import pickle
import signal
import subprocess

from ..pickled import stable

# how much of a failed command's stderr its CommandError quotes
TAIL_CHARS = 2000


@stable("flowvm.pickled")
def rebuild_error(cls: type, args: tuple, state: dict) -> "FlowError":
    """An unpickled FlowError: its args and attributes set back without calling ``__init__``."""
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


@stable("flowvm")
class FlowError(Exception):
    """Base class of flowvm's own errors.

    Every FlowError pickles with its type, message and attributes (``path``,
    ``register``...), whatever its ``__init__`` takes, so that one raised in
    another process (a SPAWN fragment) arrives as itself.

    >>> import pickle
    >>> err = pickle.loads(pickle.dumps(RegisterError("x holds no value", "x", "0.1")))
    >>> type(err).__name__, str(err), err.register, err.path
    ('RegisterError', 'x holds no value', 'x', '0.1')
    """

    def __reduce__(self):
        # BaseException.__reduce__ calls cls(*self.args), which fails for subclasses whose __init__
        # takes other arguments than the message (RegisterError(message, register, path)).
        return rebuild_error, (type(self), self.args, self.__dict__)


@stable("flowvm")
class VerifyError(FlowError):
    """A program failed static verification.

    ``path`` is the path of the faulty element ("0.2.1", "" for the root) and
    ``register`` the register name at fault, when there is one.
    """

    def __init__(self, message: str, path: str = "", register: str | None = None):
        super().__init__(message)
        self.path = path
        self.register = register


@stable("flowvm")
class RegisterError(FlowError, KeyError):
    """A register was read before anything was stored in it."""

    def __init__(self, message: str, register: str, path: str = ""):
        super().__init__(message)
        self.register = register
        self.path = path

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@stable("flowvm")
class SwitchError(FlowError, LookupError):
    """A SWITCH selector value has no case and the SWITCH has no default."""

    def __init__(self, message: str, value: object, path: str = ""):
        super().__init__(message)
        self.value = value
        self.path = path


@stable("flowvm")
class CheckpointError(FlowError):
    """A checkpoint file cannot be written, read or trusted.

    ``path`` is the file and ``reason`` says what is wrong with it.
    """

    def __init__(self, path: object, reason: str):
        super().__init__(f"checkpoint {str(path)!r}: {reason}")
        self.path = path
        self.reason = reason


@stable("flowvm")
class CopyError(CheckpointError, pickle.PicklingError):
    """A copy of a run (pickle, cloudpickle, deepcopy, ``flowvm.save``, a state file) is refused because it
    would not resume exactly, or cannot be written: ``where`` names what holds the value at fault (a
    register, ``"registers/loss"``; an element's frame, ``"frame of BUFFER at 0.1"``; the value in transit),
    ``reason`` says why.  ``path`` is the file being written (``"<copy>"`` for an in-memory copy).  Automatic
    saves (the command's checkpoints, ``--max-steps``, signals) never raise it: they step on to the next step
    from which the run resumes exactly (``Driver.copyable()``)."""

    def __init__(self, path: object, reason: str, where: str | None = None):
        full = reason if where is None else f"{where} {reason}"
        FlowError.__init__(self, f"cannot copy the run: {full}" if str(path) == "<copy>"
                           else f"cannot save the run to {str(path)!r}: {full}")
        self.path, self.reason, self.where = path, full, where


class UsageError(FlowError):
    """A command line the flowvm command cannot run (a bad option, a missing file): one line, status 2."""


@stable("flowvm")
class SpawnError(FlowError):
    """A SPAWN could not run its fragment: a dead worker, a cancelled task, an executor gone.

    A fragment that raises is not a SpawnError: its own exception is raised
    again in the parent, with the child's traceback as a note.
    """


@stable("flowvm")
class SpawnTimeout(SpawnError, TimeoutError):
    """A SPAWN's fragment ran longer than the SPAWN's timeout."""


@stable("flowvm")
class SpawnVersionError(SpawnError):
    """A worker refused a SPAWN fragment before running it: it has another version of a package (or of
    Python or flowvm) that the fragment's code refers to by name, or lacks one.  ``package`` names it;
    ``here`` and ``there`` are its versions in this process and on the worker (None: not installed)."""

    def __init__(self, message: str, package: str | None = None, here: str | None = None,
                 there: str | None = None):
        super().__init__(message)
        self.package, self.here, self.there = package, here, there

    def __reduce__(self):
        return type(self), (str(self), self.package, self.here, self.there)


@stable("flowvm")
class SpawnVersionWarning(RuntimeWarning):
    """A worker ran a SPAWN fragment although its version of a package differs from this process's (an
    executor registered with ``versions="warn"``)."""


@stable("flowvm")
class SourceError(FlowError, ValueError):
    """A program holds something that has no source form; ``path`` names the element."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path


@stable("flowvm")
class EditError(FlowError, LookupError):
    """An edit that cannot be made: no match, a running element, an element that cannot go there.

    ``path`` is the path of the element at fault ("" for the root).
    """

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path


@stable("flowvm")
class CommandError(FlowError, subprocess.CalledProcessError):
    """A POPEN with check=True exited with a non-zero code; the message ends with the tail of its stderr."""

    def __str__(self) -> str:
        rc = self.returncode
        if rc < 0:
            try:
                how = f"died of signal {signal.Signals(-rc).name}"
            except ValueError:
                how = f"died of signal {-rc}"
        else:
            how = f"exited with code {rc}"
        text = f"command {self.cmd!r} {how}"
        tail = self.stderr
        if isinstance(tail, bytes):
            tail = tail.decode(errors="replace")
        if tail:
            tail = tail[-TAIL_CHARS:]
            text += "; the end of its stderr:\n" + tail.rstrip("\n")
        return text


@stable("flowvm")
class PassError(FlowError):
    """A pass failed or produced a program that does not verify.

    ``pass_name`` names the pass; ``path`` and ``register`` come from the
    verifier's error when there is one.
    """

    def __init__(self, message: str, pass_name: str, path: str = "", register: str | None = None):
        super().__init__(message)
        self.pass_name = pass_name
        self.path = path
        self.register = register


@stable("flowvm")
class UnknownPassError(PassError, KeyError):
    """A pass name that is not registered, or options for a pass that is not in the pipeline (a PassError,
    and a KeyError as a failed lookup)."""

    def __str__(self) -> str:  # the message as it is (a KeyError would quote it)
        return str(self.args[0]) if self.args else ""


@stable("flowvm")
class DataError(FlowError, ValueError):
    """Data a program cannot use; the message names the file (or argument), row and column at fault."""


class WorkerError(FlowError, RuntimeError):
    """A batch could not be made in a worker process: the sample's preparation raised (the worker's
    traceback is in the message) or the worker died."""


class FusionWarning(RuntimeWarning):
    """A fused step could not be compiled and runs eagerly."""


class CopyWarning(UserWarning):
    """A copy of a run (pickle, checkpoint) leaves out something the run uses."""


class SettingsWarning(UserWarning):
    """A resumed run changed a setting of this process to the value the run was saved with."""


# Signals flowvm raises and catches itself (never seen by users), kept with the other exception classes
class Refused(Exception):
    """A value a state file cannot hold, where it is and what to do."""

    def __init__(self, where: str, what: str, hint: str = ""):
        super().__init__(f"{where} holds {what}" + (f": {hint}" if hint else ""))
        self.where, self.what = where, what


class WarmedUp(Exception):
    """Raised by the backend wrapper in the warm-up thread: compiled, nothing run."""


class StoppedDuringStartup(BaseException):
    """SIGINT or SIGTERM before the run's first step: the command stops at once (nothing ran to save)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
