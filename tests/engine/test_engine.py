"""End-to-end engine tests on tiny checkpoints: exactness across modes, state, memory, aborts."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from checkpoints import make_checkpoint, write_token_frequencies
from engine_helpers import default_table, tiny_engine

from bole.config import EngineConfig
from bole.engine.async_engine import AsyncEngine
from bole.engine.engine import LLMEngine
from bole.models.loader import load_model
from bole.sampling_params import SamplingParams

MODES = ("ar", "serial_tree", "bole")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 11, [5, 1], [2, 9, 4, 4, 6, 1, 0, 3]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache = {}

    def get(kind="dense", vocab=16):
        key = (kind, vocab)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"eng_{kind}_{vocab}")
            cache[key] = (str(path), make_checkpoint(path, kind, vocab))
            write_token_frequencies(path, vocab)  # for draft_vocab
        return cache[key]
    return get


engine = tiny_engine



def drop_prefix_cache(eng: LLMEngine) -> None:
    """No request holds a cached block any more; evict them all (pools then return to full)."""
    cache = eng.prefix_cache
    if cache is not None:
        assert cache.stats()["referenced_blocks"] == 0
        cache.clear()
        assert cache.num_cached_blocks == 0
        assert cache.checkpoints.num_free == cache.checkpoint_budget


def run_staggered(eng: LLMEngine, prompts, params_list, arrive_every=2):
    """Add requests over time (one every ``arrive_every`` steps) and step to completion."""
    pending = list(zip(prompts, params_list))
    ids, step = [], 0
    while pending or eng.has_unfinished():
        if pending and step % arrive_every == 0:
            p, sp = pending.pop(0)
            ids.append(eng.add_request(p, sp))
        eng.step()
        step += 1
    return [eng.pop_finished(i).output_token_ids for i in ids]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_identical_across_modes_and_transformers(ckpt, kind):
    path, hf = ckpt(kind)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 14, 7)]
    outs = {m: run_staggered(engine(path, m), PROMPTS, params) for m in MODES}
    assert outs["ar"] == outs["serial_tree"] == outs["bole"]
    for prompt, sp, got in zip(PROMPTS, params, outs["ar"]):
        assert got == hf_greedy(hf, prompt, sp.max_tokens)


@torch.no_grad()
def hf_greedy(hf, prompt, n):
    """Greedy decoding with transformers' uncached forward over the whole sequence at every step.

    transformers 5.17's cached ``generate`` (CPU fallback kernels) diverges from its own uncached
    forward on some prompts (e.g. [2, 9, 4, 4, 6, 1, 0, 3] here: different top-1 at the 2nd step),
    so the model's definition, the full forward, is the reference.
    """
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_speculation_accepts_drafts(ckpt):
    path, _ = ckpt("dense")
    eng = engine(path, "bole")
    run_staggered(eng, PROMPTS, [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 5)
    snap = eng.metrics.snapshot()
    assert snap["mat"] > 1.2, snap  # a 16-token vocabulary makes random drafts hit often
    assert snap["mean_tree_nodes"] > len(PROMPTS)


def test_seeded_stochastic_identical_across_modes(ckpt):
    path, _ = ckpt("dense")
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=10, max_tokens=10, ignore_eos=True, seed=s)
              for s in range(5)]
    outs = {m: run_staggered(engine(path, m), PROMPTS, params) for m in MODES}
    assert outs["ar"] == outs["serial_tree"] == outs["bole"]


def test_draft_vocab_outputs_identical_to_ar(ckpt):
    """A drafter scoring 3 of the 16 ids (draft_vocab) only proposes: greedy and seeded outputs equal ar's."""
    path, _ = ckpt("dense")
    eng = engine(path, "bole", draft_vocab=3)
    assert eng.model.mtp.vocab_ids.tolist() == write_token_frequencies(path, 16)[:3]
    for params in ([SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 14, 7)],
                   [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, ignore_eos=True, seed=s)
                    for s in range(5)]):
        assert run_staggered(eng, PROMPTS, params) == run_staggered(engine(path, "ar"), PROMPTS, params)
    assert engine(path, "bole").model.mtp.vocab_ids is None  # the next engine without the option: all ids


