"""The documentation runs as written: every ```python block of README.md and docs/*.md, and every relative
link in them.

Each page is one test.  Its ```python blocks run in order as ONE script, as a user pastes them into a file
and runs it (``python page.py``, in a fresh interpreter, with a fresh temporary directory as the working
directory); a page never sees another page's state, nor the test process's.  The script keeps the page's
line numbers, so a failure's traceback points into the page itself.  A page whose blocks use what earlier
blocks define says so at its top.  Snippets that are not meant to run
(shell commands, output, pseudo-code) are indented blocks or ```text / ```bash fences, which are not run.
"""

from __future__ import annotations

import ast
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


def page_script(page: Path) -> str:
    """The page's ```python blocks as one script, as a user pastes them into a file in order: each block's
    code on the page's own lines (the lines between blocks blank), so a traceback's line numbers are the
    page's."""
    lines: list[str] = []
    for fence_line, code in python_blocks(page):
        lines += [""] * (fence_line - len(lines))  # the fence itself, and what is before it, blank
        lines += code.splitlines()
    return "\n".join(lines) + "\n"


def _label(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=_label)
def test_python_blocks_run(page: Path, tmp_path: Path):
    """The page's blocks run as ONE script (python page.py: its __main__ has a file, so the pool workers of
    SPAWN import it again, as they do a user's script), in a fresh temporary working directory."""
    script = tmp_path / f"{page.stem.lower()}_page.py"
    script.write_text(page_script(page), encoding="utf-8")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=cwd, env=dict(os.environ),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PAGE_TIMEOUT)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        pytest.fail(f"{_label(page)}: its ```python blocks did not finish within {PAGE_TIMEOUT} s; "
                    f"output so far:\n{out[-4000:]}", pytrace=False)
    if done.returncode != 0:
        at = re.findall(rf'File "{re.escape(str(script))}", line (\d+)', done.stderr)
        where = f" (the page's line {at[-1]})" if at else ""
        pytest.fail(f"{_label(page)}: its ```python blocks, run as one script, exited with status "
                    f"{done.returncode}{where}\n--- stderr ---\n{done.stderr[-8000:]}\n--- stdout ---\n"
                    f"{done.stdout[-3000:]}", pytrace=False)


# ------------------------------------------------------------------ pages whose blocks build on each other
IN_ORDER = "The code blocks of this page run in order, as one script"


def _bound(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def borrowed_names(page: Path) -> dict[int, set[str]]:
    """The blocks (by their fence's line) that use a name only an earlier block of the page defines."""
    earlier: set[str] = set()
    found = {}
    for line, code in python_blocks(page):
        tree = ast.parse(code)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        borrowed = (used - _bound(tree)) & earlier
        if borrowed:
            found[line] = borrowed
        earlier |= _bound(tree)
    return found


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=_label)
def test_pages_whose_blocks_build_on_each_other_say_so_at_the_top(page: Path):
    head = "\n".join(page.read_text(encoding="utf-8").splitlines()[:8])
    borrowed = borrowed_names(page)
    if borrowed:
        line, names = next(iter(borrowed.items()))
        assert IN_ORDER in head, (f"{_label(page)}: the block at line {line} uses {sorted(names)} from earlier "
                                  f"blocks; say near the top: '{IN_ORDER}...'")
    else:
        assert IN_ORDER not in head, f"{_label(page)}: its blocks stand alone, yet the top says they do not"


def test_the_check_of_borrowed_names_finds_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n```python\nimport math\nx = 1\n```\n```python\ny = x + math.pi\nfor i in [1]:\n"
                    "    print(i, len([y]))\n```\n")
    assert borrowed_names(page) == {6: {"x", "math"}}
    assert page_script(page).splitlines()[6] == "y = x + math.pi"


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


def test_every_pip_install_of_an_extra_quotes_its_brackets():
    # zsh expands unquoted brackets (pip install flowvm[torch] fails there with "no matches found")
    unquoted = re.compile(r"pip install[^\n`]*?(?<!['\"\w])[\w.\-/]+\[[\w,]+\]")
    found = [f"{_label(page)}: {m.group(0)}" for page in PAGES
             for m in unquoted.finditer(page.read_text(encoding="utf-8"))]
    found += [f"{p.relative_to(REPO)}: {m.group(0)}" for folder in ("flowvm", "programs")
              for p in (REPO / folder).rglob("*.py") for m in unquoted.finditer(p.read_text(encoding="utf-8"))]
    assert not found, "unquoted extras: " + "; ".join(found)
    assert unquoted.search("pip install flowvm[torch]") and not unquoted.search("pip install 'flowvm[torch]'")
