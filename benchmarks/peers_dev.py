"""SGLang's two development-tree closed-form GDN tree verifiers, loaded from ``.peers/sglang-main/``.

Not in any SGLang release; read file by file from the sgl-project/sglang repository
(``python/sglang/srt/layers/attention/fla/``) with the search tool's ``read_file`` and saved
verbatim into the git-ignored ``.peers/sglang-main/`` with a ``SOURCE`` file naming each file's
commit (``scripts/fetch_peers.sh --help`` says how; shared/peers/README.md says what they are).
Never committed, never copied into the project: each file is executed as it is, under its own
SGLang module name, with small stand-ins in ``sys.modules`` for what it imports and does not need
(restored afterwards, as ``benchmarks/peers.py`` loads the serial verifier).

chunk (``chunk_tree_verify.py`` at bab5e472, ``SGLangChunkTreeVerifier``)
    ``chunk_gated_delta_rule_tree_verify``: the chain chunk algebra along tree paths. A per-step
    int64 proper-ancestor bitmask (``build_tree_ancestor_masks``), then per layer a path cumsum of
    g, (I+A)^-1 by forward substitution on 16x16 blocks plus a block merge (stored in the inputs'
    dtype), ``recompute_w_u_fwd`` (wy_fast.py), and the output kernel; q, k l2-normalised by
    l2norm.py's kernel first. Writes only O; its commit replays the accepted path from a stash of
    k, v, g, beta (``advance_ssm_states_along_accept_paths``), which the verifier itself does not
    produce. Siblings loaded from their files: op.py, index.py, l2norm.py, wy_fast.py (other stored
    versions, see SOURCE); utils.py is stood in for (no stored version defines
    ``autotune_cache_kwargs``, and it queries the CUDA device at import).
fused (``gdn_tree_fused.py`` + ``gdn_tree_triton.py`` at 205c2b55, ``SGLangFusedTreeVerifier``)
    ``tree_gdn_triton_verify``: four launches (gates and path sums; per-key-head Gram tiles with
    the 32x32 diagonal blocks inverted by Neumann repeated squaring; block forward substitution;
    output), fp32 A / QKD workspaces, and the lazy verify state (k raw, U, prefix) its fold
    consumes: returned as ``.lazy``. ``gdn_tree_fused.py`` is its torch specification and holds
    the tree structure and the lazy-state type; ``msgspec`` is stood in for when not installed.

Our inputs (bole/ops/gdn.py conventions): q, k [1, N, HK, K]; v [1, N, HV, V]; g (log decay), beta
[1, N, HV]; a PackedForest; the pool [slots, HV, V, K] fp32 (K contiguous); state_indices [B].
Both peers take a dense [B, T, ...] batch of equal-size trees, so every tree of the forest must
have the same number of nodes (as in a serving step, where all drafts have num_draft_tokens): the
packed inputs are then viewed as [B, T, ...] without a copy. Their trees: see each class.

Under TRITON_INTERPRET=1 (CPU) op.py's ``exp`` (a bare alias of ``tl.exp``, which the interpreter
does not patch) is replaced in the loaded op module by an inlined ``tl.exp`` wrapper before the
files that import it run, the NumPy-2 scalar-index patch of benchmarks/peers.py is installed, and
the chunk's autotuned kernel runs its first config (nothing to time candidates with); compiled (GPU)
runs use the files' own names and autotune.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import os
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.peers import _input_guard, _interpreted_exp, _interpreter_numpy2_compat
from bole.spec.tree import PackedForest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEV_DIR = REPO_ROOT / ".peers" / "sglang-main"
_PKG = "sglang.srt.layers.attention.fla"
# load order: each file after the siblings it imports
CHUNK_FILES = ("op.py", "index.py", "l2norm.py", "wy_fast.py", "chunk_tree_verify.py")
FUSED_FILES = ("gdn_tree_fused.py", "gdn_tree_triton.py")
CHUNK_MAX_T = 64  # chunk_tree_verify.TREE_CHUNK_SIZE: one chunk per request
FETCH_HINT = "see scripts/fetch_peers.sh --help (read_file, verbatim, into .peers/sglang-main/)"


def missing(files, path: Path = DEV_DIR) -> list[str]:
    """The files of ``files`` (and SOURCE) absent from ``path``."""
    return [f for f in ("SOURCE", *files) if not (Path(path) / f).is_file()]


def chunk_available(path: Path = DEV_DIR) -> bool:
    return not missing(CHUNK_FILES, path)


def fused_available(path: Path = DEV_DIR) -> bool:
    return not missing(FUSED_FILES, path)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _utils_stand_in() -> types.ModuleType:
    """The names the loaded files import from SGLang's fla/utils.py, with its semantics."""
    m = types.ModuleType(f"{_PKG}.utils")
    m.input_guard = _input_guard
    m.tensor_cache = lambda fn: fn  # caches index.py's helpers; only reached with cu_seqlens
    # upstream: {"cache_results": FLA_CACHE_RESULTS (default on)} where triton.autotune takes it
    m.autotune_cache_kwargs = ({"cache_results": os.getenv("FLA_CACHE_RESULTS", "1") == "1"}
                               if "cache_results" in inspect.signature(triton.autotune).parameters else {})
    # upstream: is_nvidia and compute capability >= 8 (tf32 for the chunk kernel's block merge)
    m.is_tf32_supported = (not _interpreting() and torch.cuda.is_available()
                           and torch.cuda.get_device_capability(0)[0] >= 8)
    m.is_gather_supported = hasattr(tl, "gather")
    return m


