"""Pictures of programs: Graphviz DOT text (``to_dot``) and Mermaid flowcharts (``to_mermaid``).

One node per element, labelled as in the listing (``x = inc(x)``,
``REPEAT 3``), with edges from parent to child labelled by the child's role
(a SEQ or WEAVE index, a SWITCH case, a WHILE's ``cond``/``body``).  Each
instance marked by ``isolate`` or ``template`` is drawn as a cluster.  For a
driver, the picture shows where the run is:

- ``next``: the element the next step runs (filled yellow);
- ``running``: the containers around it (red outline, with their counters);
- ``paused``: frames of WEAVE children waiting for their turn (dashed blue),
  and ``resume``, where each of them goes on (filled light blue).

Render DOT with Graphviz: ``dot -Tsvg prog.dot -o prog.svg``; paste Mermaid
into any Markdown that renders it.

>>> from flowvm import CALL, REPEAT, Registers
>>> reg = Registers(x=0)
>>> print(to_dot(REPEAT(3, CALL(abs, reg('x')))))
digraph flowvm {
  node [fontname="monospace", fontsize=10];
  n [label="REPEAT 3", shape=box, style="rounded"];
  n_0 [label="abs(x)", shape=box];
  n -> n_0;
}
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..program.elements import SEQ, SWITCH, WEAVE, WHILE, Element
from ..program.kinds import KindTable
from ..program.paths import Path

STYLES = {
    "next": {"dot": ("filled,bold", 'fillcolor="#ffd54f", penwidth=2'),
             "mermaid": "fill:#ffd54f,stroke:#333,stroke-width:2px"},
    "running": {"dot": ("bold", 'color="#d62728", penwidth=2'), "mermaid": "stroke:#d62728,stroke-width:2px"},
    "paused": {"dot": ("dashed", 'color="#1f77b4"'), "mermaid": "stroke:#1f77b4,stroke-dasharray: 4 2"},
    "resume": {"dot": ("filled,dashed", 'fillcolor="#aec7e8", color="#1f77b4"'),
               "mermaid": "fill:#aec7e8,stroke:#1f77b4,stroke-dasharray: 4 2"},
}


def _dot_attrs(el: Element, state: str | None) -> str:
    """Node attributes: boxes for leaves, rounded boxes for containers, the driver state's style."""
    styles = [] if el.is_leaf else ["rounded"]
    extra = ""
    if state is not None:
        style, extra = STYLES[state]["dot"]
        styles.append(style)
    attrs = "shape=box"
    if styles:
        attrs += f', style="{",".join(styles)}"'
    return attrs + (f", {extra}" if extra else "")


def _split(target: Any, owner: str) -> tuple[Element, Any]:
    from ..machine.driver import Driver

    if isinstance(target, Driver):
        return target.program, target
    if isinstance(target, Element):
        return target, None
    raise TypeError(f"{owner}: expected a flowvm program or Driver, got {type(target).__name__} {target!r:.40}")


def frame_states(drv) -> dict[Path, tuple[str, str]]:
    """Path -> (state, counters comment) for every frame of a driver (see the module docstring)."""
    from ..machine.frames import comment, walk

    states: dict[Path, tuple[str, str]] = {}
    frames = drv.frames
    if drv.done or not frames:
        return states
    for path, chain, k, paused in walk(frames):
        top = k == len(chain) - 1
        state = ("resume" if top else "paused") if paused else ("next" if top else "running")
        if path not in states or state in ("next", "resume"):
            states[path] = (state, comment(chain[k]))
    return states


def _switch_edge(parent: SWITCH, i: int) -> str:
    head = len(parent.children) - len(parent.cases) - (parent.default is not None)
    if i < head:
        return "selector"
    keys = list(parent.cases)
    return f"case {keys[i - head]!r}" if i - head < len(keys) else "default"


EDGE_LABEL = KindTable("edge label", lambda parent, i: "", {
    WHILE: lambda parent, i: "cond" if i == 0 else "body",
    SWITCH: _switch_edge,
    WEAVE: lambda parent, i: str(i) if parent.weights is None else f"{i} (weight {parent.weights[i]:g})",
    SEQ: lambda parent, i: str(i),
})
"""The label of the edge from a parent to its child i, by the parent's kind: ``fn(parent, i)`` (default:
none)."""


def _edge_label(parent: Element, i: int) -> str:
    return EDGE_LABEL.of(parent)(parent, i)


def _node_id(path: Path) -> str:
    return "n" + "".join(f"_{i}" for i in path)


