"""Checkpoint planning for speculative commits: which checkpoint slots a step writes, and what they become.

A *checkpoint* is a copy of a request's GDN state (ssm + conv of every GDN layer) after a prefix whose
length is a multiple of the prefix cache's ``interval``, hung on the cached block ending there
(``bole.cache.prefix_cache``). Prefill chunks and commits that land on a boundary take one by copying
the request's state slot (``PrefixCache.checkpoint``). A speculative commit of a path of n nodes from
``num_computed`` may instead jump over a boundary: the state there never sits in the request's slot,
so the accepted path cut at the boundary is committed into a checkpoint slot (one per request and
step, the deepest boundary) by the step's acceptance and commit (``bole.engine.acceptance``), on the
device, in a CUDA graph's tail or eagerly alike: so a slot is reserved beforehand (``reserve_tail``)
for every request whose longest possible path could cross. A free slot when there is one, else the
slot of a least recently used checkpoint (its *victim*), which stays intact unless the path really
crosses. Afterwards (``settle_tail``) unused free slots are given back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from bole.cache.prefix_cache import CachedBlock, PrefixCache


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint written this step, attached once its block is published: the state after ``end``
    tokens, in checkpoint slot ``slot``."""

    end: int
    slot: int


@dataclass(frozen=True)
class Reservation:
    """A checkpoint slot a step's commit may write for one request: a free slot (``victim`` None, given
    back if unused) or the slot of ``victim``'s checkpoint (dropped only if the commit writes it)."""

    slot: int
    victim: CachedBlock | None = None


@dataclass(frozen=True)
class TailPlan:
    """Per request of a speculative step, its reservation (None: its paths cannot cross a boundary);
    empty when no request's can."""

    reserved: tuple[Reservation | None, ...] = ()

    @property
    def slots(self) -> list[int | None] | None:
        """The commit's checkpoint slot per request (the runner's argument); None when nothing is reserved."""
        return [r and r.slot for r in self.reserved] if self.reserved else None


class CheckpointPlanner:
    """Plans a speculative step's checkpoints over ``cache``'s slots (see the module docstring)."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache

    def reserve_tail(self, starts: Sequence[int], longest: int, tail_takes_checkpoints: bool) -> TailPlan | None:
        """Reserve a slot for every request (committed length ``starts[b]``) whose path of up to
        ``longest`` nodes could cross a boundary. None when the commit cannot take them (a graph tail
        without checkpoints, or no slot to write): a graph step goes on eagerly, an eager step takes
        no checkpoint."""
        cache = self.cache
        may = [cache.path_cut(s, longest) > 0 for s in starts]
        if not any(may):
            return TailPlan()
        if not tail_takes_checkpoints:
            return None
        free = [cache.reserve_checkpoint(evict=False) for _ in range(sum(may))]
        taken = [s for s in free if s is not None]
        victims = iter(cache.checkpoint_victims(len(free) - len(taken)))
        out: list[Reservation | None] = []
        for m in may:
            if not m:
                out.append(None)
            elif taken:
                out.append(Reservation(taken.pop()))
            else:
                v = next(victims, None)
                if v is None:  # nothing to write into: give the slots back, take the eager path
                    self.cancel(TailPlan(tuple(out)))
                    return None
                out.append(Reservation(v.checkpoint, v))
        return TailPlan(tuple(out))

    def cancel(self, plan: TailPlan) -> None:
        """Give back a plan's free slots (its victims' checkpoints were never touched)."""
        for r in plan.reserved:
            if r is not None and r.victim is None:
                self.cache.checkpoints.free(r.slot)

    def settle_tail(self, plan: TailPlan, starts: Sequence[int], lengths: Sequence[int]
                    ) -> list[PendingCheckpoint | None] | None:
        """After the commit of paths of ``lengths`` nodes: a pending checkpoint per request whose
        path crossed (a victim's checkpoint is dropped, its slot now holds the new state), None for the
        others (their free slots given back); None overall when nothing was reserved."""
        if not plan.reserved:
            return None
        cache, out = self.cache, []
        for start, n, r in zip(starts, lengths, plan.reserved, strict=True):
            cut = cache.path_cut(start, n)
            if r is not None and cut:
                slot = cache.take_checkpoint_slot(r.victim) if r.victim is not None else r.slot
                out.append(PendingCheckpoint(start + cut, slot))
            else:
                if r is not None and r.victim is None:
                    cache.checkpoints.free(r.slot)
                out.append(None)
        return out


def publish_committed(cache: PrefixCache | None, reqs: Sequence,
                      pending: Sequence[PendingCheckpoint | None] | None = None,
                      emitted: Sequence[list[int]] | None = None) -> None:
    """After a forward: publish each request's newly committed full blocks, then attach its pending
    checkpoint and take one where its committed length lands on a boundary. ``emitted``: a
    speculative step's tokens, not yet appended (its accepted drafts are committed). No-op without a
    cache."""
    if cache is None:
        return
    for i, r in enumerate(reqs):
        cache.publish(r, None if emitted is None else r.all_token_ids + emitted[i])
        if pending is not None and pending[i] is not None:
            cache.attach(r, pending[i].end, pending[i].slot)
        cache.checkpoint(r)
