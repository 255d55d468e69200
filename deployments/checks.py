"""Range checks of the frozen policy dataclasses (retry, routing, recalibration): each error names the
field and its value."""

from __future__ import annotations


def require_at_least(obj, minimum: float, *names: str) -> None:
    """Raise ``ValueError`` for the first of ``obj``'s fields ``names`` below ``minimum``."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