@pytest.mark.parametrize("draft_vocab", [None, 3])
def test_stochastic_distribution_matches_target(ckpt, draft_vocab):
    """Chi-square: the first two tokens under `bole` follow the target model's exact distribution (also
    with a drafter that scores only 3 of the 6 ids: drafts propose, the target decides)."""
    path, hf = ckpt("dense", 6)
    prompt = [1, 2, 3]
    n = 400
    eng = engine(path, "bole", max_num_seqs=16, num_blocks=256, max_num_batched_tokens=64, depth=2,
                 draft_vocab=draft_vocab)
    ids = [eng.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=1000 + i))
           for i in range(n)]
    while eng.has_unfinished():
        eng.step()
    pairs = [tuple(eng.pop_finished(i).output_token_ids) for i in ids]
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1).double()
        p2 = torch.stack([hf(torch.tensor([prompt + [a]])).logits[0, -1].softmax(-1).double() for a in range(6)])
    second = (p1[:, None] * p2).sum(0)  # marginal of the second token
    for probs, observed in ((p1, [a for a, _ in pairs]), (second, [b for _, b in pairs])):
        counts = torch.bincount(torch.tensor(observed), minlength=6).double()
        expected = probs * n
        keep = expected >= 5
        chi2 = float((((counts - expected) ** 2) / expected)[keep].sum())
        dof = int(keep.sum()) - 1
        # p > 1e-3 for chi2 with dof <= 5 means chi2 < ~20.5
        assert chi2 < 20.5 if dof <= 5 else True, (chi2, counts, expected)
        assert math.isfinite(chi2)


def test_state_after_every_commit_equals_autoregressive(ckpt):
    path, _ = ckpt("dense")
    eng = engine(path, "bole")
    # a plain full prefill is the reference: one chunk (the token budget holds every committed prefix)
    ref = engine(path, "ar", enable_prefix_cache=False, max_num_batched_tokens=256)
    rid = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    checked = 0
    while eng.has_unfinished():
        eng.step()
        req = eng.requests[rid]
        if req.is_finished or not req.prefilled:
            continue
        # prefill the committed tokens in a fresh AR engine and compare the GDN pools
        r2 = ref.add_request(req.all_token_ids[: req.num_computed], SamplingParams(max_tokens=2, ignore_eos=True),
                             request_id=f"ref{checked}")
        ref_req = ref.requests[r2]
        ref.step()  # the whole prefill in one forward, then its first token (not computed yet: the state is P's)
        assert ref_req.prefilled and ref_req.num_computed == req.num_computed and not ref_req.is_finished
        for pool_a, pool_b in ((eng.runner.state_pool.ssm, ref.runner.state_pool.ssm),
                               (eng.runner.state_pool.conv, ref.runner.state_pool.conv)):
            a, b = pool_a[:, req.state_slot], pool_b[:, ref_req.state_slot]
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), float((a - b).abs().max())
        assert ref.abort(r2)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("mode", MODES)
def test_preemption_and_pressure_keep_outputs_and_free_everything(ckpt, mode):
    path, _ = ckpt("dense")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 14, 7)]
    roomy = run_staggered(engine(path, mode), PROMPTS, params, arrive_every=1)
    blocks = 12 if mode == "ar" else 24  # a couple of requests' worth of KV: forces preemption
    tight = engine(path, mode, num_blocks=blocks)
    got = run_staggered(tight, PROMPTS, params, arrive_every=1)
    assert got == roomy
    assert tight.metrics.preemptions > 0
    drop_prefix_cache(tight)
    assert tight.runner.allocator.num_free == blocks
    assert tight.runner.state_pool.num_free == tight.runner.state_pool.num_slots


