"""flowvm: learning algorithms as resumable, serializable control-flow programs.

>>> from flowvm import CALL, SEQ, REPEAT, Registers
>>> reg = Registers(x=0)
>>> prog = SEQ([REPEAT(3, CALL(lambda v: v + 2, reg('x'), store_to=reg('x'))), CALL(str, reg('x'))])
>>> prog.run()
'6'
"""

def _programs_beside():
    """The bundled programs are the repository's top-level programs/ folder, which the wheel installs as
    flowvm.programs.  Imported from a checkout (`python -m flowvm run pca` in its root), this package has no
    programs/ subfolder: flowvm.programs is then the folder beside it."""
    import importlib.util
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    beside = os.path.join(os.path.dirname(here), "programs")
    init = os.path.join(beside, "__init__.py")
    if (os.path.isdir(os.path.join(here, "programs")) or "flowvm.programs" in sys.modules
            or not os.path.isfile(init) or not os.path.isfile(os.path.join(beside, "..", "flowvm_cli.py"))):
        return
    spec = importlib.util.spec_from_file_location("flowvm.programs", init, submodule_search_locations=[beside])
    if importlib.util.find_spec("flowvm.programs") is not None:  # an editable install maps it already
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["flowvm.programs"] = module
    spec.loader.exec_module(module)
    setattr(sys.modules[__name__], "programs", module)


_programs_beside()

import sys  # noqa: E402

from .persist.checkpoint import load, read_header, save
from .persist.state import load_state, save_state
from .machine.driver import Driver
from .base.sentinels import INCOMPLETE, PENDING
from .program.elements import BUFFER, CALL, LOOP, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Element, Leaf
from .base.errors import (CheckpointError, CopyError, CommandError, EditError, FlowError, PassError, RegisterError, SourceError,
                          SpawnError, SpawnTimeout, SpawnVersionError, SwitchError, UnknownPassError,
                          VerifyError, SpawnVersionWarning, CopyWarning, DataError, FusionWarning, SettingsWarning,
                          WorkerError)
from .program.registers import Register, Registers
from .program.verify import verify
from .program.pylower import ProgramSyntaxError
from .program.pyfunc import SourceChanged
from .machine.depends import Depends
from .editing.edit import ANY
from .editing import hotpatch as _hotpatch  # noqa: F401  (provides the edits of half-run drivers)
from .editing.namespaces import isolate, template
from .views.dot import to_dot, to_mermaid
from .views.source import from_source, to_source
from .passes import list_passes, optimize, register_pass
from .passes.explain import explain_fusion, fused_steps
from .fused import FUSED, fusable
from .processes.leaves import POPEN, SPAWN
from .processes.named import register_executor
from .base.data import Batches
from .base.dataset import load_data
from .distributed import rank, rank0, world_size
from . import testing  # noqa: F401,E402  (flowvm.testing.assert_same_run after import flowvm)

from .base.version import __version__
from . import legacy as _legacy

_legacy.install(sys.modules[__name__])  # 0.1's and 0.2's module paths, for one release (docs/api.md)
__getattr__ = _legacy.package_getattr

__all__ = [
    "BUFFER", "CALL", "LOOP", "PRINT", "REPEAT", "SEQ", "SWITCH", "WEAVE", "WHILE", "Element",
    "Leaf", "Register", "Registers", "INCOMPLETE", "PENDING", "Driver",
    "verify", "save", "load", "read_header", "save_state", "load_state",
    "FlowError", "VerifyError", "CheckpointError", "CopyError", "RegisterError", "SwitchError",
    "optimize", "list_passes", "register_pass", "explain_fusion", "fused_steps", "PassError", "UnknownPassError", "FUSED", "fusable",
    "POPEN", "SPAWN", "CommandError", "SpawnError", "SpawnTimeout", "SpawnVersionError",
    "SpawnVersionWarning", "register_executor",
    "CopyWarning", "FusionWarning", "SettingsWarning",
    "Batches", "load_data", "DataError", "WorkerError", "rank", "world_size", "rank0",
    "Depends", "ANY", "EditError", "isolate", "template", "to_dot", "to_mermaid",
    "to_source", "from_source", "SourceError", "ProgramSyntaxError", "SourceChanged",
    "__version__",
]
