"""Exceptions raised by flowvm.

User exceptions raised inside a CALL keep their own type; flowvm only adds a
note saying where they happened.  The classes here are for errors that are
flowvm's own: a program that cannot run, a checkpoint that cannot be read.
"""

from __future__ import annotations


def rebuild_error(cls: type, args: tuple, state: dict) -> "FlowError":
    """An unpickled FlowError: its args and attributes set back without calling ``__init__``."""
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


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


class VerifyError(FlowError):
    """A program failed static verification.

    ``path`` is the path of the faulty element ("0.2.1", "" for the root) and
    ``register`` the register name at fault, when there is one.
    """

    def __init__(self, message: str, path: str = "", register: str | None = None):
        super().__init__(message)
        self.path = path
        self.register = register


class RegisterError(FlowError, KeyError):
    """A register was read before anything was stored in it."""

    def __init__(self, message: str, register: str, path: str = ""):
        super().__init__(message)
        self.register = register
        self.path = path

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class SwitchError(FlowError, LookupError):
    """A SWITCH selector value has no case and the SWITCH has no default."""

    def __init__(self, message: str, value: object, path: str = ""):
        super().__init__(message)
        self.value = value
        self.path = path


class CheckpointError(FlowError):
    """A checkpoint file cannot be written, read or trusted.

    ``path`` is the file and ``reason`` says what is wrong with it.
    """

    def __init__(self, path: object, reason: str):
        super().__init__(f"checkpoint {str(path)!r}: {reason}")
        self.path = path
        self.reason = reason
