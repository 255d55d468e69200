"""Bole's Triton kernels (each with a naive torch twin in ``bole/ops``).

Import the submodules explicitly (``from kernels.gdn_tree_verify import gdn_tree_verify``). This file
stays free of imports: transformers probes for a PyPI package that is also called ``kernels`` and,
when no distribution metadata answers, imports it to read ``__version__``; that probe must stay cheap
and must not find a version here (tests/kernels/test_kernels_name.py).
"""
