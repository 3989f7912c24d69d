"""A run's checkpoint place on the command line: ``--checkpoint`` and a checkpoint argument resolved into a Location
once (persist/location.py), checked before the run starts (a save can go there; what is there already is not
replaced silently: ``Format.in_the_way``), and the key (``--key``, $FLOWVM_CHECKPOINT_KEY) a signed file is
read with."""

from __future__ import annotations

import os
from pathlib import Path

from ..base.errors import CheckpointError, UsageError
from ..persist import storage
from ..persist.formats import MAGIC_BYTES, format_of
from ..persist.location import Location


KEY_ENV = "FLOWVM_CHECKPOINT_KEY"


# ------------------------------------------------------------------ commands
def key_of(args) -> str | None:
    return getattr(args, "key", None) or os.environ.get(KEY_ENV) or None


def trusted_header(args, path: Path | str) -> tuple[dict, str | None]:
    """The header of a saved run and the key to load it with, checked before anything is imported.

    A signed file is only read with its key (and stays signed); with a key the
    signature is checked first, since the header names the module to import.
    """
    key, read_header = key_of(args), format_of(path).read_header
    header = read_header(path)
    if header.get("signed") and key is None:
        raise UsageError(f"{path} is signed: give its key with --key or ${KEY_ENV}")
    if key is not None:
        header = read_header(path, key=key)
    return header, key


def checkpoint_location(text: str) -> Location:
    """A --checkpoint or resume/show argument, resolved once into the Location the command asks from then on
    (its format, whether a save can go there, what is there already: persist/location.py)."""
    return Location.of(text)


def check_checkpoint_path(loc: Location | None) -> None:
    """Refuse a --checkpoint that no save could go to, before the run starts: a directory, a missing
    directory; for a URL, a filesystem that is not installed, a bucket, or a store that does not answer (any
    problem but a missing object would fail every save: say so now, not after the first interval)."""
    if loc is None:
        return
    try:
        storage.check_target(loc)
        if loc.url is not None:
            storage.read_start(loc, MAGIC_BYTES, missing_ok=True)
    except CheckpointError as err:
        raise UsageError(f"--checkpoint {loc}: {err.reason}") from None


def refuse_to_overwrite(loc: Location | None, force: bool) -> None:
    """A run must not silently replace an unfinished run saved at its checkpoint place, nor a file that is
    no checkpoint of its format at all: the format says what is there (``Format.in_the_way``)."""
    if loc is None or force:
        return
    try:
        found = format_of(loc).in_the_way(loc)
    except CheckpointError as err:
        raise UsageError(f"--checkpoint {loc}: {err.reason}") from None
    if found is not None:
        what, text = found
        advice = (f"continue it with `flowvm resume {loc}`, or pass --force to start over" if what == "unfinished"
                  else "choose another --checkpoint path, or pass --force to replace it")
        raise UsageError(f"{text}; {advice}")
