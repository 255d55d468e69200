"""Argument checks shared by the kernels' public functions (STYLE 7: ValueError naming the value)."""

from __future__ import annotations

import os

import torch

from kernels.limits import MAX_TREE_NODES


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def check_tensor(name: str, t, dim: int, dtypes, device) -> None:
    """``t`` must be a ``dim``-d tensor of one of ``dtypes`` on ``device``."""
    if not isinstance(t, torch.Tensor) or t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-d tensor, got {getattr(t, 'shape', type(t))}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_attention_inputs(q, k_cache, v_cache) -> tuple[int, int, int, int]:
    """q [rows, Hq, D] and one layer's flat paged caches k_cache / v_cache [slots, Hkv, D] (float, on q's
    device, last dims contiguous, D <= 256, Hq a multiple of Hkv); returns (rows, Hq, D, Hkv)."""
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, 3, FLOATS, dev)
    N, HQ, D = q.shape
    if D > 256 or D < 1:
        raise ValueError(f"head dim {D} must be in [1, 256]")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, 3, FLOATS, dev)
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    HKV = k_cache.shape[1]
    if k_cache.shape[2] != D or HKV < 1 or HQ % HKV != 0:
        raise ValueError(f"k_cache must be [slots, Hkv, {D}] with {HQ} a multiple of Hkv, "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    return N, HQ, D, HKV


def attention_out(out, q, rows: int, HQ: int, D: int):
    """The attention kernels' output: ``out`` [rows, Hq, D] in q's dtype with a contiguous last dim, or
    a new one when None."""
    if out is None:
        return torch.empty(rows, HQ, D, dtype=q.dtype, device=q.device)
    check_tensor("out", out, 3, (q.dtype,), q.device)
    if tuple(out.shape) != (rows, HQ, D) or out.stride(2) != 1:
        raise ValueError(f"out must be [{rows}, {HQ}, {D}] with a contiguous last dim, got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    return out


def check_conv_inputs(x, weight, conv_state) -> tuple[int, int, int]:
    """The GDN conv's x [N, C] (last dim contiguous), depthwise weight [C, W >= 2] and window pool
    conv_state [slots, C, W - 1], float, on x's device; returns (N, C, W)."""
    check_tensor("x", x, 2, FLOATS, x.device if isinstance(x, torch.Tensor) else None)
    N, C = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dim, got strides {x.stride()}")
    check_tensor("weight", weight, 2, FLOATS, x.device)
    W = weight.shape[1]
    if weight.shape[0] != C or W < 2:
        raise ValueError(f"weight must be [{C}, W >= 2], got {tuple(weight.shape)}")
    check_tensor("conv_state", conv_state, 3, FLOATS, x.device)
    if tuple(conv_state.shape[1:]) != (C, W - 1):
        raise ValueError(f"conv_state must be [slots, {C}, {W - 1}], got {tuple(conv_state.shape)}")
    return N, C, W


def check_gdn_inputs(q, k, v, g, beta) -> tuple[int, int, int, int, int]:
    """The GDN recurrences' q / k [1, N, HK, K], v [1, N, HV, V] (HV a multiple of HK), g / beta
    [1, N, HV]; returns (N, HK, HV, K, V)."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, N, HK, K], got {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != q shape {tuple(q.shape)}")
    _, N, HK, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (1, N):
        raise ValueError(f"v must be [1, {N}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % HK != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads HK={HK}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (1, N, HV):
            raise ValueError(f"{name} must be [1, {N}, {HV}], got {tuple(t.shape)}")
    return N, HK, HV, K, V


FOREST_FIELDS = ("num_nodes", "num_requests", "max_nodes", "max_depth", "device", "parents", "depth",
                 "cu_seqlens", "request_ids", "anc", "anc_bits")


def check_forest(forest) -> None:
    """``forest`` carries a packed forest's fields (``bole.spec.tree.PackedForest``, duck-typed: the
    kernels read its tensors and sizes only)."""
    missing = [f for f in FOREST_FIELDS if not hasattr(forest, f)]
    if missing:
        raise ValueError(f"forest must be a packed forest, got {type(forest).__name__} without {missing}")


INDEX = (torch.int32, torch.int64)


def check_index(name: str, t, size: int, device, checked: bool = False) -> None:
    """``t`` must be an int32 / int64 vector of ``size`` entries on ``device``. ``checked``: ``t`` passed
    this check once for the whole forward (``check_forward_inputs``); only its size is compared."""
    if not checked:
        check_tensor(name, t, 1, INDEX, device)
    if t.shape[0] != size:
        raise ValueError(f"{name} must be [{size}], got {tuple(t.shape)}")


def check_checkpoint(pool, ends, slots, per_slot: tuple[int, ...], B: int, device, contiguous: bool = True) -> None:
    """A prefill's checkpoint arguments: ``pool`` [slots, *per_slot] on ``device`` (contiguous where
    asked), with ``ends`` and ``slots`` int [B] (the tokens of each sequence up to its checkpoint, 0: none;
    its slot)."""
    check_tensor("ckpt pool", pool, 1 + len(per_slot), FLOATS, device)
    if tuple(pool.shape[1:]) != tuple(per_slot):
        raise ValueError(f"the checkpoint pool must be [slots, {', '.join(map(str, per_slot))}], "
                         f"got {tuple(pool.shape)}")
    if contiguous and not pool.is_contiguous():
        raise ValueError("the checkpoint pool must be contiguous")
    if ends is None or slots is None:
        raise ValueError("a checkpoint pool needs ckpt_ends and ckpt_slots")
    check_index("ckpt_ends", ends, B, device)
    check_index("ckpt_slots", slots, B, device)


def check_forest_inputs(forest, state_indices, device, checked: bool = False) -> None:
    """A tree forward's forest, on ``device`` with a contiguous anc [N, D >= 1], and its requests' slots
    ``state_indices`` (int [B]; None: request b reads slot b). ``checked``: both passed this check once
    for the whole forward; only the slots' count is compared."""
    if not checked:
        check_forest(forest)
        if (forest.device != device or forest.anc.dim() != 2 or forest.anc.shape[1] < 1
                or not forest.anc.is_contiguous()):
            raise ValueError(f"forest must be on {device} with a contiguous anc [N, D >= 1], got anc "
                             f"{tuple(forest.anc.shape)} on {forest.device}")
    if state_indices is not None:
        check_index("state_indices", state_indices, forest.num_requests, device, checked)


