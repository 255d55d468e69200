"""Peer baselines, loaded at run time from outside the repository (shared/peers/README.md).

SGLang's serial tree verifier for Gated DeltaNet, ``fused_recurrent_gated_delta_rule_update`` from
``sglang==0.5.23`` (``sglang/kernels/ops/attention/fla/fused_recurrent.py``), is fetched into the
git-ignored ``.peers/sglang/`` by ``scripts/fetch_peers.sh`` and loaded here with
``importlib.util.spec_from_file_location``. The file imports two names from its sibling modules:
``exp`` from ``sglang.kernels.ops.attention.fla.op`` (``triton.language.exp`` unless
FLA_USE_FAST_OPS=1) and ``input_guard`` from ``sglang.kernels.ops.attention.fla.utils`` (makes tensor
arguments contiguous and enters the first tensor's CUDA device). Small stand-ins for exactly those
two modules (and their parent packages) are put in ``sys.modules`` while the file executes and the
previous entries are restored afterwards, so an installed sglang is neither imported nor shadowed.
The kernel itself is untouched.

Semantics of SGLang's tree mode (read from the kernel), and how our forests map onto it:
    - one program per (request, value head, 8 value columns); it walks the request's tokens in
      order. Token 0 starts from ``initial_state_source[initial_state_indices[b]]`` (the committed
      state, [slots, HV, V, K]); every later token t reloads the state of token
      ``retrieve_parent_token[b, t]`` (a *local* index; entry 0 is never read) from
      ``intermediate_states_buffer[intermediate_state_indices[b], parent]`` ([slots, cache_steps,
      HV, V, K], fp32) and writes its own state at step t.
    - So SGLang's tree has exactly one node hanging off the committed prefix: token 0 (in SGLang
      the last verified token, which the target has not processed yet). Our forests allow several
      children of the committed root (parent -1). Only node 0 may have parent -1 here; a forest
      with another first-level node raises ``ValueError``. The benchmark therefore draws EAGLE-like
      trees with a single first-level node (``single_root_tree``), which is also what a real
      verification step looks like in both systems, so the same inputs feed every column.
    - ``disable_state_update=True`` leaves the committed pool untouched (verification mode); the
      per-node snapshots in the intermediate buffer are SGLang's speculative state.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

from bole.spec.tree import DraftTree, PackedForest, random_tree

REPO_ROOT = Path(__file__).resolve().parents[1]
SGLANG_FILE = REPO_ROOT / ".peers" / "sglang" / "fused_recurrent.py"
_SGLANG_PKG = "sglang.kernels.ops.attention.fla"


def sglang_available(path: Path = SGLANG_FILE) -> bool:
    return Path(path).is_file()


def _input_guard(fn):
    """Stand-in for sglang's fla ``input_guard``: contiguous tensor args, first tensor's device."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        ctx = (torch.cuda.device(first.device.index)
               if first is not None and first.device.type == "cuda" else contextlib.nullcontext())
        with ctx:
            return fn(*args, **kwargs)

    return wrapper


@triton.jit
def _interpreted_exp(x):
    # The interpreter patches builtins only where a kernel reaches them through ``tl``; a bare
    # global alias of ``tl.exp`` stays unpatched there, so under TRITON_INTERPRET=1 the stand-in is
    # this inlined wrapper. Compiled runs use ``tl.exp`` itself, as sglang does.
    return tl.exp(x)


def _stand_in_modules() -> dict[str, types.ModuleType]:

    mods = {}
    parts = _SGLANG_PKG.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        m = types.ModuleType(name)
        m.__path__ = []  # a package, so submodule imports resolve through sys.modules
        mods[name] = m
    op = types.ModuleType(f"{_SGLANG_PKG}.op")
    op.exp = _interpreted_exp if os.environ.get("TRITON_INTERPRET") == "1" else tl.exp
    utils = types.ModuleType(f"{_SGLANG_PKG}.utils")
    utils.input_guard = _input_guard
    mods[op.__name__], mods[utils.__name__] = op, utils
    return mods


def _interpreter_numpy2_compat() -> None:
    """CPU runs only (TRITON_INTERPRET=1): let the interpreter index with a loaded scalar.

    Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with
    ``int(array)``, which NumPy >= 2.4 rejects; SGLang's kernel loops ``for _ in range(0, T)`` over
    ``T = eos - bos`` loaded from ``cu_seqlens``. Re-register ``tensor.__index__`` with ``.item()``
    semantics inside the interpreter's own patch scope (restored after every launch). Compiled
    (GPU) launches never see this.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.runtime.interpreter as interp

    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_bole_numpy2_compat", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._bole_numpy2_compat = True
    interp._patch_lang_tensor = patched


@functools.lru_cache(maxsize=None)
def load_sglang_fused_recurrent(path: str | None = None) -> types.ModuleType:
    """Import SGLang's ``fused_recurrent.py`` from ``.peers/`` under a private module name."""
    path = Path(path) if path else SGLANG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run scripts/fetch_peers.sh where PyPI is reachable")
    _interpreter_numpy2_compat()
    stand_ins = _stand_in_modules()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    name = "bole_peers_sglang_fused_recurrent"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # triton resolves the kernel's globals through its module
    try:
        sys.modules.update(stand_ins)
        spec.loader.exec_module(module)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return module


