"""The lowering of a function's body (pylower.py says how control flow maps to elements): ``lower`` parses the
source, checks it, and returns a ``Plan``: a tree of element specs and one generated module holding a function
for each statement, condition and loop step, compiled with the user's file name and line numbers (a traceback
points at the user's line)."""

from __future__ import annotations

import ast
import textwrap

from .pylower import (BREAK, CONTINUE, JUMP, RETURN, VALUE, Checker, Piece, Plan, assigned_names, jumps,
                      read_names, reassigned_names, refuse)

HELPERS = ("__U", "__bound", "__iterate", "__advance")  # default arguments of every generated function
SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Pass, ast.Import, ast.ImportFrom,
          ast.Assert, ast.Raise, ast.Delete, ast.FunctionDef, ast.ClassDef, ast.Try, ast.With)
# statements that bind every name they write whenever they finish (others return their names through locals())
SURE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)


def parse(source: str, filename: str, firstlineno: int) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(source))
    ast.increment_lineno(tree, firstlineno - 1)
    fn = tree.body[0]
    if isinstance(fn, ast.AsyncFunctionDef):
        raise refuse(fn, "an async function cannot run as a resumable program", filename)
    if not isinstance(fn, ast.FunctionDef):
        raise refuse(fn, "@flowvm.program takes a function (def)", filename)
    return fn


def lower(source: str, filename: str, firstlineno: int, free: tuple[str, ...] = ()) -> Plan:
    fn = parse(source, filename, firstlineno)
    a = fn.args
    if a.vararg or a.kwarg:
        raise refuse(fn, "*args and **kwargs are not supported: name each parameter", filename)
    params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    local_names = list(dict.fromkeys(params + list(free) + assigned_names(fn.body)))
    Checker(filename, set(local_names), reassigned_names(fn, params)).check(fn)
    low = _Lowerer(filename, set(local_names))
    tree = ("seq", low.block(fn.body) + [("call", low.result(fn), None)])
    module = ast.Module(body=low.defs, type_ignores=[])
    ast.fix_missing_locations(module)
    return Plan(tree=tree, module=module, pieces=low.pieces, local_names=local_names, params=params,
                hidden=[JUMP, VALUE] + low.hidden)


