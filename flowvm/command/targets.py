"""Finding a program: a target (a bundled program name, a module name or a .py file) loaded as a module, its
``--set`` options parsed against its ``build()``, and the program built; the bundled programs listed."""

from __future__ import annotations

import ast
import math
import importlib
import importlib.util
import inspect
import os
import pkgutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ..program.elements import Element
from ..base.errors import UsageError, DataError


# ------------------------------------------------------------------ targets
def is_file(target: str) -> bool:
    """Whether a target names a .py file (else a bundled program or a module)."""
    return target.endswith(".py") or os.sep in target or "/" in target


def recorded(target: str) -> str:
    """target as a checkpoint records it: a file's absolute path (found again from any directory), else as is."""
    return str(Path(target).resolve()) if is_file(target) else target


def load_module(target: str) -> ModuleType:
    """Import a program module from a bundled name, a module name or a .py path."""
    if is_file(target):
        return _load_file(Path(target))
    if not target or not all(part.isidentifier() for part in target.split(".")):
        raise UsageError(f"no program {target!r}: give a bundled program (`flowvm list`), a module name or a .py "
                         "file")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # a module in the current directory, as `python -m` would find it
    for name in (f"flowvm.programs.{target}", target):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
                raise UsageError(_missing(name, err)) from err
    raise UsageError(f"no program {target!r} (try `flowvm list`, a module name or a .py file)")


def _missing(program: str, err: ModuleNotFoundError) -> str:
    """The message for a program whose own imports fail."""
    hint = "pip install 'flowvm[torch]'" if err.name == "torch" else f"install the package that provides {err.name}"
    return f"{program} needs the module {err.name!r}, which is not installed ({hint})"


def _load_file(path: Path) -> ModuleType:
    """A program file, imported under its file name so that its objects pickle by reference."""
    path = path.resolve()
    if not path.is_file():
        raise UsageError(f"no such program file: {path}")
    bundled = _bundled_path(path.stem)
    if bundled is not None and bundled == path:
        return importlib.import_module(f"flowvm.programs.{path.stem}")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return loaded
        raise UsageError(f"cannot load {path}: a module named {name!r} is already imported from "
                         f"{getattr(loaded, '__file__', 'elsewhere')}; rename the file")
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)  # so that the file's own imports of its neighbours work
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        del sys.modules[name]
        raise UsageError(_missing(str(path), err)) from err
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _bundled_path(stem: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(f"flowvm.programs.{stem}")
    except ModuleNotFoundError:
        return None
    return Path(spec.origin).resolve() if spec is not None and spec.origin else None


def _options(build) -> tuple[dict, bool]:
    """build()'s options by name, and whether it takes any other (``build(**options)``)."""
    every = inspect.signature(build).parameters
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = {n: p for n, p in every.items() if p.kind in kinds}
    return params, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in every.values())


def _check_name(name: str, params: dict, takes_any: bool) -> None:
    if name not in params and not takes_any:
        raise UsageError(f"the program has no option {name!r}; options: {', '.join(params) or 'none'}")


def _as_option(name: str, text: str, default: Any) -> Any:
    """The --set value text (a Python literal, else a string) for an option of this default."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UsageError(f"option {name!r} is True or False, got {text!r}")
    elif isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
        raise UsageError(f"option {name!r} takes an int (default {default}), got {text!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"option {name!r} takes a number (default {default}), got {text!r}")
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"option {name!r} takes a finite number, got {text!r}")
    elif isinstance(default, str):
        value = value if isinstance(value, str) else text  # 'adam' (a quoted literal) or adam
    return value


def parse_sets(pairs: list[str], build) -> dict[str, Any]:
    """``name=value`` pairs as build() options; values are Python literals, else strings.

    A value must suit the option's default: an int option takes an int, a
    float option an int or a float, a str option any text (quoted or not:
    ``optimizer=sgd`` and ``optimizer="'sgd'"`` are the same).
    """
    params, takes_any = _options(build)
    options = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise UsageError(f"--set expects name=value, got {pair!r}")
        if not name.isidentifier():
            raise UsageError(f"--set expects name=value with a Python name, got {pair!r}")
        _check_name(name, params, takes_any)
        default = params[name].default if name in params else None  # through **options: taken as written
        options[name] = _as_option(name, text, default)
    return options


def build_program(target: str, sets: list[str], values: dict[str, Any] | None = None):
    """The program module of target and the program its build() makes with the --set options and values
    (options given as values, such as --data's path: passed as they are, never parsed)."""
    module = load_module(target)
    if not callable(getattr(module, "build", None)):
        raise UsageError(f"{module.__name__} has no build() function")
    options = parse_sets(sets, module.build)
    params, takes_any = _options(module.build)
    for name, value in (values or {}).items():
        _check_name(name, params, takes_any)
        options[name] = value
    try:
        program = module.build(**options)
    except DataError as err:  # the user's data, refused: flowvm's own error (status 2), the data named
        raise DataError(f"{_program_name(target, module)}: {err}") from None
    except (TypeError, ValueError, MemoryError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not _out_of_memory(err):
            raise
        given = " ".join([f"--set {s}" for s in sets] + [f"--{k} {v}" for k, v in (values or {}).items()])
        raise _rejected(_program_name(target, module), given or "its defaults", err) from err
    if not isinstance(program, Element):
        where = getattr(module, "__file__", None) or module.__name__
        raise UsageError(f"build() in {where} returned {type(program).__name__} {program!r:.60}, "
                         "not a flowvm program (an element such as SEQ([...]))")
    return module, program


def _rejected(name: str, given: str, err: BaseException) -> UsageError:
    """build() refused its options, or could not allocate what they ask for."""
    if isinstance(err, (MemoryError, RuntimeError)):
        return UsageError(f"{name}: build() with {given} needs more memory than this machine has "
                          f"({str(err).strip().splitlines()[-1][:200]})")
    return UsageError(f"{name}: build() rejected {given}: {type(err).__name__}: {err}")


def _out_of_memory(err: RuntimeError) -> bool:
    """torch's allocator failing (a RuntimeError, not a MemoryError)."""
    text = str(err)
    return "can't allocate memory" in text or "not enough memory" in text or "out of memory" in text.lower()


def _program_name(target: str, module: ModuleType) -> str:
    """The program as the user named it: a bundled program's name (not its path in site-packages), a module's
    name, a .py file's path."""
    if module.__name__.startswith("flowvm.programs."):
        return module.__name__.removeprefix("flowvm.programs.")
    return target


def bundled_programs() -> list[tuple[str, str, str]]:
    """(name, first docstring line, build options) of each bundled program, read without importing it."""
    from .. import programs

    out = []
    for info in sorted(pkgutil.iter_modules(programs.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        spec = importlib.util.find_spec(f"flowvm.programs.{info.name}")
        tree = ast.parse(Path(spec.origin).read_text())
        build = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build"), None)
        if build is None:
            continue
        args = build.args.args[-len(build.args.defaults):] if build.args.defaults else []
        options = " ".join(f"{a.arg}={ast.unparse(d)}" for a, d in zip(args, build.args.defaults))
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        out.append((info.name, doc[0] if doc else "", options))
    return out