def single_root_tree(num_nodes: int, max_depth: int, generator: torch.Generator | None = None,
                     max_children: int = 4) -> DraftTree:
    """An EAGLE-like random tree whose only first-level node is node 0 (SGLang's tree shape).

    Node 0 hangs off the committed prefix; the other ``num_nodes - 1`` nodes form an EAGLE-like
    random forest (``random_tree``, depth ≤ max_depth - 1) below it.
    """
    if num_nodes == 1 or max_depth == 1:
        if num_nodes != 1:
            raise ValueError(f"a depth-1 single-root tree has one node, not {num_nodes}")
        return DraftTree([-1], max_depth=max_depth)
    sub = random_tree(num_nodes - 1, max_depth - 1, generator=generator, max_children=max_children)
    return DraftTree([-1] + [p + 1 if p >= 0 else 0 for p in sub.parents], max_depth=max_depth)


class SGLangTreeVerifier:
    """SGLang's serial tree verifier on our inputs, with every buffer built once up front.

    Args (our conventions, bole/ops/gdn.py):
        q, k: [1, N, HK, K]; v: [1, N, HV, V]; g, beta: [1, N, HV]; forest: PackedForest of N nodes
        whose trees each have node 0 as their only first-level node; initial_state: the pool
        [slots, HV, V, K] (fp32); state_indices: [B] slot per request (default: request b -> slot b).
    ``__call__`` runs the verification and returns o [1, N, HV, V] (q's dtype). ``snapshots`` is
    the intermediate-state buffer [B, max_nodes, HV, V, K] fp32 filled by the last call.
    """

    def __init__(self, q, k, v, g, beta, forest: PackedForest, initial_state, state_indices=None,
                 scale=None, use_qk_l2norm=False, path: str | None = None):
        self.mod = load_sglang_fused_recurrent(path)
        device = q.device
        B, T = forest.num_requests, forest.max_nodes
        cu = forest.cu_seqlens.cpu().long()
        parents = forest.parents.cpu().long()
        # retrieve_parent_token[b, t]: local parent of token t; entry 0 unused (token 0 starts from
        # the committed state). Rows are padded to the largest tree.
        rpt = torch.zeros(B, T, dtype=torch.int64)
        for b in range(B):
            p = parents[cu[b]:cu[b + 1]]
            bad = torch.nonzero(p[1:] < 0).flatten()
            if p[0] != -1 or bad.numel():
                i = 0 if p[0] != -1 else int(bad[0]) + 1
                raise ValueError(f"request {b}, node {i}: SGLang's tree verifier needs node 0 to be "
                                 "the only child of the committed root (see single_root_tree)")
            rpt[b, 1:len(p)] = p[1:]
        self.retrieve_parent_token = rpt.to(device)
        HV, V, K = initial_state.shape[1:]
        self.snapshots = torch.empty(B, T, HV, V, K, dtype=torch.float32, device=device)
        self.cache_steps = T
        self.intermediate_state_indices = torch.arange(B, dtype=torch.int32, device=device)
        if state_indices is None:
            state_indices = torch.arange(B, device=device)
        self.state_indices = state_indices.to(device=device, dtype=torch.int32)
        self.args = (q, k, v, g, beta)
        self.scale = scale
        self.use_qk_l2norm = use_qk_l2norm
        self.initial_state = initial_state
        self.cu_seqlens = forest.cu_seqlens.to(device=device, dtype=torch.int32)

    def __call__(self) -> torch.Tensor:
        q, k, v, g, beta = self.args
        return self.mod.fused_recurrent_gated_delta_rule_update(
            q, k, v, g, beta,
            scale=self.scale,
            initial_state_source=self.initial_state,
            initial_state_indices=self.state_indices,
            cu_seqlens=self.cu_seqlens,
            use_qk_l2norm_in_kernel=self.use_qk_l2norm,
            disable_state_update=True,
            intermediate_states_buffer=self.snapshots,
            intermediate_state_indices=self.intermediate_state_indices,
            cache_steps=self.cache_steps,
            retrieve_parent_token=self.retrieve_parent_token,
        )


def sglang_tree_verify(q, k, v, g, beta, forest: PackedForest, initial_state, state_indices=None,
                       scale=None, use_qk_l2norm=False):
    """One-shot form of ``SGLangTreeVerifier``: returns (o [1, N, HV, V], snapshots)."""
    run = SGLangTreeVerifier(q, k, v, g, beta, forest, initial_state, state_indices, scale, use_qk_l2norm)
    return run(), run.snapshots
