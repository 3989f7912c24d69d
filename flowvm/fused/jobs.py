"""A fused step as a job for a child process (flowvm/fused/outofprocess.py): its pickle, how the parent
loads the package, what the compiled call is checked against, and its key in the persistent cache of
packages (flowvm/fused/cache.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from . import cache, outofprocess, stateful
from .codegen import barrier_index
from .reads import Reads
from .refused import Refused


@dataclass
class Job:
    payload: bytes                      # what the child unpickles (never the program's data)
    load: Callable[[str], Any]          # a directory of the child's files -> the compiled step
    layouts: tuple                      # the head's inputs, as compiled
    reads: Any                          # what else the package keeps (flowvm/fused/reads.py), checked per call
    key: str | None                     # in the cache; None: not cached (see ``describe``)


def describe(el: Any, gen: Any, options: dict, args: tuple) -> Job | str:
    """The job compiling the fused step ``el`` (``gen``: its generated functions) for these inputs in a child
    process, or why it does not compile there (it compiles on the thread).  Raises when the step does not
    pickle or pickles with data.  A step running code of the user's under dynamo's guards is not cached (its
    pickle holds ids that differ between processes, and code imported by name could change under the same
    key), nor one whose modules' classes are pickled by value (a script's own)."""
    head_args = tuple(args) if gen.head_positions is None else tuple(args[k] for k in gen.head_positions)
    calls = el.calls if gen.tail is None else el.calls[:barrier_index(el.calls)]
    cacheable = True
    if outofprocess.eligible(calls, head_args):
        payload = outofprocess.job_payload(gen.head, head_args, dict(options))
        load: Callable[[str], Any] = outofprocess.load_plain
    else:
        inputs = list(el.inputs) if gen.head_positions is None else [el.inputs[k] for k in gen.head_positions]
        try:
            plan = stateful.plan(calls, inputs, head_args)
        except Refused as why:
            return str(why)
        payload = stateful.payload(plan, dict(options))
        cacheable = not plan.guarded and all(_by_reference(type(m)) for m in plan.tree)

        def load(workdir: str) -> Any:
            from .kernel import Kernel

            return Kernel(plan, workdir)
    try:  # what the package will keep besides its inputs, as the child sees it (flowvm/fused/reads.py)
        reads = Reads.capture(calls)
    except Refused as why:
        return str(why)
    layouts = tuple((type(a), a.dtype, a.device, a.shape, a.stride()) for a in head_args)
    payload = outofprocess.sized(payload)
    key = cache.key(payload) if cacheable and cache.root() is not None else None
    return Job(payload, load, layouts, reads, key)


def _by_reference(cls: type) -> bool:
    """Whether cloudpickle pickles cls by its module and name (the same bytes in every process) rather than
    by value (a class of the program's script, with an id of the process's)."""
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return False
    obj: Any = module
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    try:
        import cloudpickle

        by_value = {m.__name__ if hasattr(m, "__name__") else m for m in cloudpickle.list_registry_pickle_by_value()}
    except (ImportError, AttributeError):  # pragma: no cover - an older cloudpickle
        by_value = set()
    return obj is cls and module.__name__.split(".")[0] not in by_value and module.__name__ not in by_value


def hint(gen: Any, options: dict, args: tuple) -> str:
    """A cheap digest of what a step's key depends on most (its generated code, its inputs' layouts, the
    compiler's options and the torch settings), without pickling it: a step whose hint the cache never saw
    is not in it (``cache.may_hold``), and its first execution pays nothing for the lookup."""
    import hashlib

    from .checks import settings

    layouts = [(tuple(a.shape), tuple(a.stride()), str(a.dtype)) if hasattr(a, "stride") else type(a).__name__
               for a in args]
    text = repr((gen.source, layouts, sorted(dict(options).items()), sorted(settings().items(), key=str)))
    return hashlib.sha1(text.encode()).hexdigest()
