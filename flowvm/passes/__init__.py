"""The optimizer: named passes, each a Program -> Program rewrite.

``optimize(prog)`` runs the default pipeline and returns a new, equivalent
program; the original is untouched (elements are immutable, a pass builds
new containers around the same leaves).  Passes are looked up by name in a
registry; users list them, pick them, and register their own::

    fast = flowvm.optimize(prog)                                   # the default pipeline
    fast = flowvm.optimize(prog, passes=["flatten", "fuse-torch"])
    fast = flowvm.optimize(prog, options={"fuse-torch": {"form": "eager"}})

    @flowvm.register_pass("drop-prints")
    def drop_prints(program):
        ...                                                        # return a new program

With ``debug=True`` the verifier runs on the input and after every pass, and
a program that no longer verifies raises ``PassError`` naming the pass.

>>> from flowvm import CALL, SEQ, Registers
>>> reg = Registers(x=1)
>>> prog = SEQ([SEQ([CALL(abs, reg('x'), store_to=reg('y'))]), SEQ([CALL(abs, reg('y'))])])
>>> print(optimize(prog, passes=["flatten"]))
SEQ:
    y = abs(x)
    abs(y)
>>> [p.name for p in list_passes()][:3]
['flatten', 'batch-buffers', 'fuse-torch']
"""

from .registry import (DEFAULT_PIPELINE, Pass, PassContext, current_context, get_pass, list_passes,  # noqa: F401
                       optimize, register_pass, unregister_pass)
from ..base.errors import PassError, UnknownPassError  # noqa: F401

# the passes register themselves when imported
from . import flatten as _flatten  # noqa: E402,F401
from . import buffers as _buffers  # noqa: E402,F401
from . import fuse_torch as _fuse_torch  # noqa: E402,F401