def test_chunked_prefills_holding_every_block_do_not_deadlock(ckpt):
    """Requests in the middle of chunked prefills (prompt logprobs, prefix-cache shares, 16-token budgets)
    can hold all 12 blocks between them with none able to take its next chunk: the scheduler preempts the
    newest, every request finishes (within a step bound instead of never), with a roomy engine's tokens."""
    import random

    path, _ = ckpt("dense")
    rng = random.Random(35)
    base = [rng.randrange(16) for _ in range(40)]
    arrivals, t = [], 0
    for _ in range(7):
        n = rng.choice([1, 3, 5, 9, 11, 13, 17, 21, 30, 37])
        prompt = base[:n] if rng.random() < 0.5 else [rng.randrange(16) for _ in range(n)]
        params = SamplingParams(temperature=0, max_tokens=rng.choice([1, 2, 5, 9]), ignore_eos=True,
                                prompt_logprobs=rng.choice([None, None, 1]))
        arrivals.append((t, prompt, params))
        t += rng.choice([0, 0, 1, 2])

    def run(eng):
        ids, pending, step = [], list(arrivals), 0
        while pending or eng.has_unfinished():
            while pending and pending[0][0] <= step:
                _, prompt, params = pending.pop(0)
                ids.append(eng.add_request(prompt, params))
            eng.step()
            step += 1
            assert step < 500, "no progress"
        return [eng.pop_finished(i).output_token_ids for i in ids]

    tight = engine(path, "ar", num_blocks=12)
    assert run(tight) == run(engine(path, "ar"))
    assert tight.metrics.preemptions > 0


def test_abort_frees_everything_and_others_continue(ckpt):
    path, _ = ckpt("dense")
    eng = engine(path, "bole")
    keep = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    gone = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.abort(gone)
    assert not eng.abort("no-such-request")
    while eng.has_unfinished():
        eng.step()
    assert len(eng.pop_finished(keep).output_token_ids) == 10
    drop_prefix_cache(eng)
    assert eng.runner.allocator.num_free == eng.config.cache.num_blocks
    assert eng.runner.state_pool.num_free == eng.runner.state_pool.num_slots


def test_aborts_after_a_failed_step_leave_the_next_steps_whole(ckpt):
    """A step fails after a request finished on its first token; the serving loop aborts every request
    the step held (``AsyncEngine``): the finished one is released once, and the next steps run (the
    drafter's catch-up of a finishing request's blocks is not run on blocks already freed)."""
    path, _ = ckpt("dense")
    eng = engine(path, "bole")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng.add_request(PROMPTS[0], params, request_id="old")
    eng.step()
    eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1), request_id="one")
    real = eng.spec_step.run

    def failing(*a, **k):
        eng.spec_step.run = real
        raise RuntimeError("injected")

    eng.spec_step.run = failing
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    for rid in eng.stats().running_ids + ("one",):
        eng.abort(rid)
    rid = eng.add_request(PROMPTS[2], params)
    while eng.has_unfinished():
        eng.step()
    assert len(eng.pop_finished(rid).output_token_ids) == 20
    drop_prefix_cache(eng)
    assert eng.runner.allocator.num_free == eng.config.cache.num_blocks


