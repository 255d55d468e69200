"""Retrying a request that a replica refused before producing anything (draining, or gone), and
sending one that a hardware group refused as full to the next group.

Nothing was generated, so sending it again loses and repeats nothing. The ingress
(``deployments.serve_client.ServeEngineClient``) waits between attempts with jittered exponential
backoff and gives up after ``max_attempts`` or ``budget_s``, whichever comes first, with a clean 503
and ``Retry-After``. The refusing replica is also marked in the fleet view
(``routing_policy.FleetView.mark_refused``) so the routers skip it until its own stats catch up: the
retry goes to another replica instead of the same one again.

A group that has no room (``group_refused``: Serve's queue for it full, a replica's admission limit
reached, the deployment unavailable) is no reason to wait: the ingress tries the next group at once,
in the order its group choice ranks them, and answers 429 only when every group refused.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from deployments.checks import require_at_least

# Ray's errors for a replica that died or cannot be reached: retried like a refusal when nothing
# was streamed yet (matched by name: ray.exceptions is not imported where Ray is absent).
REPLICA_GONE_ERRORS = frozenset({"ActorDiedError", "ActorUnavailableError", "RayActorError"})
# Serve's errors for a deployment that takes no call now: its queue in this caller is full
# (``max_queued_requests``), or it failed to deploy (matched by name, as above)
GROUP_REFUSED_ERRORS = frozenset({"BackPressureError", "DeploymentUnavailableError"})


@dataclass(frozen=True)
class RetryPolicy:
    """base_s: the first step; each later step doubles, up to max_delay_s. Every wait is drawn in
    [step / 2, step] ("equal jitter": clients refused together spread out, and no wait is ever
    near zero), except the last, which is cut to what is left of budget_s: the total wait is
    budget_s unless max_attempts runs out first. max_attempts bounds the rounds: a group that refuses
    as full (``group_refused``) passes the call on to the next group at once, no wait, in the same round."""

    base_s: float = 0.1
    max_delay_s: float = 2.0
    budget_s: float = 30.0
    max_attempts: int = 12

    def __post_init__(self):
        if not 0 < self.base_s <= self.max_delay_s:
            raise ValueError(f"need 0 < base_s <= max_delay_s, got {self.base_s}, {self.max_delay_s}")
        require_at_least(self, 0, "budget_s")
        require_at_least(self, 1, "max_attempts")

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The waits before attempts 2, 3, ..., within the budget (max_attempts - 1 at most)."""
        rng = rng or random.Random()
        spent = 0.0
        for k in range(self.max_attempts - 1):
            step = min(self.max_delay_s, self.base_s * 2 ** k)
            wait = min(step / 2 + rng.uniform(0, step / 2), self.budget_s - spent)
            if wait <= 0:
                return
            spent += wait
            yield wait   # the last one is cut to what is left: the budget is spent, not undershot


def retryable(e: BaseException) -> bool:
    """Whether an error before any output means "try another replica"."""
    from deployments.engine_client import EngineUnavailable

    return isinstance(e, EngineUnavailable) or type(e).__name__ in REPLICA_GONE_ERRORS


def group_refused(e: BaseException) -> bool:
    """Whether an error before any output means "this group cannot take the request now; another
    group may": Serve refused the call (``GROUP_REFUSED_ERRORS``) or the replica's admission limit did
    (``EngineOverloaded``)."""
    from deployments.engine_client import EngineOverloaded

    return isinstance(e, EngineOverloaded) or type(e).__name__ in GROUP_REFUSED_ERRORS
