"""The main script as the default pool's workers see it: they import it again (forkserver and spawn), so a
script without an ``if __name__ == '__main__':`` guard, or one read from stdin, fails there; these say so."""

from __future__ import annotations

import os

from ..base.errors import SpawnError


def main_guard_hint() -> str:
    """A hint when the main script lacks ``if __name__ == '__main__':`` (workers re-run an unguarded script)."""
    import ast
    import sys

    missing = unimportable_main()
    if missing is not None:
        return f" Note: if the pool's workers start with forkserver or spawn, {unimportable_main_text(missing)}."
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not str(path).endswith(".py"):
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return ""
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return ""
    return (f" Note: {path} has no `if __name__ == '__main__':` guard; each new worker process imports the main "
            "script, so it runs the script's work again and fails: put that work under the guard.")


def unimportable_main() -> str | None:
    """The path a spawn or forkserver worker would run to import the main module, when no such file exists
    (a script piped on stdin: ``python - < script.py``); else None.

    Such a worker runs the main script's file again before it takes any work
    (as multiprocessing.spawn decides: a main module with a ``__spec__`` is
    imported by name instead), fails to find it and dies.
    """
    import sys

    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None \
            or getattr(sys, "frozen", False):  # a frozen application's bundler takes care of its workers
        return None
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return None  # python -c, an interactive session: the workers leave the main module alone
    from multiprocessing import process

    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None:
        path = os.path.join(process.ORIGINAL_DIR, path)
    return None if os.path.exists(path) else path


def unimportable_main_text(path: str) -> str:
    how = "was read from stdin" if os.path.basename(path) == "<stdin>" else "has no file"
    return (f"the main script {how}, so pool workers started with forkserver or spawn (never fork) cannot "
            f"import it: such a worker imports the main script again, from its file ({path!r} here, which "
            "does not exist), before it takes any work, and dies. Run the script from a file "
            "(python script.py), or give SPAWN an executor of your own")


def check_main_importable() -> None:
    path = unimportable_main()
    if path is not None:
        raise SpawnError(f"the default pool cannot start: {unimportable_main_text(path)}.")