def test_bad_requests_raise_and_lose_nothing(ckpt):
    path, _ = ckpt("dense")
    eng = engine(path, "bole")
    ok = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="out of range") as e:
        eng.add_request([1, 999], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(ValueError, match=r"stop_token_ids out of range \[0, 16\)") as e:
        eng.add_request([1, 2], SamplingParams(stop_token_ids=[3, 10**12]))
    assert e.value.param == "stop_token_ids" and str(10**12) in str(e.value)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="does not fit"):
        eng.add_request([1] * 10, SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1], SamplingParams(), request_id=ok)
    while eng.has_unfinished():
        eng.step()
    assert len(eng.pop_finished(ok).output_token_ids) == 4
    with pytest.raises(ValueError, match="unknown engine options"):
        EngineConfig.from_options(mode="bole", depht=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        EngineConfig.from_options(mode="fast")
    # a model loaded elsewhere than the engine's device: refused before anything runs on either
    with pytest.raises(ValueError, match=r"model is on cpu but the engine's device is 'cuda'"):
        LLMEngine(load_model(path, dtype="float32"), EngineConfig.from_options(
            mode="bole", device="cuda", calibration_table=default_table()))


def test_async_engine_streams_and_aborts(ckpt):
    path, _ = ckpt("dense")
    eng = engine(path, "bole")
    aeng = AsyncEngine(eng)

    async def collect(prompt, n):
        toks = []
        async for out in aeng.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
            toks.extend(out.new_token_ids)
        return toks

    async def partial(prompt):
        agen = aeng.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        first = await agen.__anext__()
        await agen.aclose()  # client went away: the request is aborted
        return first

    async def main():
        return await asyncio.gather(collect(PROMPTS[0], 9), partial(PROMPTS[1]), collect(PROMPTS[2], 6))

    try:
        full, first, other = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert len(full) == 9 and len(other) == 6 and first.new_token_ids
    drop_prefix_cache(eng)
    assert eng.runner.allocator.num_free == eng.config.cache.num_blocks
    assert not eng.requests


@pytest.mark.parametrize("mode", MODES)
def test_first_tokens_emitted_before_the_steps_decode(ckpt, mode):
    """``step(emit_early=...)`` hands a new request's first token over before the step's decode / verify
    forward runs (the running request has not advanced yet), and returns only the rest (with the output of
    a request that ended on its first token): together the same outputs, in every step, as a step without
    it."""
    path, _ = ckpt("dense")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = engine(path, mode), engine(path, mode)
    for eng in (a, b):
        eng.add_request(PROMPTS[0], params, request_id="old")
        eng.step()
        eng.step()
        eng.add_request(PROMPTS[2], params, request_id="new")
        eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1), request_id="one")
    firsts = 0
    while a.has_unfinished() or b.has_unfinished():
        got, old_before = [], len(a.requests["old"].output_token_ids)

        def early(outs, got=got, old_before=old_before):   # the running request has not advanced yet
            assert len(a.requests["old"].output_token_ids) == old_before
            got.extend(outs)

        rest = a.step(emit_early=early)
        firsts += len(got)
        # "one" ends on its first token: handed back at the end of the step, after its release
        assert all(o.request_id == "new" and len(o.output_token_ids) == 1 and not o.finished for o in got)
        assert all(not (o.request_id == "new" and len(o.output_token_ids) == 1) for o in rest)
        key = lambda outs: sorted((o.request_id, list(o.new_token_ids)) for o in outs)
        assert key(got + rest) == key(b.step())
    assert firsts == 1


def test_async_engine_streams_first_tokens_before_the_steps_decode(ckpt):
    """Through ``AsyncEngine``: the step that prefills "new" does not run its decode forward (for "old")
    until the caller has "new"'s first token (the decode waits for it; without early delivery it would
    wait out its 20 s and record a miss)."""
    import threading

    path, _ = ckpt("dense")
    eng = engine(path, "ar")
    first, waited = threading.Event(), []
    decode = eng.runner.decode

    def gated_decode(reqs, keep_hidden):
        new = eng.requests.get("new")
        if new is not None and new.prefilled and not waited:
            waited.append(first.wait(20))
        return decode(reqs, keep_hidden)

    eng.runner.decode = gated_decode
    aeng = AsyncEngine(eng)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        old = aeng.generate(PROMPTS[0], params, request_id="old")
        await old.__anext__()            # "old" is decoding
        outs = []
        async for out in aeng.generate(PROMPTS[2], params, request_id="new"):
            first.set()
            outs.append(out)
        async for _ in old:
            pass
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert waited == [True] and sum(len(o.new_token_ids) for o in outs) == 12
    assert aeng.stats().peak_batch == 2


def test_async_engine_shutdown_applies_the_last_releases_and_refuses_new_requests(ckpt):
    path, _ = ckpt("dense")
    aeng = AsyncEngine(engine(path, "ar"))

    async def collect():
        return [o async for o in aeng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))]

    outs = asyncio.run(collect())
    aeng.shutdown()   # right after the last release was sent: the thread applies it before it exits
    assert outs[-1].finished and aeng.stats().held == 0   # the stats it published as it stopped

    async def after():
        return [o async for o in aeng.generate(PROMPTS[0], SamplingParams(max_tokens=2))]

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(asyncio.wait_for(after(), 10))   # an error, not a wait forever