def _msgspec_stand_in() -> types.ModuleType:
    m = types.ModuleType("msgspec")

    class Struct:  # keyword construction and attribute access, all LazyGDNVerifyState needs
        def __init__(self, **fields):
            for name, value in fields.items():
                setattr(self, name, value)

    m.Struct = Struct
    return m


def _load(files, path: Path) -> dict[str, types.ModuleType]:
    """Execute ``files`` from ``path`` in order as ``sglang.srt.layers.attention.fla.<stem>``."""
    gone = missing(files, path)
    if gone:
        raise FileNotFoundError(f"{path} lacks {', '.join(gone)}: {FETCH_HINT}")
    _interpreter_numpy2_compat()
    stand_ins = {}
    parts = _PKG.split(".")
    for i in range(1, len(parts) + 1):
        pkg = types.ModuleType(".".join(parts[:i]))
        pkg.__path__ = []  # a package, so submodule imports resolve through sys.modules
        stand_ins[pkg.__name__] = pkg
    stand_ins[f"{_PKG}.utils"] = _utils_stand_in()
    try:
        import msgspec  # noqa: F401
    except ImportError:
        stand_ins["msgspec"] = _msgspec_stand_in()
    names = [f"{_PKG}.{Path(f).stem}" for f in files]
    saved = {n: sys.modules.get(n) for n in [*stand_ins, *names]}
    loaded = {}
    try:
        sys.modules.update(stand_ins)
        for f, name in zip(files, names, strict=True):
            spec = importlib.util.spec_from_file_location(name, Path(path) / f)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            if f == "op.py" and _interpreting():
                module.exp = _interpreted_exp  # read by safe_exp and by the files importing exp
            loaded[Path(f).stem] = module
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    # the kernels keep their module globals (triton reads them from each function); park the
    # modules under private names so nothing named sglang.* is left behind
    for stem, module in loaded.items():
        sys.modules[f"bole_peers_sglang_main.{stem}"] = module
    return loaded


