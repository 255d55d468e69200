"""Engine metrics: per step (tree size, budget, accepted tokens, time in verification) and per request
(TTFT, TPOT, MAT), aggregated in one small object the server reads (``snapshot()``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    start: float
    end: float = 0.0
    prefill_tokens: int = 0
    decode_requests: int = 0
    emitted_tokens: int = 0        # tokens emitted by decode / verify steps
    tree_nodes: int = 0            # tokens run through the target in the decode / verify forward
    b_ver: int = 0                 # the step's capacity: the bucket's B_ver, or the one the goodput rule chose
    # seconds in draft + verify + sample + commit (or decode), with the prefills of requests admitted
    # between the draft and the verify (they wait for the draft's GPU work, which is not synchronised)
    verify_time: float = 0.0
    # seconds from the start of each prefill phase that sampled first tokens (the step's start, or a
    # mid-step admission) to those tokens, summed, sampled on the host (so the prefill's GPU work is in
    # it, and for an admission between draft and verify the draft's GPU work still queued); the step
    # sampled ``first_tokens`` of them, for ``admitted_mid_step`` requests admitted inside the step
    prefill_time: float = 0.0
    first_tokens: int = 0
    admitted_mid_step: int = 0
    admitted_beside: int = 0       # of those, prefilled beside the step's forwards (admit_during_forward)
    eager_prefill: bool = False    # a prefill forward of the step ran eagerly (no captured graph fits it)
    preempted: int = 0
    # which parts of the decode step ran eagerly, not from a captured CUDA graph (always, without graphs)
    eager_forward: bool = False    # the decode (ar) or verify forward
    eager_draft: bool = False      # the MTP draft (speculative modes)
    eager_tail: bool = False       # acceptance and commit (speculative modes)


@dataclass
class EngineMetrics:
    steps: int = 0
    decode_steps: int = 0
    request_steps: int = 0         # sum over decode steps of requests advanced
    emitted_tokens: int = 0
    tree_nodes: int = 0
    b_ver_sum: int = 0
    budgeted_nodes: int = 0        # draft nodes verified within B_ver, over speculative steps
    floor_excess_nodes: int = 0    # draft nodes verified beyond B_ver (the depth-1 floor, see below)
    spec_steps: int = 0
    step_time: float = 0.0
    verify_time: float = 0.0
    prefill_tokens: int = 0
    prefill_steps: int = 0         # steps that prefilled
    eager_prefills: int = 0        # of those, steps with an eager prefill forward
    first_token_steps: int = 0     # steps that sampled first tokens
    prefill_time: float = 0.0      # StepStats.prefill_time over them
    mid_step_admissions: int = 0   # requests admitted inside a step under way (EngineConfig.admit_mid_step)
    beside_admissions: int = 0     # of those, prefilled beside the step's forwards (admit_during_forward)
    preemptions: int = 0
    eager_forwards: int = 0        # decode steps whose forward ran eagerly (StepStats.eager_*)
    eager_drafts: int = 0
    eager_tails: int = 0
    finished: int = 0
    ttft_sum: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: int = 0
    prompt_tokens: int = 0         # over finished requests
    prefix_hit_tokens: int = 0     # prompt tokens served from a prefix cache, over finished requests
    last_step: StepStats | None = None
    accept_histogram: dict = field(default_factory=dict)

    def record_step(self, s: StepStats) -> None:
        self.steps += 1
        self.step_time += s.end - s.start
        self.prefill_tokens += s.prefill_tokens
        if s.prefill_tokens:
            self.prefill_steps += 1
            self.eager_prefills += s.eager_prefill
        if s.first_tokens:
            self.first_token_steps += 1
            self.prefill_time += s.prefill_time
        self.mid_step_admissions += s.admitted_mid_step
        self.beside_admissions += s.admitted_beside
        self.preemptions += s.preempted
        if s.decode_requests:
            self.decode_steps += 1
            self.request_steps += s.decode_requests
            self.emitted_tokens += s.emitted_tokens
            self.tree_nodes += s.tree_nodes
            self.b_ver_sum += s.b_ver
            self.verify_time += s.verify_time
            self.eager_forwards += s.eager_forward
            self.eager_drafts += s.eager_draft
            self.eager_tails += s.eager_tail
            if s.b_ver:
                # ``select_nodes`` keeps every request's depth-1 children (the fairness floor), so a
                # step verifies max(#floor, min(B_ver, #drafts)) nodes: more than B_ver once
                # batch x topk exceeds it. Counting those against the budget read 1.26; they are
                # counted apart.
                drafts = s.tree_nodes - s.decode_requests
                self.spec_steps += 1
                self.budgeted_nodes += min(drafts, s.b_ver)
                self.floor_excess_nodes += max(drafts - s.b_ver, 0)
        self.last_step = s

    def record_finish(self, req) -> None:
        m = req.metrics
        self.finished += 1
        self.prompt_tokens += req.num_prompt_tokens
        self.prefix_hit_tokens += m.prefix_hit_tokens
        if m.ttft is not None:
            self.ttft_sum += m.ttft
        n = req.num_output_tokens
        if n > 1 and m.finish_time is not None and m.first_token_time is not None:
            self.tpot_sum += (m.finish_time - m.first_token_time) / (n - 1)
            self.tpot_count += 1
        if m.num_steps:
            k = round(m.num_accepted_drafts / m.num_steps, 1)
            self.accept_histogram[k] = self.accept_histogram.get(k, 0) + 1

    @property
    def mat(self) -> float:
        """Mean accepted tokens per request-step (accepted drafts + the correction / bonus token)."""
        return self.emitted_tokens / self.request_steps if self.request_steps else 0.0

    def snapshot(self) -> dict:
        return {
            "steps": self.steps,
            "mat": self.mat,
            "mean_tree_nodes": self.tree_nodes / self.decode_steps if self.decode_steps else 0.0,
            "mean_b_ver": self.b_ver_sum / self.decode_steps if self.decode_steps else 0.0,
            # draft nodes verified within B_ver / B_ver, over speculative steps (<= 1; roots are not
            # budgeted), and the mean draft nodes per step the depth-1 floor verified beyond B_ver
            "budget_used": self.budgeted_nodes / self.b_ver_sum if self.b_ver_sum else 0.0,
            "floor_excess_nodes": self.floor_excess_nodes / self.spec_steps if self.spec_steps else 0.0,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "verify_time_share": self.verify_time / self.step_time if self.step_time else 0.0,
            "mean_ttft_s": self.ttft_sum / self.finished if self.finished else 0.0,
            "mean_tpot_s": self.tpot_sum / self.tpot_count if self.tpot_count else 0.0,
            "emitted_tokens": self.emitted_tokens,
            "prefill_tokens": self.prefill_tokens,
            "preemptions": self.preemptions,
            "finished": self.finished,
            # totals, so a reader takes differences over an interval: seconds inside steps, and the decode
            # steps whose forward / draft / acceptance ran eagerly (a graph missing for that step's shape)
            "step_time_s": self.step_time,
            "decode_time_s": self.verify_time,
            "decode_steps": self.decode_steps,
            "eager_forwards": self.eager_forwards,
            "eager_drafts": self.eager_drafts,
            "eager_tails": self.eager_tails,
            # the steps that prefilled and those of them with an eager prefill forward (no captured graph
            # fits it, or graphs are off); the steps that sampled first tokens and their seconds to them;
            # the requests admitted inside a step under way
            "prefill_steps": self.prefill_steps,
            "eager_prefills": self.eager_prefills,
            "first_token_steps": self.first_token_steps,
            "prefill_time_s": self.prefill_time,
            "mid_step_admissions": self.mid_step_admissions,
            "beside_admissions": self.beside_admissions,
        }
