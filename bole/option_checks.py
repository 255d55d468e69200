"""Type checks of user-facing options: a ValueError that names the option and its value.

``EngineConfig`` and its parts check their fields with these, and ``LLM`` its prompts' token ids;
nothing is coerced, so a typo (``block_size=True``, ``enable_prefix_cache='no'``) is refused, not
silently read as something else.
"""

from __future__ import annotations

import math
import numbers


def check_types(obj, ints: tuple[str, ...] = (), bools: tuple[str, ...] = (), strs: tuple[str, ...] = ()) -> None:
    """ValueError naming the option and its value when an option has the wrong type; bools are not
    ints here (``block_size=True`` is a typo, not 1) and strings such as ``'64'`` or ``'no'`` are not
    coerced (``enable_prefix_cache='no'`` would otherwise be truthy, i.e. on)."""
    name = type(obj).__name__
    for k in ints:
        v = getattr(obj, k)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name}.{k} must be an int, got {v!r} ({type(v).__name__})")
    for k in bools:
        v = getattr(obj, k)
        if not isinstance(v, bool):
            raise ValueError(f"{name}.{k} must be a bool (True / False), got {v!r} ({type(v).__name__})")
    for k in strs:
        v = getattr(obj, k)
        if not isinstance(v, str):
            raise ValueError(f"{name}.{k} must be a string, got {v!r} ({type(v).__name__})")


def int_tuple(name: str, value) -> tuple[int, ...]:
    """A list / tuple of non-negative ints (numpy / torch integer scalars allowed) as a tuple of ints."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        hint = f" (one id: {name}=[{value!r}])" if is_integral(value) else ""
        raise ValueError(f"{name} must be a list of ints, got {value!r} ({type(value).__name__}){hint}")
    out = tuple(value)
    bad = [v for v in out if not is_integral(v) or int(v) < 0]
    if bad:
        raise ValueError(f"{name} must be a list of non-negative ints, got {list(out)!r} (bad: {bad[:5]!r})")
    return tuple(int(v) for v in out)


def check_epsilon(name: str, value) -> float:
    """eq. 12's ε (a calibration table's, or ``SpecConfig.budget_epsilon``) as a float; ValueError naming
    ``name`` unless it is a finite real number >= 0 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def is_integral(v) -> bool:
    """int, or a numpy / torch integer scalar; never a bool or a float (1.0 is not a token id)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    if isinstance(v, numbers.Integral):  # numpy integer scalars register as Integral
        return True
    dtype = getattr(v, "dtype", None)  # a 0-d torch / numpy integer tensor
    return dtype is not None and getattr(v, "ndim", 1) == 0 and "int" in str(dtype) and "bool" not in str(dtype)