@functools.lru_cache(maxsize=None)
def load_chunk(path: str | None = None) -> types.ModuleType:
    """chunk_tree_verify.py (and the siblings it imports) from ``.peers/sglang-main/``."""
    mod = _load(CHUNK_FILES, Path(path) if path else DEV_DIR)["chunk_tree_verify"]
    if _interpreting():
        # The interpreter has no driver to time the autotuner's candidates with: run its first
        # config (BK=32). Compiled runs autotune over all six, as SGLang does.
        tuner = mod.tree_kkt_solve_kernel
        tuner.configs = tuner.configs[:1]
    return mod


@functools.lru_cache(maxsize=None)
def load_fused(path: str | None = None) -> tuple[types.ModuleType, types.ModuleType]:
    """(gdn_tree_fused, gdn_tree_triton) from ``.peers/sglang-main/``."""
    mods = _load(FUSED_FILES, Path(path) if path else DEV_DIR)
    return mods["gdn_tree_fused"], mods["gdn_tree_triton"]


def source_summary(path: Path = DEV_DIR) -> dict[str, str] | None:
    """{file: commit} from ``SOURCE`` (None when it is absent)."""
    src = Path(path) / "SOURCE"
    if not src.is_file():
        return None
    rows = [line.split()[:2] for line in src.read_text().splitlines() if line.strip() and line[0] != "#"]
    return {f: c for f, c in rows}


def release_workspaces() -> None:
    """Drop the fused peer's scratch cache (gdn_tree_triton keeps A/QKD/Ainv/beta per shape)."""
    mod = sys.modules.get("bole_peers_sglang_main.gdn_tree_triton")
    if mod is not None:
        mod._WORKSPACE.clear()


def dense_batch(forest: PackedForest, peer: str) -> tuple[int, int]:
    """(B, T) when every tree of ``forest`` has T nodes, else ValueError (dense [B, T] layout)."""
    sizes = (forest.cu_seqlens[1:] - forest.cu_seqlens[:-1]).tolist()
    if len(set(sizes)) != 1:
        raise ValueError(f"SGLang's {peer} tree verifier takes a dense [B, T] batch: every tree needs "
                         f"the same number of nodes, got {sorted(set(sizes))}")
    return len(sizes), sizes[0]


def _check_heads(q, v, peer):
    HK, HV = q.shape[2], v.shape[2]
    if HV % HK:
        raise ValueError(f"SGLang's {peer} tree verifier needs HV % HK == 0, got HK={HK}, HV={HV}")


