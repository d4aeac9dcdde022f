"""The one exception the loader raises for a bad checkpoint."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file or directory cannot be loaded; the message names what was found."""
