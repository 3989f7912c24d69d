"""Where a checkpoint lives: a path or a URL, resolved once into a ``Location``.

Every function of flowvm.persist that takes a checkpoint's place (``save``, ``load``, ``read_header``,
``save_state``, ``load_state``, the storage and lock functions) takes a path (a str or an os.PathLike), a URL
(a str) or a Location; it makes the Location once (``Location.of``, which returns a Location as it is) and
passes it down, so that what the place is, a local file or an fsspec URL, and the URL's filesystem, are found
once per call:

- a plain path, or a ``file://`` URL (``file:///abs/path`` and ``file://localhost/abs/path`` are absolute,
  ``file://rel/path`` is relative to the current directory, as fsspec reads it): ``path`` is the local file;
- another URL (``s3://bucket/key``, ``memory://...``, ``sftp://...``): ``url`` is it, and ``filesystem()``
  its fsspec filesystem and the path within it (fsspec is imported only then).

``given`` is what the caller gave: errors name it, and ``saved`` is what a save returns (a Path for a local
file, the URL for any other).  The command resolves ``--checkpoint`` and a checkpoint argument into a Location
once, when it parses them, and from then on asks about it the format registry (``formats.format_of``: which
functions save and load it, whether the file holds the program, what of a file already there must not be
replaced), the storage (can a save go there, its first bytes) and the lock.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .remote import LOCAL_SCHEMES, filesystem, scheme_of

__all__ = ["Location"]


class Location:
    """A checkpoint's place: a local file (``path``) or an fsspec URL (``url``), with ``given`` as given."""

    __slots__ = ("given", "path", "url", "scheme", "_fs")

    def __init__(self, given: Any, path: Path | None, url: str | None, scheme: str | None):
        self.given, self.path, self.url, self.scheme = given, path, url, scheme
        self._fs: tuple[Any, str] | None = None

    @classmethod
    def of(cls, target: Any) -> "Location":
        """The Location of target: a Location (returned as it is), a path or a URL."""
        if isinstance(target, Location):
            return target
        if not isinstance(target, (str, os.PathLike)):
            raise TypeError(f"a checkpoint's place is a path or a URL (str or os.PathLike), got "
                            f"{type(target).__name__} {target!r:.60}")
        scheme = scheme_of(target)
        if scheme is None:
            return cls(target, Path(target), None, None)
        if scheme in LOCAL_SCHEMES:
            rest = target[len(scheme) + 3:]
            if rest.startswith("localhost/"):
                rest = rest[len("localhost"):]
            return cls(target, Path(rest), None, scheme)
        return cls(target, None, target, scheme)

    @property
    def is_local(self) -> bool:
        return self.path is not None

    def filesystem(self) -> tuple[Any, str]:
        """(fsspec filesystem, path within it) of a URL, found on first use; a CheckpointError naming the URL
        when fsspec or the scheme's backend is missing, or the URL names a bucket or a directory."""
        if self._fs is None:
            fs, path, _ = filesystem(self.url)
            self._fs = (fs, path)
        return self._fs

    @property
    def saved(self) -> Path | str:
        """What a save returns: a Path for a local file, the URL for any other."""
        return self.path if self.path is not None else self.url

    @property
    def name(self) -> str:
        """The last part of the path or URL (the file's name)."""
        return self.path.name if self.path is not None else self.url.rstrip("/").rpartition("/")[2]

    def __str__(self) -> str:
        return os.fspath(self.given) if isinstance(self.given, os.PathLike) else str(self.given)

    def __repr__(self) -> str:
        return f"Location({self.given!r})"
