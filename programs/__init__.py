"""Learning algorithms written as flowvm programs, one module each.

Each module has ``build(**options)`` returning a program with sensible
defaults, ``SHOW`` (register names worth showing while it runs) and
``report(registers)`` (a one-paragraph summary of the result).  Those that fit
a model to data take the user's data as ``build(data=...)`` (see
``flowvm.load_data``) and give the fitted model of a finished run as
``model(registers)``, with scikit-learn's attribute names where there are such.
"""

import numbers as _numbers


def check_options(program: str, counts: dict | None = None, positive: dict | None = None) -> None:
    """Raise ValueError/TypeError naming the program and the option, for counts that are not ints >= 1
    and for numbers that are not > 0 (None allowed: a default chosen later)."""
    for name, value in (counts or {}).items():
        if isinstance(value, bool) or not isinstance(value, _numbers.Integral):
            raise TypeError(f"{program}: {name} must be an int >= 1, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{program}: {name} must be >= 1, got {value}")
    for name, value in (positive or {}).items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, _numbers.Real):
            raise TypeError(f"{program}: {name} must be a number > 0, got {type(value).__name__} {value!r}")
        if not value > 0:
            raise ValueError(f"{program}: {name} must be > 0, got {value}")


def batch_options(program: str, workers, prefetch) -> dict:
    """``Batches``' ``workers`` and ``prefetch`` options of a program (``--set workers=N``), checked: an int
    >= 0 and an int >= 1, else ValueError/TypeError naming the program and the option.  Any number of workers
    serves the same batches in the same order (``flowvm.Batches``), so the option changes speed only.

    >>> batch_options("mlp", 2, 2)
    {'workers': 2, 'prefetch': 2}
    """
    if isinstance(workers, bool) or not isinstance(workers, _numbers.Integral):
        raise TypeError(f"{program}: workers must be an int >= 0, got {type(workers).__name__} {workers!r}")
    if workers < 0:
        raise ValueError(f"{program}: workers must be >= 0 (0: batches made in the program's own thread), "
                         f"got {workers}")
    check_options(program, counts=dict(prefetch=prefetch))
    return {"workers": int(workers), "prefetch": int(prefetch)}


def plural(n: int, word: str) -> str:
    """``1 batch``, ``2 batches``, ``1 sample``, ``3 samples``: a count and the word it counts.

    >>> plural(1, "batch"), plural(2, "batch"), plural(0, "sample")
    ('1 batch', '2 batches', '0 samples')
    """
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}es" if word.endswith(("s", "x", "ch", "sh")) else f"{n} {word}s"


class Rows:
    """The rows of an array in batches of ``size``, one pass (the last batch may be smaller); its position
    is one int (plain data), so a run resumes at the batch it stopped at."""

    def __init__(self, x, size: int):
        self.x = x
        self.size = int(size)
        self.batches = -(-len(x) // self.size)
        self.position = 0

    def next(self):
        import numpy as np

        start = self.position * self.size
        self.position += 1
        return np.asarray(self.x[start:start + self.size], dtype=np.float64)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


MODEL_SUFFIXES = (".npz", ".pt", ".safetensors")


def model_attributes(model) -> dict:
    """A fitted model's attributes as scikit-learn names them (those ending in ``_``, its class's properties
    so named included), by name."""
    found = {name: value for name, value in vars(model).items() if name.endswith("_") and not name.startswith("_")}
    for cls in type(model).__mro__:
        for name, member in vars(cls).items():
            if isinstance(member, property) and name.endswith("_") and not name.startswith("_"):
                found.setdefault(name, getattr(model, name))
    return found


def model_arrays(model) -> dict:
    """The arrays an ``.npz`` or ``.safetensors`` file of the model holds: each attribute under its name, a
    list of arrays (an MLP's ``coefs_``) as one array per item (``coefs_0``, ``coefs_1``, ...); a torch
    module without such attributes: its ``state_dict``."""
    import numpy as np

    arrays = {}
    for name, value in model_attributes(model).items():
        if isinstance(value, (list, tuple)) and value and all(np.ndim(_numpy(v)) > 0 for v in value):
            arrays.update({f"{name}{i}": _numpy(v) for i, v in enumerate(value)})
        else:
            arrays[name] = np.asarray(_numpy(value))
    if not arrays and _is_module(model):
        arrays = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    return arrays


def _numpy(value):
    import numpy as np

    detach = getattr(value, "detach", None)
    return detach().cpu().numpy() if callable(detach) else np.asarray(value)


def _is_module(model) -> bool:
    return any(c.__module__.startswith("torch.nn") for c in type(model).__mro__)


def _torch_plain(value):
    """A value torch.load reads with its defaults (weights_only): tensors, lists, numbers, strings."""
    import numpy as np
    import torch

    if isinstance(value, (list, tuple)):
        return [_torch_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    array = np.asarray(value)
    if array.dtype.kind in "US":  # text (class names): a list of str
        return array.tolist()
    return array.item() if array.ndim == 0 and array.dtype.kind in "biuf" else torch.from_numpy(np.array(array))


def save_model(model, path) -> None:
    """Write a program's fitted model: ``.npz`` holds its attributes under their names (``components_``,
    ``cluster_centers_``, ...: ``numpy.load(path)["components_"]``; a list of arrays as one array per item,
    ``coefs_0``, ``coefs_1``, ...); ``.safetensors`` the same as tensors (text, such as class names in
    ``classes_``, as JSON in the file's metadata); ``.pt`` a dict that plain
    ``torch.load(path)`` reads (tensors, lists and numbers only): the attributes, and for a torch module its
    ``state_dict`` under ``"state_dict"`` (rebuild the module and ``load_state_dict`` it)."""
    from pathlib import Path

    import numpy as np

    suffix = Path(path).suffix.lower()
    if suffix not in MODEL_SUFFIXES:
        raise ValueError(f"save_model: {path}: give a file ending in {', '.join(MODEL_SUFFIXES)}")
    if suffix == ".pt":
        import torch

        data = {k: _torch_plain(v) for k, v in model_attributes(model).items()}
        if _is_module(model):
            data["state_dict"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        torch.save(data, path)
        return
    arrays = model_arrays(model)
    if suffix == ".npz":
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    else:
        import json

        from safetensors.numpy import save_file

        text = {k: json.dumps(v.tolist()) for k, v in arrays.items() if v.dtype.kind in "US"}  # class names
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items() if k not in text}, str(path),
                  metadata=text or None)
