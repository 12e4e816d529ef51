"""A policy engine for tests that counts the decisions it makes and asks Cedar for them.

Our own boundary, not a mock: the real Cedar engine decides; the counter lets a test say
"exactly one decision" (idempotent replays must not decide again).
"""

from __future__ import annotations

from bettercompute.core import ports
from bettercompute.iam import policies


class CountingPolicy:
    def __init__(self, text: str = policies.DEFAULT_POLICIES) -> None:
        self.inner = policies.CedarPolicyEngine.from_text(text)
        self.creates = 0

    async def decide(self, request: ports.DecisionRequest) -> ports.Decision:
        if request.action == ports.CREATE:
            self.creates += 1
        return await self.inner.decide(request)
