"""The engine Protocols the controller is written against (DESIGN §1).

The in-process engines (``diffrl.rollout.engine.RolloutEngine``, ``diffrl.reward.pool.RewardPool``,
``diffrl.actor.engine.ActorEngine``) implement them; so can fakes in tests and remote engines.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from diffrl.channel import Channel
from diffrl.sync.receipt import SyncReceipt
from diffrl.sync.weights import SyncReport, WeightUpdate
from diffrl.types import PromptBatch, ScoredBatch, TrainBatch, Trajectory


@runtime_checkable
class RolloutEngineProtocol(Protocol):
    version: int  # the policy version of the weights it samples with

    @property
    def produces(self) -> frozenset[str]: ...  # the extra_fields its trajectories carry

    async def stream(
        self,
        prompts: PromptBatch,
        seed: int,
        channel: Channel,
        *,
        iteration: int = 0,
        first_prompt: int = 0,
    ) -> None:
        """Puts one Trajectory per finished micro-batch into ``channel``, then closes it.
        ``first_prompt``: where ``prompts`` start in a larger batch that others sample the
        rest of (a data-parallel rank's slice): their samples take that batch's seeds."""

    async def generate(self, prompts: PromptBatch, seed: int, **kw) -> Trajectory: ...

    def load_weights(self, update: WeightUpdate) -> SyncReport: ...  # verifies or raises

    def receipt(self) -> SyncReceipt: ...  # what it holds now (the sender checks each sync)


@runtime_checkable
class RewardEngineProtocol(Protocol):
    async def score(self, traj: Trajectory) -> tuple[ScoredBatch, dict[str, float]]: ...

    def check_inputs(self, produced: set[str]) -> None: ...

    def observe_step(self, scored: ScoredBatch) -> None:
        """After each step's scoring; raises when a scorer has been dead too long."""


@runtime_checkable
class ActorEngineProtocol(Protocol):
    """One update path: an optimizer step whose rows arrive in parts (``begin_stream``, a
    ``train_part`` per scored micro-batch, ``end_stream``; ``run.stream_train`` feeds it while
    the rollout runs); ``train_step`` is a whole batch's update through the same path."""

    version: int  # optimizer steps taken

    @property
    def eval_adapter(self) -> str: ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...

    def begin_stream(self, expected_rows: int) -> None: ...

    def train_part(self, part: TrainBatch) -> None: ...

    def end_stream(self) -> dict[str, float]: ...

    def update_old(self, decay: float) -> None: ...

    def export_weights(self, adapter: str = "default") -> WeightUpdate: ...

    def adapter_tensors(self) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state(self, adapters: dict, state: dict) -> None: ...
