"""The package as users install it: the suite runs against an installed flowvm, never the source tree,
and every module's docstring examples pass."""

import doctest
import importlib
import pkgutil
import sysconfig
from pathlib import Path

import pytest

import flowvm

REPO = Path(__file__).resolve().parent.parent


def test_flowvm_is_the_installed_package():
    where = Path(flowvm.__file__).resolve()
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    assert any(s in where.parents for s in site), (
        f"the tests import flowvm from {where}, not from site-packages ({', '.join(map(str, site))}): "
        "install the wheel (README, 'Set up and pass the tests') and run pytest from the checkout")
    assert where.parent != REPO / "flowvm", "the tests import the checkout's flowvm/ folder, not the installed wheel"


def _modules():
    yield "flowvm"
    for info in pkgutil.walk_packages(flowvm.__path__, "flowvm."):
        yield info.name


def test_every_module_is_shipped_and_imports():
    # Each source file of the checkout's flowvm/ and programs/ (installed as flowvm.programs) is in the
    # installed package: a package left out of the wheel shows here.
    wanted = set()
    for folder, package in ((REPO / "flowvm", "flowvm"), (REPO / "programs", "flowvm.programs")):
        if folder.is_dir():
            wanted |= {".".join((package, *p.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__")
                       for p in folder.rglob("*.py")}
    assert wanted - set(_modules()) == set()
    importlib.import_module("flowvm_cli")  # the command's entry point, a module beside the package
    for name in _modules():
        if name.endswith("__main__"):
            continue
        importlib.import_module(name)


@pytest.mark.parametrize("name", [n for n in _modules() if not n.endswith("__main__")])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (printed above)"


def test_a_checkout_finds_its_bundled_programs_beside_the_package(tmp_path):
    # In a checkout, flowvm/ and programs/ are side by side; `python -m flowvm run pca` in its root imports
    # the flowvm/ folder, which must then find flowvm.programs in programs/.
    if not (REPO / "flowvm" / "__init__.py").is_file():
        pytest.skip("no checkout beside the tests")
    import os
    import subprocess
    import sys
    code = "import flowvm, flowvm.programs.pca as p; print(flowvm.__file__); print(p.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    package, programs = out.stdout.split()
    assert Path(package) == REPO / "flowvm" / "__init__.py"
    assert Path(programs) == REPO / "programs" / "pca.py"
