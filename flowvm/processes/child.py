"""A SPAWN fragment's job as its worker runs it (``run_job``, and ``run_shipped`` for a fragment whose code
travels with it), and its outcome as the parent reads it (``decode_outcome``).  The parent's side is
flowvm/processes/job.py."""

from __future__ import annotations

import io
import json
import os
import pickle
import socket
import time
import traceback
import warnings

from ..base.errors import SpawnError, SpawnTimeout, SpawnVersionWarning
from .arrival import ShippedSources, check, refusal
from .starts import report_start
from ..persist.pickler import pickle_bytes
from ..program.registers import Registers


class _TrackingRegisters(Registers):
    """The child's register file: remembers which registers were written."""

    def __init__(self):
        super().__init__()
        self.written: set[str] = set()

    def __setitem__(self, name, value):
        self.written.add(name)
        dict.__setitem__(self, name, value)


class _JobUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, registers: Registers):
        super().__init__(io.BytesIO(data))
        self._registers = registers

    def persistent_load(self, pid):
        if pid == "flowvm.registers":
            return self._registers
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def run_job(payload: bytes, timeout: float | None = None) -> bytes:
    """Run in the child: the fragment over the shipped registers; its outcome as bytes.

    ("ok", value, written registers) or ("error", exception or None, traceback text, where).
    With timeout, a fragment still running that long after it started here is stopped at its next
    step boundary, and one that took longer is a SpawnTimeout too.
    """
    from ..program.analysis import writes
    from ..machine.driver import INCOMPLETE, Driver

    where = f"process {os.getpid()} on {socket.gethostname()}"
    try:
        registers = _TrackingRegisters()
        try:
            fragment, shipped, nonce = _JobUnpickler(payload, registers).load()
        except ImportError as err:
            raise SpawnError(f"the fragment refers by name to {_missing_name(err)}, which {where} cannot "
                             f"import ({type(err).__name__}: {err}): the code of installed packages travels by name, "
                             "not by value; install the package that provides it on the workers") from err
        except AttributeError as err:
            if "Can't get attribute" not in str(err):
                raise
            # a module of that name, without the name: another module or another version
            raise SpawnError(f"the fragment refers by name to something that {where} does not find ({err}): its "
                             "module there is another one, or another version, than in the parent") from err
        report_start(nonce)  # the parent counts a timeout from here, and leaves started tasks be
        dict.update(registers, shipped)
        drv = Driver(fragment)
        started = time.monotonic()
        value = drv.run(timeout=timeout)
        took = time.monotonic() - started
        if timeout is not None and (value is INCOMPLETE or took > timeout):
            how = f"stopped after {drv.steps} steps" if value is INCOMPLETE else f"finished after {took:.2f} s"
            raise SpawnTimeout(f"the fragment ran longer than the timeout of {timeout:g} s ({how}, in {where})")
        names = sorted(writes(fragment) & registers.written)
        outcome = ("ok", value, {n: registers[n] for n in names if n in registers})
        try:
            return pickle_bytes(outcome)
        except Exception as err:
            what = "its value"
            for n in names:
                try:
                    pickle_bytes(registers[n])
                except Exception:
                    what = f"register {n!r}"
                    break
            raise SpawnError(f"the fragment finished but {what} cannot be pickled to send back: "
                             f"{type(err).__name__}: {err}") from err
    except BaseException as err:  # reported as data: the future itself only fails for executor reasons
        text = "".join(traceback.format_exception(err))
        try:
            exc_bytes = pickle_bytes(err)
            pickle.loads(exc_bytes)
        except BaseException:
            err = None
        return pickle_bytes(("error", err, text, where))


def _missing_name(err: ImportError) -> str:
    return f"the module {err.name!r}" if getattr(err, "name", None) else "a module"


def run_shipped(manifest: str, payload: bytes, timeout: float | None = None) -> bytes:
    """run_job for a fragment from shipped_payload: its manifest checked first (a refusal runs nothing);
    warnings of a "warn" manifest come back with the outcome, as ("warn", texts, run_job's bytes)."""
    refusals, warned = check(manifest)
    if refusals:
        err = refusal(refusals)
        return pickle_bytes(("error", err, f"{type(err).__name__}: {err}\n",
                             f"process {os.getpid()} on {socket.gethostname()}"))
    wanted = json.loads(manifest)
    with ShippedSources(wanted.get("sources") or {}, wanted.get("source_packages") or (),
                                 wanted.get("source_files") or {}):
        outcome = run_job(payload, timeout)
    return pickle_bytes(("warn", warned, outcome)) if warned else outcome


def decode_outcome(data: bytes):
    outcome = pickle.loads(data)
    if outcome[0] == "warn":
        _, texts, data = outcome
        for text in texts:
            warnings.warn(f"flowvm: the SPAWN fragment ran although {text}", SpawnVersionWarning, stacklevel=2)
        outcome = pickle.loads(data)
    return outcome
