"""A program's error as its author reads it: the traceback's frames of the program's own code, without the
frames of flowvm's machine that called it (as pytest hides its own with ``__tracebackhide__``).

``user_traceback(tb)`` is the traceback without flowvm's frames (for ``err.with_traceback``);
``format_user_error(err)`` is the text the command prints.  An error raised inside flowvm itself (no frame of
the user's) keeps every frame: a bug of flowvm's shows where it is.
"""

from __future__ import annotations

import os
import traceback
import types

__all__ = ["user_traceback", "format_user_error", "is_machine_file"]

_FLOWVM = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def is_machine_file(filename: str) -> bool:
    """A frame of flowvm's own code, or of the code it generates for leaves (``<flowvm CALL>``)."""
    return filename.startswith(_FLOWVM) or filename.startswith("<flowvm")


def user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """tb without flowvm's frames, or tb itself when every frame is flowvm's."""
    kept = []
    while tb is not None:
        if not is_machine_file(tb.tb_frame.f_code.co_filename):
            kept.append(tb)
        tb = tb.tb_next
    if not kept:
        return None
    new = None
    for old in reversed(kept):
        new = types.TracebackType(new, old.tb_frame, old.tb_lasti, old.tb_lineno)
    return new


def format_user_error(err: BaseException) -> str:
    """The traceback text of err (and the errors it chains), each without flowvm's frames when some frame is the
    user's, with its notes ("flowvm: while running CALL ...")."""
    te = traceback.TracebackException.from_exception(err)
    seen: set[int] = set()
    todo = [te]
    while todo:
        one = todo.pop()
        if id(one) in seen:
            continue
        seen.add(id(one))
        frames = [f for f in one.stack if not is_machine_file(f.filename)]
        if frames:
            one.stack = traceback.StackSummary.from_list(frames)
        todo.extend(x for x in (one.__cause__, one.__context__) if x is not None)
    return "".join(te.format())
