"""The documentation runs as written: every ```python block of README.md and docs/*.md, and every relative
link in them.

Each page is one test.  Its ```python blocks run in order in one fresh interpreter (``sys.executable``), in
one namespace, like the cells of a notebook, with a fresh temporary directory as the working directory; a
page never sees another page's state, nor the test process's.  A failing block is reported with its page,
its line and the traceback, whose lines point into the page itself.  Snippets that are not meant to run
(shell commands, output, pseudo-code) are indented blocks or ```text / ```bash fences, which are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGE_TIMEOUT = 240  # seconds for all the blocks of one page

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, code) for every fenced code block of a Markdown text."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, indent, start = m["fence"], len(m["indent"]), i
        body = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence) \
                    and not close["info"].strip():
                break
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            i += 1
        blocks.append((start + 1, m["info"].strip(), "\n".join(body) + "\n"))
        i += 1
    return blocks


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) for every ```python block of the page, in order."""
    return [(line, code) for line, info, code in fenced_blocks(page.read_text(encoding="utf-8"))
            if info.split()[:1] == ["python"]]


# Run in the child with `python -c`: __main__ then has no file, as in a notebook or an interactive session,
# so worker processes (SPAWN's pool) do not import anything from it.  The runner's own names are removed
# from __main__ before the first block runs, so that a block sees only what the page itself defines.
_RUNNER = r'''
def _run_page():
    import json, sys, traceback
    main = sys.modules["__main__"].__dict__
    with open(sys.argv[1], encoding="utf-8") as f:
        page, label, blocks = json.load(f)
    for name in [n for n in main if not (n.startswith("__") and n.endswith("__"))]:
        del main[name]
    for fence_line, code in blocks:
        # padded so that line numbers in tracebacks are the page's own
        source = "\n" * fence_line + code
        try:
            exec(compile(source, page, "exec"), main)
        except BaseException as err:
            sys.stdout.flush()
            print(f"\n@@ {label}: the ```python block at line {fence_line} failed:", file=sys.stderr)
            traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # from the page's own line
            sys.stderr.flush()
            sys.exit(1)
_run_page()
'''


def _label(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=_label)
def test_python_blocks_run(page: Path, tmp_path: Path):
    blocks = python_blocks(page)
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([str(page), _label(page), blocks]), encoding="utf-8")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    try:
        done = subprocess.run([sys.executable, "-c", _RUNNER, str(spec)], cwd=cwd, env=dict(os.environ),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PAGE_TIMEOUT)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        pytest.fail(f"{_label(page)}: its ```python blocks did not finish within {PAGE_TIMEOUT} s; "
                    f"output so far:\n{out[-4000:]}", pytrace=False)
    if done.returncode != 0:
        where = next((line for line in done.stderr.splitlines() if line.startswith("@@ ")), None)
        head = where[3:] if where else f"{_label(page)}: the interpreter exited with status {done.returncode}"
        pytest.fail(f"{head}\n--- stderr ---\n{done.stderr[-8000:]}\n--- stdout ---\n{done.stdout[-3000:]}",
                    pytrace=False)


# ------------------------------------------------------------------ links
_INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_EXTERNAL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text without fenced code blocks, indented code blocks and inline code (links there are not links)."""
    fenced = set()
    for line, _, code in fenced_blocks(text):
        fenced.update(range(line - 1, line + code.count("\n") + 1))
    kept = []
    in_code = False
    previous_blank = True
    for i, line in enumerate(text.splitlines()):
        blank = not line.strip()
        if i in fenced or (line.startswith("    ") and (previous_blank or in_code)):
            in_code = i not in fenced
            kept.append("")
        else:
            in_code = in_code and blank
            kept.append(line)
        previous_blank = blank
    return _INLINE_CODE.sub("", "\n".join(kept))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    seen: dict[str, int] = {}
    out = set()
    fenced = set()
    text = page.read_text(encoding="utf-8")
    for line, _, code in fenced_blocks(text):
        fenced.update(range(line - 1, line + code.count("\n") + 1))
    for i, line in enumerate(text.splitlines()):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None or i in fenced:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    text = _prose(page.read_text(encoding="utf-8"))
    return [t for t in _LINK.findall(text) + _REF_DEF.findall(text) if not _EXTERNAL.match(t)]


@pytest.mark.parametrize("page", PAGES, ids=_label)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target} (no file {where.relative_to(REPO) if REPO in where.parents else where})")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{target} (no heading with the anchor #{anchor} in {where.relative_to(REPO)})")
    assert not broken, f"{_label(page)} links to what does not exist: " + "; ".join(broken)


def test_pages_are_found():
    # the suite must not pass by finding nothing
    assert (REPO / "README.md") in PAGES and len(PAGES) > 5
    assert python_blocks(REPO / "README.md"), "README.md has no ```python block"