def test_min_tokens_suppresses_stop_tokens_in_every_mode(ckpt):
    path, _ = ckpt("dense")
    free = run_staggered(engine(path, "ar"), PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True)] * 2)
    stop = free[0][1]  # a token greedy decoding emits early for prompt 0
    plain = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])] * 2
    held = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], min_tokens=6)] * 2
    outs = {m: (run_staggered(engine(path, m), PROMPTS[:2], plain),
                run_staggered(engine(path, m), PROMPTS[:2], held)) for m in MODES}
    assert outs["ar"] == outs["serial_tree"] == outs["bole"]
    short, long = outs["ar"]
    assert short[0] == free[0][:2]                 # stops at the stop token without min_tokens
    assert len(long[0]) >= 6 and all(stop not in o[:6] for o in long)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("one_forward", [True, False])
def test_prompt_tail_past_the_last_checkpoint_runs_in_the_same_step(ckpt, mode, one_forward, monkeypatch):
    """A prompt's chunk ends at a GDN checkpoint boundary (8 of 11 tokens at block_size 4) and its 3-token
    rest (``SchedulerOutput.prefill_tails``) runs in the same step: in the same forward, which writes the
    boundary's state into a checkpoint slot (``LLMEngine._one_forward``), or, where the runner cannot, in a
    second forward after the boundary's checkpoint is taken. Either way the first token comes out of the
    first step, a later request with the same prompt restores 8 tokens, and the outputs are those of an
    engine without a prefix cache."""
    path, _ = ckpt("dense")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = PROMPTS[4] + [7, 5, 8]   # 11 distinct-ish tokens: a checkpoint a token off would differ

    def first_step(one: bool):
        eng = engine(path, mode)
        if not one:
            monkeypatch.setattr(eng.runner, "checkpoints_in_forward", lambda chunks: False)
        forwards = []
        prefill = eng.runner.prefill
        monkeypatch.setattr(eng.runner, "prefill", lambda chunks, *a, **kw: forwards.append(
            ([n for _, n in chunks], kw.get("checkpoints"))) or prefill(chunks, *a, **kw))
        rid = eng.add_request(prompt, params)
        outs = eng.step()
        slot = eng.requests[rid].prefix_nodes[1].checkpoint   # the block ending at token 8
        pool = eng.prefix_cache.checkpoints
        return eng, rid, outs, forwards, (pool.ssm[:, slot].clone(), pool.conv[:, slot].clone())

    eng, rid, outs, forwards, state = first_step(one_forward)
    assert [n for n, _ in forwards] == ([[11]] if one_forward else [[8], [3]])
    assert (forwards[0][1] is not None and forwards[0][1][0][0] == 8) == one_forward
    if one_forward:   # the checkpoint written inside the forward is the one the chunk's forward left
        ssm, conv = first_step(False)[4]
        assert float((state[0] - ssm).abs().max()) <= 1e-5 * float(ssm.abs().max()) and torch.equal(state[1], conv)
    assert [len(o.output_token_ids) for o in outs if o.request_id == rid] == [1]
    assert eng.metrics.prefill_tokens == 11
    while eng.has_unfinished():
        eng.step()
    first = eng.pop_finished(rid).output_token_ids
    again = eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()
    req = eng.pop_finished(again)
    assert req.metrics.prefix_hit_tokens == 8
    plain = engine(path, mode, enable_prefix_cache=False)
    ref = plain.add_request(prompt, params)
    while plain.has_unfinished():
        plain.step()
    assert first == req.output_token_ids == plain.pop_finished(ref).output_token_ids


