"""Per-step forward metadata: one ``ForwardContext`` built once per model call (STYLE item 3).

A forward call runs ONE mode over a batch of B requests whose new tokens are packed into one flat
list of N tokens (``cu_seqlens``):

    prefill  any number of new tokens per request, continuing from ``num_cached`` tokens already in
             the caches (chunked prefill: a prompt may arrive over several steps). Requests with one
             new token are fine too, so a mixed prefill + decode batch can run as one prefill call.
    decode   exactly one new token per request (the fast path).
    verify   the new tokens are the nodes of a packed draft forest (``forest``): node i of request b
             has position id num_cached[b] + depth(i) - 1, attends to the committed prefix, its
             ancestors and itself, and reads the GDN/conv state of the committed prefix. Nothing is
             committed: the GDN pools are only read; per-node factors go to ``factors`` and the
             tree nodes' K/V are written at positions num_cached[b] + local_index in the request's
             blocks. ``HybridForCausalLM.commit(ctx, accepted)`` then materialises the accepted
             path (GDN ssm for all layers in one call, conv windows, K/V moved into place).

``static`` (decode only) marks a context built over fixed-shape device buffers for CUDA-graph capture
(``bole.engine.graphs.decode``): the host lists (``cu_host`` aside) are empty, attention reads the keys
through ``static.kv_index`` / ``static.kv_valid`` (padded to a fixed KV length) and the GDN layers use
the batched one-token conv and recurrence, so nothing in the forward reads a device value on the host.

Caches travel in the context (``kv_cache`` for the full-attention layers, ``state_pool`` for the
GDN layers) so the same model object can run against the target caches or, for the MTP drafter,
against the drafter's own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal, Sequence

import torch

from bole.backend import FLA_MIN_TOKENS
from bole.cache.kv_cache import PagedKVCache
from bole.cache.state_pool import StatePool
from bole.spec.tree import PackedForest
from kernels._checks import check_forward_inputs, check_keys, check_mask

Mode = Literal["prefill", "decode", "verify"]
MODES = ("prefill", "decode", "verify")


@dataclass
class TreeFactors:
    """What the commit needs from a verification step, for every GDN layer (one buffer).

    k       [L, N, HK, K]   raw (pre-L2-norm) keys after the conv, compute dtype of the layer
    u       [L, N, HV, V]   fp32 corrected values (eq. 2)
    logp    [L, N, HV]      fp32 path log decays
    conv_x  [L, N, conv_dim] conv inputs (the mixed q/k/v projections) of every node
    snapshots [L, N, HV, V, K] or None: only for the ``serial_tree`` baseline, which verifies with the
            serial per-node recurrence and commits by copying the accepted node's snapshot (what
            SGLang does); Bole's own path never allocates it.
    """

    k: torch.Tensor
    u: torch.Tensor
    logp: torch.Tensor
    conv_x: torch.Tensor
    snapshots: torch.Tensor | None = None

    @staticmethod
    def allocate(cfg, num_nodes: int, dtype=torch.float32, device=None, tp_size: int = 1,
                 snapshots: bool = False, state_dtype=torch.float32) -> "TreeFactors":
        L = cfg.num_gdn_layers
        HK, HV = cfg.linear_num_key_heads // tp_size, cfg.linear_num_value_heads // tp_size
        f32 = dict(dtype=torch.float32, device=device)
        return TreeFactors(
            k=torch.empty(L, num_nodes, HK, cfg.linear_key_head_dim, dtype=dtype, device=device),
            u=torch.empty(L, num_nodes, HV, cfg.linear_value_head_dim, **f32),
            logp=torch.empty(L, num_nodes, HV, **f32),
            conv_x=torch.empty(L, num_nodes, cfg.conv_dim // tp_size, dtype=dtype, device=device),
            snapshots=torch.empty(L, num_nodes, HV, cfg.linear_value_head_dim, cfg.linear_key_head_dim,
                                  dtype=state_dtype, device=device) if snapshots else None,
        )

    @staticmethod
    def transient_bytes(cfg, num_nodes: int, dtype=torch.bfloat16, tp_size: int = 1) -> dict[str, int]:
        """Bytes of the per-node speculative state for ``num_nodes`` nodes, all GDN layers, as allocated.

        ``factors``: what the factorized commit needs (k, u, logP); ``snapshots``: the per-node fp32
        states of the serial_tree baseline (SGLang's layout); ``conv_inputs``: the conv inputs both
        keep. Sized on the meta device from ``allocate`` itself, so the figures follow the buffers.
        """
        f = TreeFactors.allocate(cfg, num_nodes, dtype=dtype, device="meta", tp_size=tp_size, snapshots=True)
        size = lambda t: t.numel() * t.element_size()
        return {"factors": size(f.k) + size(f.u) + size(f.logp), "snapshots": size(f.snapshots),
                "conv_inputs": size(f.conv_x)}

    def narrow(self, num_nodes: int) -> "TreeFactors":
        """A view of the first num_nodes nodes (for a preallocated max-size buffer)."""
        return TreeFactors(*(t[:, :num_nodes] for t in (self.k, self.u, self.logp, self.conv_x)),
                           snapshots=None if self.snapshots is None else self.snapshots[:, :num_nodes])


@dataclass
class StaticDecode:
    """Fixed-shape key metadata of a graph-capturable decode step (B rows, a KV length bucket L).

    kv_index  int64 [B, L]  flat KV slot of key position p of row b (block_table[p // bs] * bs + p % bs)
    kv_valid  bool  [B, L]  p <= num_cached[b] (the committed prefix plus the new token)
    kv_len    int64 [B]     num_cached[b] + 1, the valid keys (the paged decode kernel's form)
    """

    kv_index: torch.Tensor
    kv_valid: torch.Tensor
    kv_len: torch.Tensor | None = None


@dataclass
class PaddedAttention:
    """The batch's keys and masks laid out for one SDPA call per attention layer (verify and decode).

    Row b*tq + t holds token t of request b (tq = its widest request); key column p of request b is
    its p-th key (committed prefix, then its new tokens). Built once per forward, shared by every
    attention layer, on the device with no host read of a device value.

    kv_index  int64 [B, L]       flat KV slot of key p of request b (0 past its keys: masked)
    mask      bool  [B, 1, tq, L] prefix keys, then causal (decode) or ancestor-or-self (verify) among
                                  the new tokens; padding rows see key 0 only (no all-masked row)
    rows      int64 [N]          the padded row of each flat token
    """

    kv_index: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    tq: int


@dataclass
class PrefillCheckpoints:
    """Prefix-cache checkpoints a prefill forward writes (``bole.cache.prefix_cache``): the GDN state and
    conv window of sequence b after its first ``ends[b]`` tokens of the forward (0: none) go to slot
    ``slots[b]`` of ``pool``, every GDN layer, from inside the layer's conv and recurrence. A prompt that
    crosses a checkpoint boundary then takes one forward, not a chunk to the boundary and its tail.

    pool   StatePool (the prefix cache's checkpoint pool)
    ends   int32 [B] device; slots int32 [B] device (a row without a checkpoint names any valid slot)
    """

    pool: StatePool
    ends: torch.Tensor
    slots: torch.Tensor

    def conv_args(self, layer: int) -> dict:
        return dict(ckpt_conv=self.pool.conv[layer], ckpt_ends=self.ends, ckpt_slots=self.slots)

    def ssm_args(self, layer: int) -> dict:
        return dict(ckpt_state=self.pool.ssm[layer], ckpt_ends=self.ends, ckpt_slots=self.slots)


@dataclass
class ForwardContext:
    """Everything a layer needs besides its weights and the hidden states.

    Attributes (device tensors unless noted):
        mode:          "prefill" | "decode" | "verify".
        cu_seqlens:    int32 [B+1]; request b owns flat tokens cu_seqlens[b]:cu_seqlens[b+1].
        num_cached:    int64 [B]; tokens of each request already in the caches (committed length).
        positions:     int64 [N]; rotary position ids.
        kv_positions:  int64 [N]; cache position each token's K/V is written to (num_cached + local
                       index; equals ``positions`` except in verify).
        slot_mapping:  int64 [N]; flat KV slot of each token (block_table[p // bs] * bs + p % bs).
        kv_slots:      list (host) per request: int64 [num_cached + T_b] flat slots of all the keys the
                       request's new tokens may attend to (prefix then new tokens).
        state_slots:   int64 [B]; GDN state pool slot of each request.
        block_tables:  host list of each request's block ids.
        forest / factors: verify only.
        cu_host, num_cached_host: host copies of cu_seqlens / num_cached.
        state_slots_host: host copy of state_slots (``build``; empty in static contexts).
        static:        ``StaticDecode`` for a graph-capturable decode context (``kv_slots``,
                       ``block_tables`` and ``num_cached_host`` are then empty), else None.
        sync_free:     (host) a prefill that must read no device value on the host, at any length: the
                       GDN layers take the backend's ``prefill_sync_free`` and the attention layers their
                       one-launch ``prefill_attention``. ``PrefillGraphs`` sets it at every length;
                       ``build`` sets it for prefills of fewer than ``bole.backend.FLA_MIN_TOKENS``
                       tokens (the whole forward's: launches and host work decide there). The layers
                       read only this flag (the backend's ``prefill`` keeps its own length test for
                       direct callers: benchmarks, tests); longer eager prefills take the
                       backend's ``prefill`` (fla's chunk; the recurrence in fp32) and the
                       per-request SDPA.
        checkpoints:   ``PrefillCheckpoints`` a prefill writes (prefill only; None: none).
    """

    mode: Mode
    cu_seqlens: torch.Tensor
    num_cached: torch.Tensor
    positions: torch.Tensor
    kv_positions: torch.Tensor
    slot_mapping: torch.Tensor
    kv_slots: list
    state_slots: torch.Tensor
    block_tables: list
    cu_host: list
    num_cached_host: list
    kv_cache: PagedKVCache | None = None
    state_pool: StatePool | None = None
    forest: PackedForest | None = None
    factors: TreeFactors | None = None
    static: StaticDecode | None = None
    state_slots_host: list = field(default_factory=list)
    sync_free: bool = False
    checkpoints: PrefillCheckpoints | None = None
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # per-forward layouts, built once

    def check_kernel_inputs(self) -> None:
        """The kernels' checks of what every layer shares (state slots, positions, KV slots, forest:
        ``kernels._checks.check_forward_inputs``), once per forward; the backend's per-layer kernels then
        skip them (``checked=True``, bole.backend). Every mixer calls it before its kernels. The key
        layouts checked: the static decode's and those a graph set in the memo; the ones built later
        (``padded_attention``, ``key_index``) are checked where they are built."""
        if "checked" not in self._memo:
            keys = [(self.static.kv_index, None, self.static.kv_len)] if self.static is not None else []
            if "padded" in self._memo:
                keys.append((self._memo["padded"].kv_index, self._memo["padded"].mask, None))
            if "keys" in self._memo:
                keys.append((self._memo["keys"], None, None))
            check_forward_inputs(self.positions.device, self.num_requests, self.num_tokens, self.state_slots,
                                 self.positions, self.slot_mapping, self.forest, self.cu_seqlens, self.num_cached,
                                 keys)
            self._memo["checked"] = True

    def padded_attention(self) -> PaddedAttention:
        """The batched attention layout of a verify or decode step (see ``PaddedAttention``), memoized."""
        if "padded" not in self._memo:
            pa = self._build_padded_attention()
            check_mask(pa.mask, *pa.kv_index.shape, self.slot_mapping.device)  # once (the kernels skip it);
            # its kv_index is key_index(), checked there
            self._memo["padded"] = pa
        return self._memo["padded"]

    def key_index(self) -> torch.Tensor:
        """int64 [B, L]: request b's key slots (``kv_slots[b]``: prefix, then its new tokens), 0 past them;
        built once per forward, shared by every attention layer."""
        if "keys" not in self._memo:
            keys = self.kv_slots[0][None] if len(self.kv_slots) == 1 else \
                torch.nn.utils.rnn.pad_sequence(self.kv_slots, batch_first=True)
            check_keys(keys, self.num_requests, self.slot_mapping.device)  # once (the kernels skip it)
            self._memo["keys"] = keys
        return self._memo["keys"]

    def _build_padded_attention(self) -> PaddedAttention:
        if self.mode not in ("verify", "decode"):
            raise ValueError(f"padded attention is for verify / decode steps, not {self.mode}")
        cu, nc = self.cu_host, self.num_cached_host
        B = self.num_requests
        counts = [cu[b + 1] - cu[b] for b in range(B)]
        tq = max(counts)
        dev = self.slot_mapping.device
        kv_index = self.key_index()                                                          # [B, L]
        L = kv_index.shape[1]
        req = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
        rows_host = req * tq + torch.arange(cu[-1]) - torch.tensor(cu[:-1])[req]
        rows = rows_host.to(dev)
        P = torch.tensor(nc, device=dev)[:, None, None]
        T = torch.tensor(counts, device=dev)[:, None, None]
        t = torch.arange(tq, device=dev)[None, :, None]
        rel = torch.arange(L, device=dev)[None, None, :] - P                               # [B, 1, L]
        if self.mode == "verify":
            anc = self.forest.anc.long()                                                    # [N, D] local
            tree = torch.zeros(B * tq, tq + 1, dtype=torch.bool, device=dev)
            tree[rows[:, None].expand_as(anc), torch.where(anc >= 0, anc, tq)] = True
            tree = tree[:, :tq].view(B, tq, tq)
            new = tree.gather(2, rel.clamp(0, tq - 1).expand(B, tq, L)) & (rel >= 0) & (rel < T)
        else:
            new = (rel >= 0) & (rel <= t) & (rel < T)
        valid_row = t < T                                                                   # [B, tq, 1]
        mask = ((rel < 0) | new) & valid_row
        mask[:, :, 0] |= ~valid_row[:, :, 0]
        return PaddedAttention(kv_index=kv_index, mask=mask[:, None], rows=rows, tq=tq)

    def suffix(self, start: int) -> "ForwardContext":
        """Rows ``start``.. of every request of a verify context whose requests hold T nodes each: their
        queries, K/V writes and positions, over the same keys and mask rows (the earlier nodes are keys
        only; their K/V must be in the cache already). The MTP drafter's levels run only their new
        frontier this way (``bole.engine.drafting``). Device ops only: a captured draft takes it too.
        The view has no forest: attention layers take its batched layout (``padded_attention``), not
        the per-request reference path, and it has no GDN factors (the drafter has no GDN layer)."""
        B = self.num_requests
        T = self.num_tokens // B if B else 0
        if self.mode != "verify" or self.cu_host != list(range(0, B * T + 1, T or 1)) or not 0 <= start < T:
            raise ValueError(f"suffix({start}) needs a verify context of equal trees longer than {start}, got "
                             f"{self.mode} with token offsets {self.cu_host[:4]}...")
        M, dev = T - start, self.positions.device
        rows = lambda t: t.view(B, T)[:, start:].reshape(-1)
        pa = self.padded_attention()
        ctx = ForwardContext(
            mode="verify", cu_seqlens=torch.arange(0, B * M + 1, M, dtype=torch.int32, device=dev),
            num_cached=self.num_cached + start, positions=rows(self.positions),
            kv_positions=rows(self.kv_positions), slot_mapping=rows(self.slot_mapping), kv_slots=self.kv_slots,
            state_slots=self.state_slots, block_tables=self.block_tables, cu_host=list(range(0, B * M + 1, M)),
            num_cached_host=[n + start for n in self.num_cached_host], kv_cache=self.kv_cache,
            state_pool=self.state_pool, state_slots_host=self.state_slots_host)
        ctx._memo["padded"] = PaddedAttention(kv_index=pa.kv_index, mask=pa.mask[:, :, start:],
                                              rows=torch.arange(B * M, device=dev), tq=M)
        return ctx

    def tree_mask(self, b: int) -> torch.Tensor:
        """Request b's ancestor-or-self mask [T_b, T_b] (verify), built once per forward and shared by
        every attention layer (building it reads the forest on the host)."""
        if ("tree", b) not in self._memo:
            if self.forest is None:
                raise ValueError("this verify context has no forest (a ``suffix`` view): its attention takes the "
                                 "batched layout, padded_attention()")
            self._memo["tree", b] = self.forest.ancestor_mask(b)
        return self._memo["tree", b]

    @property
    def num_requests(self) -> int:
        return len(self.cu_host) - 1

    @property
    def num_tokens(self) -> int:
        return self.cu_host[-1]

    @staticmethod
    def build(mode: Mode, num_new_tokens: Sequence[int], num_cached: Sequence[int],
              state_slots: Sequence[int], block_tables: Sequence[Sequence[int]],
              kv_cache: PagedKVCache | None, state_pool: StatePool | None,
              forest: PackedForest | None = None, factors: TreeFactors | None = None,
              device=None, checkpoints: tuple[StatePool, Sequence[int], Sequence[int]] | None = None
              ) -> "ForwardContext":
        """Validate the step's batch and derive positions and KV slots.

        For verify, ``num_new_tokens`` may be None: it is taken from ``forest``. ``checkpoints``
        (prefill): (pool, ends, slots) as ``PrefillCheckpoints``, host lists; an end must lie inside its
        request's new tokens (1 .. T_b - 1) or be 0.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "verify":
            if forest is None:
                raise ValueError("verify mode needs a PackedForest")
            cu = [int(c) for c in forest.cu_seqlens.tolist()]
            counts = [b - a for a, b in pairwise(cu)]
            if num_new_tokens is not None and list(num_new_tokens) != counts:
                raise ValueError(f"num_new_tokens {list(num_new_tokens)} disagree with the forest {counts}")
            num_new_tokens = counts
        elif forest is not None or factors is not None:
            raise ValueError(f"forest/factors are for verify mode only, not {mode}")
        B = len(num_new_tokens)
        for name, seq in (("num_cached", num_cached), ("state_slots", state_slots),
                          ("block_tables", block_tables)):
            if len(seq) != B:
                raise ValueError(f"{name} has {len(seq)} entries for {B} requests")
        if B == 0 or any(int(n) < 1 for n in num_new_tokens):
            raise ValueError(f"every request needs >= 1 new token, got {list(num_new_tokens)}")
        if mode == "decode" and any(int(n) != 1 for n in num_new_tokens):
            raise ValueError(f"decode mode takes exactly one token per request, got {list(num_new_tokens)}")
        if any(int(c) < 0 for c in num_cached):
            raise ValueError(f"num_cached must be >= 0, got {list(num_cached)}")
        if device is None:
            device = kv_cache.device if kv_cache is not None else (
                state_pool.ssm.device if state_pool is not None else torch.device("cpu"))
        cu = [0]
        for n in num_new_tokens:
            cu.append(cu[-1] + int(n))
        nc = [int(c) for c in num_cached]
        kv_pos = torch.cat([torch.arange(c, c + int(n)) for c, n in zip(nc, num_new_tokens, strict=True)])
        if mode == "verify":
            rep = torch.repeat_interleave(torch.tensor(nc), torch.tensor(list(num_new_tokens)))
            positions = rep + forest.depth.cpu().long() - 1
        else:
            positions = kv_pos.clone()
        kv_slots, slot_mapping = [], torch.zeros(cu[-1], dtype=torch.long)
        if kv_cache is not None:
            for b in range(B):
                end = nc[b] + int(num_new_tokens[b])
                slots = kv_cache.slots_for(block_tables[b], torch.arange(end))
                kv_slots.append(slots.to(device))
                slot_mapping[cu[b]:cu[b + 1]] = slots[nc[b]:]
        if factors is not None and factors.k.shape[1] != cu[-1]:
            raise ValueError(f"factor buffer holds {factors.k.shape[1]} nodes, the forest {cu[-1]}")
        if mode == "verify" and factors is None:
            raise ValueError("verify mode needs a TreeFactors buffer (TreeFactors.allocate)")
        ckpt = None
        if checkpoints is not None:
            pool, ends, ck_slots = checkpoints
            ends, ck_slots = [int(e) for e in ends], [int(s) for s in ck_slots]
            if mode != "prefill" or len(ends) != B or len(ck_slots) != B:
                raise ValueError(f"checkpoints are for prefill, one (end, slot) per request: {mode}, {B} requests, "
                                 f"{len(ends)} ends, {len(ck_slots)} slots")
            bad = [b for b in range(B) if not (ends[b] == 0 or 0 < ends[b] < int(num_new_tokens[b]))
                   or not 0 <= ck_slots[b] < pool.num_slots]
            if bad:
                raise ValueError(f"checkpoint (end, slot) of request {bad[0]} is ({ends[bad[0]]}, {ck_slots[bad[0]]}): "
                                 f"the end must be 0 or inside its {int(num_new_tokens[bad[0]])} new tokens, the slot "
                                 f"in [0, {pool.num_slots})")
            as_dev = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
            ckpt = PrefillCheckpoints(pool, as_dev(ends), as_dev(ck_slots))
        return ForwardContext(
            mode=mode,
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            num_cached=torch.tensor(nc, dtype=torch.long, device=device),
            positions=positions.to(device),
            kv_positions=kv_pos.to(device),
            slot_mapping=slot_mapping.to(device),
            kv_slots=kv_slots,
            state_slots=torch.tensor([int(s) for s in state_slots], dtype=torch.long, device=device),
            block_tables=[list(map(int, t)) for t in block_tables],
            cu_host=cu,
            num_cached_host=nc,
            kv_cache=kv_cache,
            state_pool=state_pool,
            forest=None if forest is None else forest.to(device),
            sync_free=mode == "prefill" and cu[-1] < FLA_MIN_TOKENS,
            factors=factors,
            state_slots_host=[int(s) for s in state_slots],
            checkpoints=ckpt,
        )
