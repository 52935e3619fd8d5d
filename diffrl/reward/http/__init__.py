"""Reward over HTTP: ``HttpScorer`` (client.py) asks a server started by
``diffrl serve-reward`` (server.py) that wraps any registered scorer.

Only the client is imported here: a training host needs httpx but not the server stack
(FastAPI, uvicorn), so ``server`` is imported explicitly by those who run one.
"""

from diffrl.reward.http.client import (
    HttpScorer,
    RewardHttpError,
    RewardReplyMalformed,
    RewardRequestRejected,
    RewardServerUnavailable,
)

__all__ = [
    "HttpScorer",
    "RewardHttpError",
    "RewardReplyMalformed",
    "RewardRequestRejected",
    "RewardServerUnavailable",
]