class _Lowerer:
    def __init__(self, filename: str, local_names: set[str]):
        self.filename, self.locals = filename, local_names
        self.pieces: dict[str, Piece] = {}
        self.defs: list = []
        self.contexts: list[ast.withitem] = []
        self.hidden: list[str] = []
        self.loops = 0

    # -- generated functions
    def piece(self, role: str, node: ast.AST, body: list[ast.stmt], reads: list[str], writes: list[str],
              params_extra: tuple[str, ...] = (), sure: bool = True, text: str = "") -> str:
        """A generated function: parameters the locals it reads (unbound ones deleted first, so that reading
        one raises UnboundLocalError where Python would) and writes, returning what it writes."""
        name = f"_{role}_{len(self.pieces)}"
        params = list(dict.fromkeys(list(params_extra) + reads + writes))
        line = getattr(node, "lineno", 1)
        pre = [_place(ast.parse(f"if {p} is __U: del {p}").body[0], node) for p in dict.fromkeys(reads + writes)
               if p in self.locals]
        body = self._in_contexts(body, node)
        if writes:
            if sure:
                out = ast.Tuple([ast.Name(w, ast.Load()) for w in writes], ast.Load()) if len(writes) > 1 \
                    else ast.Name(writes[0], ast.Load())
            else:
                out = ast.parse(f"__bound(locals(), {tuple(writes)!r})", mode="eval").body
            body = body + [ast.Return(out)]
        args = ast.arguments(posonlyargs=[], args=[ast.arg(p) for p in params] + [ast.arg(h) for h in HELPERS],
                             kwonlyargs=[], kw_defaults=[], defaults=[ast.Name(h, ast.Load()) for h in HELPERS])
        fn = ast.FunctionDef(name=name, args=args, body=pre + body or [ast.Pass()], decorator_list=[], returns=None,
                             type_params=[])
        _locate(fn, node)
        self.defs.append(fn)
        self.pieces[name] = Piece(name, body, params, writes, role, line, text or _text(node))
        return name

    def _in_contexts(self, body: list[ast.stmt], node: ast.AST) -> list[ast.stmt]:
        for item in reversed(self.contexts):
            body = [_locate(ast.With(items=[item], body=body), node)]
        return body

    def simple(self, st: ast.stmt) -> list:
        if isinstance(st, ast.Delete) and all(isinstance(t, ast.Name) for t in st.targets):
            names = [t.id for t in st.targets if t.id in self.locals]
            body = [_locate(ast.Expr(ast.Name(n, ast.Load())), st) for n in names]
            body += [_place(ast.parse(f"{n} = __U").body[0], st) for n in names]
            return [("call", self.piece("stmt", st, body, names, names), _store(names))]
        writes = [n for n in assigned_names([st]) if n in self.locals]
        reads = read_names([st], self.locals)
        sure = isinstance(st, SURE) and not any(isinstance(s, ast.NamedExpr) for s in ast.walk(st))
        return [("call", self.piece("stmt", st, [st], reads, writes, sure=sure), _store(writes))]

    # -- blocks
    def block(self, stmts: list[ast.stmt]) -> list:
        out: list = []
        for i, st in enumerate(stmts):
            out += self.stmt(st)
            if i + 1 < len(stmts) and jumps([st]):  # the rest of the block runs only when nothing jumped
                guard = self.piece("guard", stmts[i + 1], [ast.Return(ast.Compare(
                    ast.Name(JUMP, ast.Load()), [ast.Eq()], [ast.Constant(0)]))], [], [], params_extra=(JUMP,),
                    text="(nothing jumped)")
                out.append(("switch", guard, self.block(stmts[i + 1:]), []))
                break
        return out

    def stmt(self, st: ast.stmt) -> list:
        if isinstance(st, ast.If):
            return [("switch", self.cond(st.test, st), self.block(st.body), self.block(st.orelse))]
        if isinstance(st, ast.While):
            return self.loop(st, None)
        if isinstance(st, ast.For):
            return self.loop(st, st.iter)
        if isinstance(st, ast.With) and any(isinstance(s, (ast.For, ast.While, ast.Break, ast.Continue, ast.Return))
                                            for s in ast.walk(st)):
            self.contexts += st.items
            try:
                return self.block(st.body)
            finally:
                del self.contexts[-len(st.items):]
        if isinstance(st, ast.Break):
            return [("call", self.jump(st, BREAK), JUMP)]
        if isinstance(st, ast.Continue):
            return [("call", self.jump(st, CONTINUE), JUMP)]
        if isinstance(st, ast.Return):
            value = st.value or ast.Constant(None)
            body = [_locate(ast.Return(ast.Tuple([value, ast.Constant(RETURN)], ast.Load())), st)]
            return [("call", self.piece("return", st, body, read_names([value], self.locals), []),
                     (VALUE, JUMP))]
        if isinstance(st, SIMPLE):
            return self.simple(st)
        raise refuse(st, f"{type(st).__name__} statements are not supported in @flowvm.program", self.filename)

    def jump(self, st: ast.stmt, code: int) -> str:
        return self.piece("jump", st, [_locate(ast.Return(ast.Constant(code)), st)], [], [])

    def cond(self, test: ast.expr, node: ast.stmt, loop: bool = False) -> str:
        """A condition's function: True or False (a SWITCH's case key); a loop's is False once a jump is set."""
        body = [_locate(ast.Return(ast.IfExp(test, ast.Constant(True), ast.Constant(False))), node)]
        if loop:
            body = [_place(ast.parse(f"if {JUMP}: return False").body[0], node)] + body
        return self.piece("cond", node, body, read_names([test], self.locals), [],
                          params_extra=(JUMP,) if loop else (), text=ast.unparse(test))

    def loop(self, st, iterable) -> list:
        self.loops += 1
        k = self.loops
        before, body = [], []
        if iterable is None:
            cond, stored = self.cond(st.test, st, loop=True), None
        else:
            it, nx = f"__it{k}", f"__nx{k}"
            self.hidden += [it, nx]
            make = [_locate(ast.Return(ast.Call(ast.Name("__iterate", ast.Load()), [iterable], [])), st)]
            before.append(("call", self.piece("iter", st, make, read_names([iterable], self.locals), [],
                                              text=f"iter({ast.unparse(iterable)})"), it))
            cond, stored = self.piece("next", st, [_locate(ast.Return(ast.Call(ast.Name("__advance", ast.Load()),
                                                                                 [ast.Name(it, ast.Load()),
                                                                                  ast.Name(JUMP, ast.Load())], [])),
                                                          st)], [], [], params_extra=(JUMP, it),
                                  text=f"next({ast.unparse(iterable)})"), nx
            bind = _locate(ast.Assign([st.target], ast.Attribute(ast.Name(nx, ast.Load()), "value", ast.Load())), st)
            writes = [n for n in assigned_names([bind]) if n in self.locals]
            body.append(("call", self.piece("bind", st, [bind], [], writes, params_extra=(nx,),
                                            text=f"{ast.unparse(st.target)} = next(...)"), _store(writes)))
        body += self.block(st.body)
        if _has_own(st.body, ast.Continue):
            body.append(("call", self._reset(st, CONTINUE), JUMP))
        after = [("call", self._reset(st, BREAK), JUMP)] if _has_own(st.body, ast.Break) else []
        return before + [("while", cond, stored, body)] + after

    def _reset(self, st, code: int) -> str:
        body = [_locate(ast.Return(ast.IfExp(ast.Compare(ast.Name(JUMP, ast.Load()), [ast.Eq()], [ast.Constant(code)]),
                                             ast.Constant(0), ast.Name(JUMP, ast.Load()))), st)]
        return self.piece("reset", st, body, [], [], params_extra=(JUMP,), text=f"(end of {'break' if code == BREAK else 'continue'})")

    def result(self, fn: ast.FunctionDef) -> str:
        end = fn.body[-1]
        body = [ast.Return(ast.Name(VALUE, ast.Load()))]
        return self.piece("result", ast.copy_location(ast.Pass(), end), [_locate(body[0], end)], [],
                          [], params_extra=(VALUE,), text="return")


