"""The output options of a run (``--tensorboard DIR``, ``--output PATH``), recorded in its checkpoints' meta so
that ``flowvm resume`` goes on writing where the run it continues wrote, unless given others (which it then
records instead)."""

from __future__ import annotations

import os

OPTIONS = ("tensorboard", "output")


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)  # so that a resume from elsewhere finds it


def record(args, meta: dict) -> dict:
    """meta with the output options given on this command line (absolute paths)."""
    outputs = dict(meta.get("outputs") or {})
    for name in OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            outputs[name] = _absolute(str(value))
    return dict(meta, outputs=outputs) if outputs or "outputs" in meta else meta


def resume(args, meta: dict) -> dict:
    """The options a resume takes from the run it continues (those not given anew), set on args; returns the
    meta to save from now on (with the options given anew)."""
    recorded = meta.get("outputs") or {}
    for name in OPTIONS:
        if getattr(args, name, None) is None and isinstance(recorded.get(name), str):
            setattr(args, name, recorded[name])
    return record(args, meta)
