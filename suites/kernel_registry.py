"""Every op the kernels suite measures: importing the two family modules registers their declarations."""

from __future__ import annotations

from typing import Sequence

from . import kernel_ops, kernel_projections  # noqa: F401  (their declarations register themselves on import)
from .kernel_cases import OpEntry, registered


def entries(patterns: Sequence[str] = ()) -> list[OpEntry]:
    """The declared ops whose required module imports, filtered by op-name substrings (any of ``patterns``): the
    projections first, then the other families in their declaration order."""
    return sorted(registered(patterns), key=lambda e: e.family != "projection")