def _has_own(stmts, kind) -> bool:
    """Whether a break or continue of this loop's own is in stmts (not one of a nested loop)."""
    for st in stmts:
        if isinstance(st, kind):
            return True
        if isinstance(st, ast.If) and (_has_own(st.body, kind) or _has_own(st.orelse, kind)):
            return True
        if isinstance(st, ast.With) and _has_own(st.body, kind):
            return True
    return False


def _store(names: list[str]):
    return None if not names else names[0] if len(names) == 1 else tuple(names)


def _locate(node, at):
    for sub in ast.walk(node):
        if "lineno" in sub._attributes:
            sub.lineno = getattr(sub, "lineno", None) or at.lineno
            sub.end_lineno = getattr(sub, "end_lineno", None) or getattr(at, "end_lineno", at.lineno)
            sub.col_offset = getattr(sub, "col_offset", None) or 0
            sub.end_col_offset = getattr(sub, "end_col_offset", None) or 0
    return node


def _place(node, at):
    """node (a generated snippet) placed at the line of ``at``."""
    for sub in ast.walk(node):
        if "lineno" in sub._attributes:
            sub.lineno, sub.end_lineno = at.lineno, getattr(at, "end_lineno", at.lineno)
            sub.col_offset, sub.end_col_offset = 0, 0
    return node


def _text(node) -> str:
    try:
        return ast.unparse(node).splitlines()[0]
    except Exception:  # pragma: no cover
        return type(node).__name__


__all__ = ["lower", "parse", "HELPERS"]
