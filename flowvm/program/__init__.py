"""The program layer: registers, the elements a program is built of (and the ``Leaf`` base class),
element paths, listings, analysis and verification.  Plain data and what reads it; nothing here runs a program.

The package is also the decorator ``@flowvm.program`` (pyfunc.py): a plain Python function whose loops and
branches become a resumable program."""

import sys
import types


class _ProgramPackage(types.ModuleType):
    """This package, callable: ``flowvm.program(function)`` is ``flowvm.program.pyfunc.program(function)``."""

    def __call__(self, function):
        from .pyfunc import program

        return program(function)


sys.modules[__name__].__class__ = _ProgramPackage
