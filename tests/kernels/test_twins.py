"""The twin naming rule (docs/ARCHITECTURE.md) as a test: every public entry point ``f`` of a kernels/
module has its torch twin ``f_ref``, a module-level function of some bole/ops module.

Entry points are read from the source (ast, no Triton import): public module-level functions that are
neither Triton kernels (``@triton.jit`` / ``@triton.autotune``) nor ``launch_*`` launchers. The argument
checks (kernels/_checks.py), the size limits (kernels/limits.py) and launch planning
(kernels/*_launch.py) have no twin.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_TWIN = {"__init__.py", "_checks.py", "limits.py"}


def _is_triton(decorator: ast.expr) -> bool:
    """``@triton.jit``, ``@triton.autotune(...)`` (and ``@jit`` / ``@autotune`` imported by name)."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name in ("jit", "autotune", "heuristics")


def _functions(path: Path) -> list[ast.FunctionDef]:
    return [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]


def entry_points(path: Path) -> list[str]:
    """The public entry points of one kernels/ module."""
    return [f.name for f in _functions(path)
            if not f.name.startswith(("_", "launch_")) and not any(_is_triton(d) for d in f.decorator_list)]


def kernel_modules() -> list[Path]:
    return [p for p in sorted((ROOT / "kernels").glob("*.py"))
            if p.name not in NO_TWIN and not p.stem.endswith("_launch")]


def twins() -> dict[str, str]:
    """Every module-level function of bole/ops: name -> module file."""
    return {f.name: p.name for p in sorted((ROOT / "bole" / "ops").glob("*.py")) for f in _functions(p)}


def test_every_kernel_entry_point_has_a_ref_twin():
    refs = twins()
    found = [(p.name, name) for p in kernel_modules() for name in entry_points(p)]
    assert len(found) >= 15  # the scan finds the kernels at all
    missing = [f"kernels/{m}: {name} (no {name}_ref in bole/ops)" for m, name in found if f"{name}_ref" not in refs]
    print("\n".join(missing))
    assert not missing, "kernel entry points without a twin:\n" + "\n".join(missing)


def test_entry_point_scan_skips_kernels_and_launchers(tmp_path):
    src = tmp_path / "k.py"
    src.write_text("import triton\n@triton.jit\ndef k_kernel(x):\n    pass\n"
                   "@triton.autotune(configs=[], key=[])\n@triton.jit\ndef tuned_kernel(x):\n    pass\n"
                   "def launch_k(x):\n    pass\ndef _check(x):\n    pass\ndef k(x):\n    pass\n")
    assert entry_points(src) == ["k"]