class SGLangChunkTreeVerifier:
    """SGLang's chunk tree verifier (``chunk_gated_delta_rule_tree_verify``) on our inputs.

    Tree encoding: ``build_tree_ancestor_masks`` turns tree-local parent indices [B, T] (SGLang's
    ``retrieve_parent_token`` convention: token 0's entry is ignored) into one int64 word per
    token, the bitset of its proper ancestors. We pass our local parents as they are. A further
    node with parent -1 (a second child of the committed root, which SGLang's trees never have)
    matches no token in the mask kernel's parent lookup and so gets an empty ancestor set: it
    starts from the committed state, which is our forest semantics (tests/bench/test_peers_dev.py
    checks it). The masks are layer-invariant and built once here, as SGLang builds them once per
    verify step; the timed call is the per-layer verifier.

    Gates: g (our log decay) and beta are the peer's own inputs, passed unchanged.
    Limits (ValueError): trees of equal size T (dense batch), T <= 64 (one chunk; the peer
    asserts it), q/k/v in bf16 or fp16 (the peer asserts q is not fp32), HV % HK == 0; and on CPU
    not bf16 (the interpreter's bf16 dots are wrong).
    ``__call__`` returns O [1, N, HV, V] in v's dtype. It writes no state and returns nothing for
    the commit (SGLang's commit replays the accepted path from its stash of k, v, g, beta with
    ``ancestor_masks``, kept here).
    """

    def __init__(self, q, k, v, g, beta, forest: PackedForest, initial_state, state_indices=None,
                 scale=None, use_qk_l2norm=False, path: str | None = None):
        B, T = dense_batch(forest, "chunk")
        if T > CHUNK_MAX_T:
            raise ValueError(f"SGLang's chunk tree verifier takes at most {CHUNK_MAX_T} nodes per tree "
                             f"(one chunk), got {T}")
        if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError("SGLang's chunk tree verifier takes bf16/fp16 q, k, v (it asserts q is not "
                             f"fp32), got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.dtype == torch.bfloat16 and _interpreting():
            raise ValueError("not under TRITON_INTERPRET=1 with bf16: the interpreter's bf16 tl.dot is wrong "
                             "(the chunk peer's dots take the bf16 operands); use fp16 on CPU")
        _check_heads(q, v, "chunk")
        self.mod = load_chunk(path)
        device = q.device
        HK, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
        self.parent_tokens = forest.parents.to(device=device, dtype=torch.int32).view(B, T)
        self.ancestor_masks = self.mod.build_tree_ancestor_masks(self.parent_tokens, T)
        self.q, self.k = q.reshape(B, T, HK, K), k.reshape(B, T, HK, K)
        self.v = v.reshape(B, T, HV, V)
        self.g, self.beta = g.reshape(B, T, HV), beta.reshape(B, T, HV)
        if state_indices is None:
            state_indices = torch.arange(B, device=device)
        self.state_indices = state_indices.to(device=device, dtype=torch.int32)
        self.initial_state = initial_state
        self.scale, self.use_qk_l2norm = scale, use_qk_l2norm
        self.out_shape = (1, B * T, HV, V)

    def __call__(self) -> torch.Tensor:
        o = self.mod.chunk_gated_delta_rule_tree_verify(
            self.q, self.k, self.v, self.g, self.beta, self.ancestor_masks, self.initial_state,
            self.state_indices, scale=self.scale, use_qk_l2norm_in_kernel=self.use_qk_l2norm)
        return o.view(self.out_shape)


def fused_gate_inputs(g: torch.Tensor, beta: torch.Tensor):
    """Raw gate inputs for which the fused verifier's in-kernel gating gives back our g and beta.

    The peer computes g = -exp(A_log) * softplus(a + dt_bias) (softplus with ``beta`` and a
    ``threshold`` above which it is linear) and beta = sigmoid(b). We take A_log = 0, dt_bias = 0,
    softplus_beta = 1 and threshold = -inf, so every x is above the threshold and softplus(x) = x:
    the kernel then computes g = -exp(0) * (a + 0) with a = -g, which is our g exactly in fp32
    (exp(0) = 1, and the sum and negations are exact). For beta, b = logit(beta) in float64,
    rounded to fp32; the kernel's 1 / (1 + exp(-b)) returns beta to within a few fp32 ulps (not
    bit for bit: the sigmoid is rounded). Returns (A_log [HV], a, dt_bias [HV], softplus_beta,
    softplus_threshold, b), a and b [B, T, HV] fp32 contiguous (the kernel indexes b with a's
    strides).
    """
    HV = g.shape[-1]
    zeros = torch.zeros(HV, dtype=torch.float32, device=g.device)
    a = (-g.float()).contiguous()
    b64 = beta.double()
    b = (torch.log(b64) - torch.log1p(-b64)).float().contiguous()
    return zeros, a, zeros.clone(), 1.0, -math.inf, b


class SGLangFusedTreeVerifier:
    """SGLang's fused tree verifier (``gdn_tree_triton.tree_gdn_triton_verify``) on our inputs.

    Tree encoding: a ``TreeStructure`` from the parents [B, T] (int64, root = -1, parent < child),
    holding the inclusive ancestor mask P [B, T, T] as uint8 plus ``max_depth``, which the
    diagonal-block inversion reads as a compile-time bound. We pass our local parents as they are
    (several first-level nodes are fine: a -1 parent adds no edge) and build it once, as SGLang's
    dispatch does per verify step, with ``build_tree_structure_static`` (what its
    ``get_tree_structure`` calls: capture-safe, max_depth = T - 1, so every squaring step runs).

    Gates: the peer takes raw gate projections; ``fused_gate_inputs`` chooses them so its g equals
    ours exactly and its beta to within fp32 rounding of the sigmoid. That gating runs inside the
    timed call, as in SGLang.
    precision: the tl.dot precision of its K1-K3 ("tf32" on a GPU by default, its serving setting;
    "ieee", fp32-exact, under the interpreter). K0's path sums are tf32x3 whatever is asked.
    Limits (ValueError): trees of equal size T (dense batch; no cap on T: its loops over the
    T/32 row blocks unroll at compile time), HV % HK == 0, V a multiple of its V tile
    min(64, max(16, next_pow2(V))) (K2 reads and writes U tiles unmasked: other V would write
    past U's rows). Any q/k/v dtype (loaded as fp32).
    ``__call__`` returns O [1, N, HV, V] in v's dtype; ``lazy`` then holds the peer's lazy verify
    state (k raw, U [B, HV, T, V], prefix [B, T, HV]) that its fold commits from.
    """

    def __init__(self, q, k, v, g, beta, forest: PackedForest, initial_state, state_indices=None,
                 scale=None, use_qk_l2norm=False, precision: str | None = None, path: str | None = None):
        B, T = dense_batch(forest, "fused")
        _check_heads(q, v, "fused")
        V = v.shape[3]
        BV = min(64, max(16, triton.next_power_of_2(V)))  # the peer's V tile
        if V % BV:
            raise ValueError(f"SGLang's fused tree verifier needs V to be a multiple of its V tile {BV}, got "
                             f"V={V} (its K2 loads and stores U tiles without a mask)")
        self.fused_mod, self.mod = load_fused(path)
        device = q.device
        HK, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
        self.parent = forest.parents.to(device=device, dtype=torch.int64).view(B, T)
        self.tree = self.fused_mod.build_tree_structure_static(self.parent)
        # the kernels index q and k with q's strides: both dense [B, T, HK, K]
        self.q = q.reshape(B, T, HK, K).contiguous()
        self.k = k.reshape(B, T, HK, K).contiguous()
        self.v = v.reshape(B, T, HV, V)
        self.A_log, self.a, self.dt_bias, self.sp_beta, self.sp_threshold, self.b = (
            fused_gate_inputs(g.reshape(B, T, HV), beta.reshape(B, T, HV)))
        if state_indices is None:
            state_indices = torch.arange(B, device=device)
        self.state_indices = state_indices.to(device=device, dtype=torch.int32)
        self.initial_state = initial_state
        self.scale, self.use_qk_l2norm = scale, use_qk_l2norm
        self.precision = precision or ("ieee" if _interpreting() or device.type != "cuda" else "tf32")
        self.out_shape = (1, B * T, HV, V)
        self.lazy = None

    def gate_args(self):
        return (self.A_log, self.a, self.dt_bias, self.sp_beta, self.sp_threshold)

    def __call__(self) -> torch.Tensor:
        o, self.lazy = self.mod.tree_gdn_triton_verify(
            *self.gate_args(), self.q, self.k, self.v, self.b, self.initial_state,
            self.state_indices, self.tree, scale=self.scale,
            use_qk_l2norm_in_kernel=self.use_qk_l2norm, return_lazy_state=True,
            precision=self.precision)
        return o.view(self.out_shape)

    def torch_spec(self, solve_mode: str = "neumann") -> torch.Tensor:
        """The peer's torch specification (``tree_gdn_fused_verify``) on the same mapped inputs."""
        o = self.fused_mod.tree_gdn_fused_verify(
            *self.gate_args(), self.q, self.k, self.v, self.b, self.initial_state,
            self.state_indices, self.tree, scale=self.scale,
            use_qk_l2norm_in_kernel=self.use_qk_l2norm, solve_mode=solve_mode)
        return o.reshape(self.out_shape).to(self.v.dtype)