def test_identical_prompts_in_one_step_take_one_checkpoint_and_evict_nothing_more(ckpt):
    """Three identical prompts past a boundary in one step, the checkpoint pool full of other prompts'
    checkpoints: one slot is reserved for the shared boundary (not three, which would evict two live
    checkpoints only for ``attach`` to give their slots back), as the chunk-and-tail path takes one."""
    path, _ = ckpt("dense")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng = engine(path, "ar", num_checkpoint_slots=3, max_num_batched_tokens=64)
    cache = eng.prefix_cache
    for p in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1], [4, 4, 2, 2, 1, 1, 3, 3, 5]):
        eng.add_request(p, params)
    while eng.has_unfinished():
        eng.step()
    assert cache.num_checkpoints == 3 and cache.evicted_checkpoints == 0
    prompt = PROMPTS[4] + [7, 5, 8]
    for _ in range(3):
        eng.add_request(prompt, params)
    eng.step()
    assert cache.num_checkpoints == 3 and cache.evicted_checkpoints == 1
    assert cache.checkpointed(prompt[:8]) is not None
    while eng.has_unfinished():
        eng.step()


def test_a_boundary_found_checkpointed_keeps_its_checkpoint_when_another_reserves(ckpt, monkeypatch):
    """Two prompts past a boundary in one step, the checkpoint pool full: A's boundary block holds a
    checkpoint A did not restore from (as a speculative match stops at a block the drafter has not
    covered), so A writes none; C's reservation must then evict another checkpoint, not A's (the least
    recently used), which would leave A's boundary without one."""
    path, _ = ckpt("dense")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng = engine(path, "ar", num_checkpoint_slots=2, max_num_batched_tokens=64)
    cache = eng.prefix_cache
    x, y = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]
    for p in (x, y):   # X's checkpoint at 8 is the least recently used
        eng.add_request(p, params)
        while eng.has_unfinished():
            eng.step()
    assert cache.num_checkpoints == 2 and cache.evicted_checkpoints == 0
    a, c = x[:8] + [7, 5, 8], PROMPTS[4] + [7, 5, 8]
    match = cache.match
    monkeypatch.setattr(cache, "match", lambda t: [] if list(t) == a else match(t))
    ra, rc = eng.add_request(a, params), eng.add_request(c, params)
    outs = eng.step()
    assert {o.request_id for o in outs} == {ra, rc} and eng.metrics.prefill_tokens >= 22
    assert cache.checkpointed(x[:8]) is not None and cache.checkpointed(c[:8]) is not None
    assert cache.checkpointed(y[:8]) is None and cache.evicted_checkpoints == 1
    while eng.has_unfinished():
        eng.step()


