"""The flowvm release (setuptools reads it from here, and saved runs record it)."""

__version__ = "0.3.0"