def _label(el: Element, limit: int) -> str:
    from ..program.printer import header

    text = header(el)
    if not el.is_leaf and text.endswith(":"):
        text = text[:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _scope_title(el: Element) -> str:
    scope = el.scope
    parts = []
    if scope.namespace is not None:
        parts.append(f"namespace {scope.namespace}")
    if scope.template is not None:
        parts.append(f"template {scope.template.rsplit('.', 1)[-1]}")
    return ", ".join(parts) or "instance"


def _title(drv) -> str:
    if drv is None:
        return ""
    if drv.done:
        return f"finished after {drv.steps} steps"
    pos = drv.position
    return f"step {drv.steps}" + (f", next: path {pos!r}" if pos is not None else "")


def to_dot(target: Any, *, name: str = "flowvm", rankdir: str = "TB", label_limit: int = 60) -> str:
    """Graphviz DOT text for a program, or for a driver with its position highlighted."""
    program, drv = _split(target, "to_dot")
    states = frame_states(drv) if drv is not None else {}
    graph_id = name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else _dot_quote(name)
    out = [f"digraph {graph_id} {{"]
    if rankdir != "TB":
        out.append(f"  rankdir={rankdir};")
    if drv is not None:
        out.append(f"  label={_dot_quote('flowvm driver: ' + _title(drv))}; labelloc=t;")
    out.append('  node [fontname="monospace", fontsize=10];')
    edges: list[str] = []
    clusters = [0]

    def visit(el: Element, path: Path, indent: str) -> None:
        if el.scope is not None:
            clusters[0] += 1
            out.append(f"{indent}subgraph cluster_{clusters[0]} {{")
            out.append(f"{indent}  label={_dot_quote(_scope_title(el))}; style=dashed;")
            inner = indent + "  "
        else:
            inner = indent
        text = _label(el, label_limit)
        state = states.get(path)
        if state is not None and state[1]:
            text += f"\n[{state[1]}]"
        attrs = _dot_attrs(el, state[0] if state is not None else None)
        out.append(f"{inner}{_node_id(path)} [label={_dot_quote(text)}, {attrs}];")
        for i, child in enumerate(el.children):
            child_path = path + (i,)
            label = _edge_label(el, i)
            suffix = f" [label={_dot_quote(label)}]" if label else ""
            edges.append(f"  {_node_id(path)} -> {_node_id(child_path)}{suffix};")
            visit(child, child_path, inner)
        if el.scope is not None:
            out.append(f"{indent}}}")

    visit(program, (), "  ")
    out.extend(edges)
    out.append("}")
    return "\n".join(out)


def _mermaid_text(text: str) -> str:
    return (text.replace("&", "#amp;").replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")
            .replace("|", "#124;").replace("\n", "<br/>"))


def to_mermaid(target: Any, *, direction: str = "TD", label_limit: int = 60) -> str:
    """A Mermaid flowchart for a program, or for a driver with its position highlighted.

    >>> from flowvm import CALL, SEQ
    >>> print(to_mermaid(SEQ([CALL(abs, -1)])))
    flowchart TD
      n(["SEQ"])
      n_0["abs(-1)"]
      n -->|"0"| n_0
    """
    program, drv = _split(target, "to_mermaid")
    states = frame_states(drv) if drv is not None else {}
    out = []
    if drv is not None:
        out.append("---")
        out.append(f"title: {json.dumps('flowvm driver: ' + _title(drv))}")  # YAML: a quoted scalar
        out.append("---")
    out.append(f"flowchart {direction}")
    edges: list[str] = []
    classes: dict[str, list[str]] = {}
    groups = [0]

    def visit(el: Element, path: Path, indent: str) -> None:
        if el.scope is not None:
            groups[0] += 1
            out.append(f'{indent}subgraph scope_{groups[0]} ["{_mermaid_text(_scope_title(el))}"]')
            inner = indent + "  "
        else:
            inner = indent
        text = _label(el, label_limit)
        state = states.get(path)
        if state is not None:
            kind, comment = state
            if comment:
                text += f"\n[{comment}]"
            classes.setdefault(kind, []).append(_node_id(path))
        quoted = f'"{_mermaid_text(text)}"'
        shape = f"[{quoted}]" if el.is_leaf else f"([{quoted}])"
        out.append(f"{inner}{_node_id(path)}{shape}")
        for i, child in enumerate(el.children):
            child_path = path + (i,)
            label = _edge_label(el, i)
            arrow = f'-->|"{_mermaid_text(label)}"|' if label else "-->"
            edges.append(f"  {_node_id(path)} {arrow} {_node_id(child_path)}")
            visit(child, child_path, inner)
        if el.scope is not None:
            out.append(f"{indent}end")

    visit(program, (), "  ")
    out.extend(edges)
    for kind, ids in classes.items():
        out.append(f"  classDef {kind} {STYLES[kind]['mermaid']}")
        out.append(f"  class {','.join(ids)} {kind}")
    return "\n".join(out)


def node_id(path: Path | str) -> str:
    """The DOT/Mermaid node id of the element at path (``n`` for the root, ``n_0_2`` for '0.2')."""
    from ..program.paths import parse_path

    return _node_id(parse_path(path))