def check_mask(mask, B: int, L: int, device, checked: bool = False) -> None:
    """An attention mask bool [B, 1, tq, L] on ``device`` (``checked``: only its sizes are compared)."""
    if not checked:
        check_tensor("mask", mask, 4, (torch.bool,), device)
    if mask.shape[0] != B or mask.shape[1] != 1 or mask.shape[3] != L:
        raise ValueError(f"mask must be [{B}, 1, tq, {L}], got {tuple(mask.shape)}")


def check_keys(kv_index, num_requests: int | None, device, mask=None, kv_len=None,
               checked: bool = False) -> tuple[int, int]:
    """The attention kernels' key layout: ``kv_index`` int [B, L] (each request's key slots; B =
    ``num_requests`` unless None), an optional ``mask`` bool [B, 1, tq, L] and an optional ``kv_len`` int
    [B], on ``device``; returns (B, L). ``checked``: they passed this check once for the whole forward
    (``check_forward_inputs``); only sizes are compared."""
    if not checked:
        check_tensor("kv_index", kv_index, 2, INDEX, device)
    B, L = kv_index.shape
    if num_requests is not None and B != num_requests:
        raise ValueError(f"kv_index must be [{num_requests}, L], got {tuple(kv_index.shape)}")
    if mask is not None:
        check_mask(mask, B, L, device, checked)
    if kv_len is not None:
        check_index("kv_len", kv_len, B, device, checked)
    return B, L