def test_prompt_tail_waits_when_its_blocks_are_short(ckpt):
    """Without blocks for the tail, the chunk up to the checkpoint boundary still runs and the tail runs in
    a later step (not neither)."""
    path, _ = ckpt("dense")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng = engine(path, "ar")
    rid = eng.add_request(PROMPTS[2], params)   # 11 tokens: a chunk of 8 (2 blocks of 4) and a tail of 3
    alloc = eng.runner.allocator
    held = alloc.allocate(alloc.num_free - 2)
    sched = eng.scheduler.schedule(eng.lookahead)
    assert [(r.request_id, n) for r, n in sched.prefill] == [(rid, 8)] and sched.prefill_tails == []
    eng.runner.prefill(sched.prefill, keep_hidden=False)   # what the step would run, by hand
    alloc.free(held)
    while eng.has_unfinished():
        eng.step()
    plain = engine(path, "ar", enable_prefix_cache=False)
    ref = plain.add_request(PROMPTS[2], params)
    while plain.has_unfinished():
        plain.step()
    assert eng.pop_finished(rid).output_token_ids == plain.pop_finished(ref).output_token_ids


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_warm_up_changes_no_output_and_gives_its_memory_back(ckpt, mode):
    """The start's warm-up (``LLMEngine.warm_up``: on CUDA, eager prefills of 128 and 65 + 66 tokens over a
    scratch block and slot) leaves every pool as full as before and the greedy outputs as a fresh engine's,
    even where its garbage lands in the block and slot the next requests take."""
    path, _ = ckpt("dense")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 14, 7)]
    ref = run_staggered(engine(path, mode, max_num_batched_tokens=256), PROMPTS, params)
    eng = engine(path, mode, max_num_batched_tokens=256)
    free = (eng.runner.allocator.num_free, eng.runner.state_pool.num_free)
    assert eng.warm_up() > 0
    eng.runner.warm_up([[9], [5, 6, 1]])
    assert (eng.runner.allocator.num_free, eng.runner.state_pool.num_free) == free
    assert run_staggered(eng, PROMPTS, params) == ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_warm_up_compiles_the_long_prefill_at_start_cuda(ckpt, dtype):
    """On CUDA the engine warms up at start: the first prefills of more than 64 tokens (fla's chunked
    kernels in bfloat16 when importable, the recurrence in float32; the conv) then compile no Triton kernel,
    counted in the JIT caches of every loaded ``kernels`` / ``fla`` module; in float32 the outputs are the
    CPU's."""
    import sys

    def jit_functions():
        for name, mod in list(sys.modules.items()):
            if name.split(".")[0] in ("kernels", "fla") and mod is not None:
                for obj in list(vars(mod).values()):
                    while hasattr(obj, "fn") and not hasattr(obj, "device_caches"):
                        obj = obj.fn    # autotuners / heuristics wrap the JIT function
                    if hasattr(obj, "device_caches"):
                        yield obj

    def compiled() -> int:
        return sum(len(c[0]) for f in set(jit_functions()) for c in f.device_caches.values())

    path, _ = ckpt("dense")
    # whole blocks (block_size 4): no tail past a checkpoint boundary, so the step runs the long path only
    prompts = [[(7 * i + 3) % 16 for i in range(n)] for n in (148, 96)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2
    if dtype == "bfloat16":
        pytest.importorskip("fla", reason="flash-linear-attention (the gpu extra) is not installed")
    cfg = EngineConfig.from_options(mode="bole", calibration_table=default_table(), num_blocks=96, block_size=4,
                                    depth=3, topk=3, beam=3, max_num_seqs=4, max_num_batched_tokens=256,
                                    device="cuda", dtype=dtype)
    eng = LLMEngine(load_model(path, dtype=dtype, device="cuda"), cfg)
    before = compiled()   # what the warm-up compiled (it imported fla's kernels where fla is installed)
    assert before > 0
    for p in prompts:     # one packed prefill of 244 tokens; one token each, so no decode step runs
        eng.add_request(p, SamplingParams(max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    assert compiled() == before
    if dtype == "float32":
        ref = run_staggered(engine(path, "bole", max_num_batched_tokens=256, device="cpu"), prompts, params)
        assert run_staggered(eng, prompts, params) == ref


@pytest.mark.parametrize("mode", ["serial_tree", "bole"])
def test_triton_backend_matches_torch_backend(ckpt, mode):
    """The engine on the Triton kernels (interpreted on CPU) emits what it emits on the torch twins."""
    path, _ = ckpt("dense")
    cfg = EngineConfig.from_options(mode=mode, calibration_table=default_table(), num_blocks=64, block_size=4,
                                    depth=2, topk=2, beam=2, max_num_seqs=2)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2
    outs = [run_staggered(LLMEngine(load_model(path, dtype="float32", backend=b), cfg), PROMPTS[:2], params)
            for b in ("torch", "triton")]
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_engine_on_cuda_matches_cpu(ckpt):
    """On a GPU (Triton kernels through the "auto" backend): every mode emits the CPU's greedy tokens."""
    path, _ = ckpt("dense")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 14, 7)]
    ref = run_staggered(engine(path, "ar", device="cpu"), PROMPTS, params)
    for mode in MODES:
        cfg = EngineConfig.from_options(mode=mode, calibration_table=default_table(), num_blocks=96, block_size=4,
                                        depth=3, topk=3, beam=3, max_num_seqs=4, max_num_batched_tokens=16,
                                        device="cuda")
        eng = LLMEngine(load_model(path, dtype="float32", device="cuda"), cfg)
        assert run_staggered(eng, PROMPTS, params) == ref, mode
