"""flowvm: learning algorithms as resumable, serializable control-flow programs.

>>> from flowvm import CALL, SEQ, REPEAT, Registers
>>> reg = Registers(x=0)
>>> prog = SEQ([REPEAT(3, CALL(lambda v: v + 2, reg('x'), store_to=reg('x'))), CALL(str, reg('x'))])
>>> prog.run()
'6'
"""

from .checkpoint import load, save
from .driver import Driver
from .sentinels import INCOMPLETE, PENDING
from .elements import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element, Leaf
from .errors import (CheckpointError, CommandError, EditError, FlowError, PassError, RegisterError, SourceError,
                     SpawnError, SpawnTimeout, SwitchError, UnknownPassError, VerifyError)
from .registers import Register, Registers
from .verify import verify
from .depends import Depends
from .edit import ANY
from . import hotpatch as _hotpatch  # noqa: F401  (provides the edits of half-run drivers)
from .namespaces import isolate, template
from .dot import to_dot, to_mermaid
from .source import from_source, to_source
from .passes import list_passes, optimize, register_pass
from .fused import FUSED, fusable
from .processes import POPEN, SPAWN
from .data import Batches
from . import analysis, checkpoint, testing  # noqa: F401,E402  (flowvm.testing.assert_same_run after import flowvm)

from .version import __version__

__all__ = [
    "BUFFER", "CALL", "LOOP", "PRINT", "REPEAT", "SEQ", "SWITCH", "WEAVE", "WHILE", "Element",
    "Leaf", "Register", "Registers", "INCOMPLETE", "PENDING", "Driver",
    "verify", "save", "load",
    "FlowError", "VerifyError", "CheckpointError", "RegisterError", "SwitchError",
    "optimize", "list_passes", "register_pass", "PassError", "UnknownPassError", "FUSED", "fusable",
    "POPEN", "SPAWN", "CommandError", "SpawnError", "SpawnTimeout",
    "Batches",
    "Depends", "ANY", "EditError", "isolate", "template", "to_dot", "to_mermaid",
    "to_source", "from_source", "SourceError",
    "__version__",
]
