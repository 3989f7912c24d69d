"""flowvm: learning algorithms as resumable, serializable control-flow programs.

>>> from flowvm import CALL, SEQ, REPEAT, Registers
>>> reg = Registers(x=0)
>>> prog = SEQ([REPEAT(3, CALL(lambda v: v + 2, reg('x'), store_to=reg('x'))), CALL(str, reg('x'))])
>>> prog.run()
'6'
"""

from .checkpoint import load, save
from .driver import INCOMPLETE, Driver
from .elements import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element
from .errors import CheckpointError, FlowError, RegisterError, SwitchError, VerifyError
from .registers import Register, Registers
from .verify import verify

__version__ = "0.1.0"

__all__ = [
    "BUFFER", "CALL", "LOOP", "PRINT", "REPEAT", "SEQ", "SWITCH", "WEAVE", "WHILE", "Element",
    "Register", "Registers", "INCOMPLETE", "Driver",
    "verify", "save", "load",
    "FlowError", "VerifyError", "CheckpointError", "RegisterError", "SwitchError",
    "__version__",
]
