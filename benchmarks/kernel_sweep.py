"""Which launch configurations of kernels.gdn_tree_verify the benchmark tries, and compiling them ahead.

Candidates come from ``configs`` (a list) or ``configs_for(K, V, tile)`` (benchmarks/verify_space.py; tile:
the kernel module's ``chunk_tile(T)[0]``, else BT); an entry is a dict of keyword arguments or a config object
passed as ``config=``. Every candidate is a fresh Triton compile per (model, T) (HV and the tree tile
are constexprs, the batch is not), and big-tile compiles take tens of seconds, so ``--sweep auto`` keeps
the sweep small:

    first row of a (model, T), per ``method``: the kernel's ``default_config`` for that row and method
        (``default_config(..., method=m)`` when it takes one) and its neighbours (block_v halved /
        doubled, the other num_warps); all of them also with tf32 dots, the default also with tf32x3.
    later rows of that (model, T): per method the 2 fastest of the first row, plus the row's own
        default per method (without methods: the 4 fastest overall plus the default).
    every row: the engine's own launch, ``tuned=True`` (the kernel's measured dispatch table), as
        method "tuned".
``--sweep full`` tries every candidate × method × precision on every row.
``row_defaults`` lists a later row's own defaults, so that ``precompile`` compiles only what is timed.

``precompile`` runs one launch of each candidate (and of SGLang's kernel per distinct total-token
count, its NP2_T constexpr) in a pool of worker processes, which fills Triton's on-disk cache; the
main process then loads the binaries instead of compiling them one after the other. A candidate that
fails there (bad config, out of resources, a crash) or has not compiled when the precompile budget
runs out is never launched in the main process.
"""

from __future__ import annotations

import inspect
import multiprocessing
import time

import triton


def _fields(c) -> dict:
    return {f: getattr(c, f) for f in getattr(c, "__dataclass_fields__", {})}


