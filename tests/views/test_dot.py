"""Pictures: DOT checked by Graphviz's own dot tool, Mermaid checked for its structure."""

import json
import os
import re
import shutil
import subprocess

import pytest

from flowvm import CALL, PRINT, REPEAT, SEQ, SWITCH, WEAVE, WHILE, Registers, to_dot, to_mermaid
from flowvm.views.dot import frame_states, node_id
from flowvm.program.paths import format_path, walk

import progen
import toy


def graphviz(text, fmt="json"):
    """Run Graphviz's dot on text; a missing dot fails (CI installs it) unless FLOWVM_SKIP_GRAPHVIZ=1."""
    exe = shutil.which("dot")
    if exe is None:
        if os.environ.get("FLOWVM_SKIP_GRAPHVIZ") == "1":
            pytest.skip("FLOWVM_SKIP_GRAPHVIZ=1 and Graphviz's dot is not installed")
        pytest.fail("Graphviz's `dot` is not installed: these tests check to_dot() output with it. "
                    "Install it (Debian/Ubuntu: apt-get install -y graphviz), or set FLOWVM_SKIP_GRAPHVIZ=1 "
                    "to skip them knowingly.")
    proc = subprocess.run([exe, f"-T{fmt}"], input=text.encode(), capture_output=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr.decode()
    return proc.stdout.decode()


def nodes_of(rendered_json):
    data = json.loads(rendered_json)
    return {o["name"]: o for o in data.get("objects", []) if "nodes" not in o and "label" in o}, data


def tricky_program():
    reg = Registers(x=1, s='say "hi"\\n')
    return SEQ([
        CALL(toy.pair, reg("s"), {"k": 'a"b', "\\": "{}<>|"}, store_to=reg("y")),
        WHILE(CALL(toy.below, reg("x"), 2, store_to=reg("x")), PRINT('quote " backslash \\', reg("x"))),
        SWITCH(reg("x"), {0: PRINT("zero"), "a|b": PRINT("ab")}, default=PRINT("other")),
        WEAVE(1, [REPEAT(2, CALL(toy.inc, reg("x"), store_to=reg("x"))), PRINT("p")], [2, 0.5]),
    ])


def test_dot_output_is_valid_graphviz_with_one_node_per_element_and_labels_kept():
    prog = tricky_program()
    text = to_dot(prog)
    svg = graphviz(text, "svg")
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    nodes, data = nodes_of(graphviz(text))
    assert set(nodes) == {node_id(p) for p, _ in walk(prog)}
    # dot keeps a label's backslash escapes (\\ draws one backslash), and reads \" as a quote
    label = lambda path: nodes[node_id(path)]["label"].replace("\\\\", "\\")  # noqa: E731
    assert label("0") == "y = pair(s, {'k': 'a\"b', '\\\\': '{}<>|'})"
    assert label("1.1") == "PRINT 'quote \" backslash \\\\', x"
    assert "{}&lt;&gt;|" in svg
    edges = {(data["objects"][e["tail"]]["name"], data["objects"][e["head"]]["name"]): e.get("label")
             for e in data.get("edges", [])}
    assert edges[(node_id("1"), node_id("1.0"))] == "cond"
    assert edges[(node_id("2"), node_id("2.1"))] == "case 'a|b'"
    assert edges[(node_id("2"), node_id("2.2"))] == "default"
    assert edges[(node_id("3"), node_id("3.1"))] == "1 (weight 0.5)"
    assert len(edges) == sum(1 for _ in walk(prog)) - 1


def test_a_drivers_position_running_frames_and_paused_weave_children_are_highlighted():
    reg = Registers(a=0, b=0)
    prog = SEQ([PRINT("start"), WEAVE(-1, [REPEAT(3, CALL(toy.inc, reg("a"), store_to=reg("a"))),
                                           REPEAT(3, SEQ([CALL(toy.inc, reg("b"), store_to=reg("b")),
                                                          PRINT("b")]))])])
    drv = prog.start()
    drv.run(max_steps=3)  # start, a, b: the next step runs a again; child 1 is paused before PRINT b
    states = frame_states(drv)
    assert states[(1, 0, 0)][0] == "next" and states[(1, 1, 0, 1)][0] == "resume"
    assert states[(1,)] == ("running", "0 of 2 required finished, turn of child 0")
    assert states[(1, 1)][0] == "paused"
    nodes, data = nodes_of(graphviz(to_dot(drv)))
    assert nodes[node_id("1.0.0")]["fillcolor"] == "#ffd54f"
    assert nodes[node_id("1.1.0.1")]["fillcolor"] == "#aec7e8"
    assert nodes[node_id("1")]["color"] == "#d62728" and "[0 of 2 required" in nodes[node_id("1")]["label"]
    assert "dashed" in nodes[node_id("1.1")]["style"]
    assert "fillcolor" not in nodes[node_id("0")]
    assert data["label"] == f"flowvm driver: step 3, next: path {drv.position!r}"
    drv.run()
    assert "finished after" in to_dot(drv) and frame_states(drv) == {}


def test_isolated_instances_are_clusters():
    reg = Registers(x=1)
    prog = SEQ([CALL(toy.inc, reg("x")).isolate("a"), CALL(toy.inc, reg("x")).isolate("b")])
    text = to_dot(prog)
    data = json.loads(graphviz(text))
    clusters = [o for o in data["objects"] if o.get("name", "").startswith("cluster_")]
    assert sorted(c["label"] for c in clusters) == ["namespace a", "namespace b"]
    assert "subgraph scope_1 [\"namespace a\"]" in to_mermaid(prog)


@pytest.mark.parametrize("seed", range(12))
def test_generated_programs_and_half_run_drivers_render(seed):
    prog = progen.random_program(seed, depth=5)
    drv = prog.start()
    drv.run(max_steps=seed * 3)
    for target in (prog, drv):
        nodes, _ = nodes_of(graphviz(to_dot(target, rankdir="LR")))
        assert len(nodes) == sum(1 for _ in walk(prog))


def parse_mermaid(text):
    """Nodes (id -> label), edges and classes of the flowcharts to_mermaid writes; fails on anything else."""
    lines = text.splitlines()
    if lines[0] == "---":  # front matter: YAML, as Mermaid reads it
        import yaml

        end = lines.index("---", 1)
        front = yaml.safe_load("\n".join(lines[1:end]))
        assert set(front) == {"title"} and front["title"].startswith("flowvm driver: "), front
        lines = lines[end + 1:]
    assert re.fullmatch(r"flowchart (TD|LR|BT|RL)", lines[0])
    nodes, edges, classes, depth = {}, [], {}, 0
    for line in lines[1:]:
        s = line.strip()
        if m := re.fullmatch(r'(n[_0-9]*)(\["(.*)"\]|\(\["(.*)"\]\))', s):
            label = m.group(3) if m.group(3) is not None else m.group(4)
            assert '"' not in label and "<" not in label.replace("<br/>", "")
            nodes[m.group(1)] = label
        elif m := re.fullmatch(r'(n[_0-9]*) -->(?:\|"([^"|]*)"\|)? (n[_0-9]*)', s):
            edges.append((m.group(1), m.group(3), m.group(2)))
        elif m := re.fullmatch(r'subgraph scope_\d+ \["[^"]*"\]', s):
            depth += 1
        elif s == "end":
            depth -= 1
        elif m := re.fullmatch(r"classDef (\w+) [^;]+", s):
            pass
        elif m := re.fullmatch(r"class ([n_0-9,]+) (\w+)", s):
            classes[m.group(2)] = m.group(1).split(",")
        else:
            raise AssertionError(f"unexpected Mermaid line {line!r}")
    assert depth == 0
    return nodes, edges, classes


def test_mermaid_has_every_element_and_escapes_labels():
    prog = tricky_program()
    nodes, edges, classes = parse_mermaid(to_mermaid(prog))
    assert set(nodes) == {node_id(p) for p, _ in walk(prog)} and classes == {}
    assert nodes[node_id("0")] == "y = pair(s, {'k': 'a#quot;b', '\\\\': '{}#lt;#gt;#124;'})"
    assert (node_id("2"), node_id("2.1"), "case 'a#124;b'") in edges
    assert len(edges) == len(nodes) - 1


def test_a_graph_name_that_is_no_dot_identifier_is_quoted():
    text = to_dot(SEQ([CALL(abs, -1)]), name="my-prog 2")
    assert text.startswith('digraph "my-prog 2" {')
    graphviz(text)


def test_mermaid_marks_the_drivers_position():
    prog = progen.random_program(7, depth=5)
    drv = prog.start()
    drv.run(max_steps=5)
    nodes, edges, classes = parse_mermaid(to_mermaid(drv, direction="LR"))
    assert classes["next"] == [node_id(drv.position)]
    running = {node_id(format_path(p)) for p, (s, _) in frame_states(drv).items() if s == "running"}
    assert set(classes["running"]) == running
