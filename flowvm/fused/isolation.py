"""Keeping a background compile from changing what the running program does.

While torch.fx traces (``torch.fx.symbolic_trace``, ``make_fx``: AOTAutograd, inductor's pattern matcher,
the direct form), its ``_Patcher`` replaces process-wide names for the length of the trace:
``torch.nn.Module.__call__`` and ``__getattr__``, the functions registered with ``torch.fx.wrap`` in their
modules, and math functions in the traced function's globals.  Made by the compile thread, such a patch
reaches the program's eager steps on the main thread: an ``nn.Sequential`` called there goes through the
tracer and raises ``NameError: module is not installed as a submodule``.

``isolate_tracing()`` (called once the compile thread exists) makes every patch the compile thread makes
thread-local: the patched name dispatches to the tracer's function on that thread, and to the original
everywhere else.  Other threads' own tracing is left as torch does it.
"""

from __future__ import annotations

import builtins
import functools
import threading
import weakref
from typing import Any, Callable

from . import torch_internals

_lock = threading.Lock()
_installed = False


def _thread_local(orig: Callable[..., Any], new: Callable[..., Any], owner: int) -> Callable[..., Any]:
    get_ident = threading.get_ident

    @functools.wraps(new)
    def dispatch(*args, **kwargs):
        if get_ident() == owner:
            return new(*args, **kwargs)
        return orig(*args, **kwargs)

    return dispatch


def isolate_tracing(thread: threading.Thread) -> bool:
    """Make torch.fx's patches made on ``thread`` visible on that thread only (once per process); whether
    torch.fx's patcher was found (False: nothing to isolate, or a torch without it)."""
    global _installed
    with _lock:
        if _installed:
            return True
        patcher = torch_internals.fx_patcher()
        if patcher is None or not hasattr(patcher, "patch") or not hasattr(patcher, "patch_method"):
            return False  # pragma: no cover - another torch layout
        patch, patch_method = patcher.patch, patcher.patch_method
        ident = lambda: thread.ident  # noqa: E731  (known once the thread runs)

        @functools.wraps(patch)
        def patch_on_one_thread(self, frame_dict, name, new_fn, deduplicate=True):
            if threading.get_ident() == ident() and callable(new_fn):
                orig = frame_dict[name] if name in frame_dict else getattr(builtins, name, None)
                if orig is not None and not getattr(orig, "__fx_already_patched", False):
                    new_fn = _thread_local(orig, new_fn, ident())
            return patch(self, frame_dict, name, new_fn, deduplicate)

        @functools.wraps(patch_method)
        def patch_method_on_one_thread(self, cls, name, new_fn, deduplicate=True):
            if threading.get_ident() == ident() and callable(new_fn):
                new_fn = _thread_local(getattr(cls, name), new_fn, ident())
            return patch_method(self, cls, name, new_fn, deduplicate)

        patcher.patch = patch_on_one_thread
        patcher.patch_method = patch_method_on_one_thread
        _installed = True
        return True


_rng_installed = False
_compile_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def isolate_random_state(thread: threading.Thread) -> None:
    """Restoring the global random generators and settings from ``thread`` becomes a no-op.

    Dynamo saves torch's and Python's global generators when it starts compiling a frame and sets them
    back when it is done (``preserve_global_state``, and eval_frame_cpp.cpp for ``random``), and inductor
    does the same around code generation (``preserve_rng_state``): they draw nothing from them, but by the
    time they set them back the program may have drawn from them on the main thread (the compile thread
    lets the program go on once the real tensors are read), and setting them back would replay those
    numbers.  The compile thread draws nothing, so leaving the generators where the program has moved
    them is exact (tests/fused/test_isolation.py checks both).  The same holds for the process-wide
    settings dynamo sets back when it is done (the default dtype, deterministic algorithms, CUDA's matmul
    precision): the program may have changed them while inductor compiled, and setting them back would
    silently undo that change."""
    global _rng_installed
    with _lock:
        _compile_threads.add(thread)
        if _rng_installed:
            return
        import torch

        def thread_aware(module, name):
            orig = getattr(module, name, None)
            if orig is None or getattr(orig, "__flowvm_isolated", False):
                return

            @functools.wraps(orig)
            def set_state(*args, **kwargs):
                if threading.current_thread() in _compile_threads:
                    return None
                return orig(*args, **kwargs)

            set_state.__flowvm_isolated = True
            setattr(module, name, set_state)

        import random

        thread_aware(random, "setstate")  # dynamo sets Python's generator back too (eval_frame_cpp.cpp)
        thread_aware(torch.random, "set_rng_state")
        thread_aware(torch, "set_rng_state")
        if hasattr(torch, "cuda"):
            thread_aware(torch.cuda, "set_rng_state")
            thread_aware(torch.cuda, "set_rng_state_all")
        # the process-wide settings dynamo's preserve_global_state sets back (grad and inference mode are
        # per thread: setting them back on the compile thread changes nothing of the program's)
        thread_aware(torch, "set_default_dtype")
        thread_aware(torch, "use_deterministic_algorithms")
        thread_aware(torch_internals.torch_c(), "_set_fp32_precision_setter")
        _rng_installed = True