def check_forward_inputs(device, num_requests: int, num_tokens: int, state_indices, positions, slot_mapping,
                         forest=None, cu_seqlens=None, num_cached=None, keys=()) -> None:
    """What every layer's kernels share in one forward (a forward context's), checked once: the state
    slot of each request [B], the rotary positions and KV slots of each token [N], the forest of a tree
    forward, the token offsets [B+1] and committed lengths [B] of the requests, and each key layout in
    ``keys`` (``check_keys``' (kv_index, mask, kv_len)). Callers that ran it pass ``checked=True`` to the
    per-layer kernels, which then check only their own tensors and compare the shared ones' sizes; a bad
    argument is refused either way, by name (docs/DESIGN.md §8)."""
    if cu_seqlens is not None:
        check_index("cu_seqlens", cu_seqlens, num_requests + 1, device)
    if num_cached is not None:
        check_index("num_cached", num_cached, num_requests, device)
    for kv_index, mask, kv_len in keys:
        check_keys(kv_index, num_requests, device, mask, kv_len)
    if forest is not None:
        check_forest_inputs(forest, None, device)
        if forest.num_nodes != num_tokens or forest.num_requests != num_requests:
            raise ValueError(f"forest has {forest.num_nodes} nodes of {forest.num_requests} requests, the "
                             f"forward {num_tokens} tokens of {num_requests}")
    check_index("state_indices", state_indices, num_requests, device)
    check_index("positions", positions, num_tokens, device)
    check_index("slot_mapping", slot_mapping, num_tokens, device)


def check_verify_inputs(q, k, v, g, beta, forest, initial_state, state_indices,
                        checked: bool = False) -> tuple[int, int, int, int, int]:
    """The tree verifier's inputs (kernels/gdn_tree_verify.py): float q / k / v / g / beta with the GDN
    shapes, head dims <= 256, a forest of trees of at most MAX_TREE_NODES nodes matching them, an
    optional state pool [slots, HV, V, K] (fp32 or bf16, contiguous) and slot indices [B], all on q's
    device; returns (N, HK, HV, K, V). ``checked``: the forest and slots passed ``check_forest_inputs``."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOATS:
            raise ValueError(f"{name} must be a float32/float16/bfloat16 tensor, got "
                             f"{getattr(t, 'dtype', type(t))}")
    N, HK, HV, K, V = check_gdn_inputs(q, k, v, g, beta)  # the twin's shape rules
    if K > 256 or V > 256:
        raise ValueError(f"head dims K={K}, V={V} exceed 256")
    dev = q.device
    check_forest_inputs(forest, state_indices, dev, checked)
    if forest.num_nodes != N:
        raise ValueError(f"forest has {forest.num_nodes} nodes but the inputs have {N} tokens")
    if forest.max_nodes > MAX_TREE_NODES:
        raise ValueError(f"a tree of {forest.max_nodes} nodes exceeds the kernel's limit of {MAX_TREE_NODES}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q on {dev}")
    B = forest.num_requests
    if initial_state is not None:
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (HV, V, K):
            raise ValueError(f"initial_state must be [slots, {HV}, {V}, {K}], "
                             f"got {tuple(initial_state.shape)}")
        if initial_state.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"initial_state must be float32 or bfloat16, got {initial_state.dtype}")
        if not initial_state.is_contiguous():
            raise ValueError("initial_state must be contiguous (K fastest)")
        if initial_state.device != dev:
            raise ValueError(f"initial_state is on {initial_state.device}, q on {dev}")
        if state_indices is None and initial_state.shape[0] < B:
            raise ValueError(f"{B} requests but only {initial_state.shape[0]} state slots")
    return N, HK, HV, K, V


def check_out(name: str, t, shape, dtype, device):
    """An optional preallocated output: a new tensor when None, else contiguous ``dtype`` of ``shape``."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}"
                         + ("" if t.is_contiguous() else " (not contiguous)"))
    return t
