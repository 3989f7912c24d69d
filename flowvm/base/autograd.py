"""Whether a tensor still holds an autograd graph that a later ``backward()`` could use.

An autograd graph cannot be copied: torch pickles a tensor that has a ``grad_fn`` as a leaf that requires
grad, so a ``backward()`` through the copy runs without error and gives the parameters no gradient.  A copy of
a run taken between a forward pass and its backward would resume silently other; flowvm refuses it
(``CopyError``) and the command's automatic saves step on to where no such graph is held.

A graph is *spent* once a backward through it has freed its saved tensors (``retain_graph=False``, the
default) or once a tensor it saved was changed in place (the optimizer's step changes the parameters a
forward pass saved): torch then refuses any backward through it, in the original as in a copy, so the copy
is exact.  A loss kept in a register after its backward is therefore copied as it is.

Each node of the graph exposes its saved tensors as ``_saved_<name>`` attributes (``_raw_saved_<name>``
marks them): reading one of a spent graph raises torch's RuntimeError; reading one of a live graph gives the
tensor, or None where nothing was saved under that name.  The walk visits the whole graph from the tensor's
``grad_fn`` (a backward needs every node): one spent node makes the graph spent; a graph that saved no tensor
at all (``(w * 2).sum()``) can be run backward any number of times, so it counts as live.
"""

from __future__ import annotations

from typing import Any

__all__ = ["holds_live_graph"]


def holds_live_graph(tensor: Any) -> bool:
    """True when tensor has a ``grad_fn`` whose graph a ``backward()`` could still run through."""
    fn = tensor.grad_fn
    if fn is None:
        return False
    seen: set[int] = set()
    todo = [fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if _node_tells(node) is False:
            return False
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return True


def _node_tells(node: Any) -> bool | None:
    """False: a saved tensor of the node was freed or changed (spent); True: it holds saved tensors, all
    readable; None: it saved no tensor."""
    told = None
    for name in _saved_names(type(node)):
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed by a backward, or changed in place since
            return False
        except AttributeError:  # a name a node's class lists but does not give (a compiled graph's node)
            continue
        if isinstance(value, (list, tuple)) and any(v is not None for v in value) or \
                value is not None and not isinstance(value, (list, tuple)):
            told = True
    return told


_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(kind: type) -> tuple[str, ...]:
    names = _NAMES.get(kind)
    if names is None:
        names = tuple(n[len("_raw"):] for n in dir(kind) if n.startswith("_raw_saved_"))
        if "saved_tensors" in dir(kind):  # a custom Function's node (a compiled graph's): ctx.saved_tensors
            names = tuple(n for n in names if n != "_saved_tensors") + ("saved_tensors",)
        _NAMES[kind] = names
    return names
