"""Run in a fresh interpreter by test_resume_anywhere.py: load a copy of a half-run program, finish it,
write what it produced.

    python resume_child.py pickle|checkpoint IN OUT [--threads N] [--block-torch] [--keep-settings]

``--block-torch`` makes ``import torch`` fail as where torch is not installed; ``--threads`` sets torch's
thread count before loading, as another machine would have it.
"""

import pickle
import sys
import warnings


class _NoTorch:
    """A finder that makes every import of torch fail, as in an environment without torch."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def main(argv):
    how, source, out = argv[:3]
    options = argv[3:]
    if "--block-torch" in options:
        sys.meta_path.insert(0, _NoTorch())
    if "--threads" in options:
        import torch

        torch.set_num_threads(int(options[options.index("--threads") + 1]))
    import flowvm
    from flowvm.testing import outcome

    result = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if how == "pickle":
                with open(source, "rb") as f:
                    drv = pickle.load(f)
                if "--keep-settings" in options:
                    drv.resume_with(settings=False)
            else:
                drv = flowvm.load(source, restore_settings="--keep-settings" not in options)
            drv.run()
            result["outcome"] = outcome(drv)
        except Exception as err:
            result["error"] = f"{type(err).__name__}: {err}"
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    result["torch_imported"] = "torch" in sys.modules
    if "torch" in sys.modules:
        result["threads"] = sys.modules["torch"].get_num_threads()
    with open(out, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