class BoleKernel:
    def __init__(self, fn, module=None, configs=None, configs_for=None):
        self.fn, self.module, self.configs, self.configs_for = fn, module, configs, configs_for
        self.ranked: dict[tuple, list[str]] = {}  # (model, T) -> labels, fastest first
        self.failed: set[tuple] = set()  # (model, T, label) that failed in a worker
        self._known: dict[tuple, list[dict]] = {}  # (model, T) -> first-row candidates
        self.only: list[str] | None = None  # restrict to these methods ("tuned": the engine's launch)
        self.precisions: list[str] | None = None  # restrict to these input precisions

    @staticmethod
    def label(kw: dict) -> str:
        parts = []
        for key, val in kw.items():
            f = _fields(val)
            parts += [f"{n}={x}" for n, x in f.items()] if f else [f"{key}={val}"]
        return ",".join(parts) or "default"

    def _accepts(self, name: str) -> bool:
        return name in inspect.signature(self.fn).parameters

    def _base(self, K, V, BT, method=None) -> list:
        if self.configs is not None:
            return list(self.configs)
        if self.configs_for is not None:
            if method is not None and "method" in inspect.signature(self.configs_for).parameters:
                return list(self.configs_for(K, V, BT, method=method))
            return list(self.configs_for(K, V, BT))
        return []

    def methods(self) -> list:
        """The kernel's methods (``METHODS``) when it takes ``method=``, else [None]."""
        ms = list(getattr(self.module, "METHODS", None) or []) if self._accepts("method") else []
        if ms and self.only is not None:
            ms = [m for m in ms if m in self.only]
        return ms or ([] if self.only is not None else [None])

    def _default(self, K, V, BT, heads_x_requests, method):
        mod = self.module
        if mod is None or not hasattr(mod, "default_config"):
            return None
        if method is not None and "method" in inspect.signature(mod.default_config).parameters:
            return mod.default_config(K, V, BT, heads_x_requests, method=method)
        return mod.default_config(K, V, BT, heads_x_requests)

    def _per_method(self, s: dict, T: int, batch: int, mode: str) -> list[tuple]:
        """[(method, [kwargs, default first])] before the precision variants."""
        K, V = s["K"], s["V"]
        BT = max(16, triton.next_power_of_2(T))
        if hasattr(self.module, "chunk_tile"):  # the kernel's configurations are per chunk tile
            BT = self.module.chunk_tile(T)[0]
        out = []
        for m in self.methods():
            base = self._base(K, V, BT, m)
            default = self._default(K, V, BT, batch * s["HV"], m)
            if default is not None and mode == "auto" and _fields(default):
                d = _fields(default)

                def near(c, d=d, default=default):
                    diff = {n for n, x in _fields(c).items() if d.get(n) != x}
                    return (diff == {"num_warps"} or diff == {"block_v"}
                            and c.block_v in (default.block_v // 2, default.block_v * 2))

                base = [c for c in base if not isinstance(c, dict) and near(c)]
            if default is not None:
                base = [default] + [c for c in base if c != default]
            kws = [dict(c) if isinstance(c, dict) else {"config": c} for c in base] or [{}]
            out.append((m, [kws_ if m is None else dict(kws_, method=m) for kws_ in kws]))
        return out

    def _tuned(self) -> list[dict]:
        """The engine's own launch (``tuned=True``: the kernel's measured dispatch table), when it has one."""
        return [{"tuned": True}] if self._accepts("tuned") and (self.only is None or "tuned" in self.only) else []

    def first_row(self, s: dict, T: int, batch: int, mode: str) -> list[dict]:
        """Candidates for the first row of a (model, T) (every row with ``mode == 'full'``)."""
        per = self._per_method(s, T, batch, mode)
        kws = [kw for _, mk in per for kw in mk]
        if self._accepts("input_precision"):
            # tf32 for every candidate; tf32x3 (about fp32-exact on tensor cores) for each default
            kws += ([dict(kw, input_precision="tf32") for kw in kws]
                    + [dict(mk[0], input_precision="tf32x3") for _, mk in per])
            if self.precisions is not None:
                kws = [kw for kw in kws if kw.get("input_precision", "ieee") in self.precisions]
        return kws + self._tuned()

    def row_defaults(self, s: dict, T: int, batch: int) -> list[dict]:
        """A later row's own defaults, one per method, and the engine's launch."""
        return [mk[0] for _, mk in self._per_method(s, T, batch, "auto")] + self._tuned()

    @staticmethod
    def method_of(kw: dict):
        return kw.get("method") or ("tuned" if kw.get("tuned") else None)

    def candidates(self, s: dict, T: int, batch: int, mode: str, key) -> list[dict]:
        ranked = self.ranked.get(key)
        if mode == "auto" and ranked:
            known = {self.label(kw): kw for kw in self._known.get(key, [])}
            ms = self.methods()
            per_method = 4 if ms == [None] else 2
            keep = []
            for m in ms:
                keep += [known[lab] for lab in ranked if lab in known
                         and self.method_of(known[lab]) == m][:per_method]
            labels = {self.label(kw) for kw in keep}
            kws = keep + [kw for kw in self.row_defaults(s, T, batch) if self.label(kw) not in labels]
        else:
            kws = self.first_row(s, T, batch, mode)
            self._known.setdefault(key, []).extend(kws)
        return [kw for kw in kws if (*key, self.label(kw)) not in self.failed]


def _compile_task(kind, model, batch, T, kw):
    """Worker: one launch at the row's shapes (fills Triton's disk cache). Returns an error or None."""
    import torch

    from benchmarks.gdn_verify import make_inputs
    from benchmarks.peers import SGLangTreeVerifier

    try:
        x = make_inputs(model, batch, T, "cuda", seed=0)
        common = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["forest"], x["pool"], x["state_indices"])
        if kind == "sglang":
            SGLangTreeVerifier(*common, use_qk_l2norm=True)()
        elif kind in ("sglang_chunk", "sglang_fused"):
            from benchmarks.gdn_verify import make_peer

            make_peer(kind, common)()
        else:
            from kernels.gdn_tree_verify import gdn_tree_verify

            gdn_tree_verify(*common, use_qk_l2norm=True, **kw)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported back; the main process skips this candidate
        return f"{type(e).__name__}: {str(e)[:300]}"


def precompile(tasks, workers: int, bole: BoleKernel | None, notes: list, timeout_s: float,
               first_trees=(), fn=None) -> float:
    """tasks: (kind, model, batch, T, kwargs). Returns the seconds spent.

    Trees in ``first_trees`` (the bar rows') first, then largest trees first (their compiles are the
    slow ones). At ``timeout_s`` the pool is terminated: a bole variant still compiling or not yet
    started then counts as failed (the main process never launches it), because a compile that has
    not finished by then may take minutes more (4-warp BT=128 variants did not finish on the H200);
    an unfinished SGLang task (any of its verifiers) compiles on demand. ``fn`` replaces the worker task (tests).
    """
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    tasks = sorted(tasks, key=lambda t: (t[3] not in first_trees, -t[3]))
    pool = ctx.Pool(processes=max(1, workers))
    unfinished = 0
    try:
        pending = [(t, pool.apply_async(fn or _compile_task, t)) for t in tasks]
        for (kind, model, batch, T, kw), res in pending:
            try:
                err = res.get(timeout=max(0.0, t0 + timeout_s - time.time()))
            except multiprocessing.TimeoutError:
                unfinished += 1
                err = (None if kind.startswith("sglang")
                       else f"not compiled within the precompile budget ({timeout_s:.0f}s)")
            except Exception as e:  # not the kernel's fault (e.g. pickling): compile on demand
                notes.append(f"precompile task failed: {type(e).__name__}: {e}")
                continue
            if err and kind == "bole" and bole is not None:
                bole.failed.add((model, T, bole.label(kw)))
                notes.append(f"precompile {model} T={T} {bole.label(kw)}: {err}")
            elif err:
                notes.append(f"precompile {kind} {model} b={batch} T={T}: {err}")
    finally:
        pool.terminate()
        pool.join()
    if unfinished:
        notes.append(f"precompile stopped after {timeout_s:.0f}s: {unfinished} tasks unfinished")
    return time.time() - t0
