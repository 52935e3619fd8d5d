"""The rollout engine of an autoregressive family (``models/family.py`` ``ARFamily``): G
completions per prompt, batched, sampled with the KV cache, each token's log-prob recorded as
it is drawn.

It is the diffusion ``RolloutEngine``'s sibling behind the same ``RolloutEngineProtocol``
(``engines.py``), so the controller, the reward pool, the channel, the async loop and the Ray
backend run it unchanged: it streams ``Trajectory`` records (one per micro-batch of whole
groups), holds its own copy of the model, and changes weights only through ``load_weights``
(the actor's LoRA merged in, verified: contract 2, by the same ``MergedLoraTarget``).

What a completion looks like as a ``Trajectory``:

    x0          (B, T) int64   sampled ids; NO_TOKEN (-1) after the first end-of-turn
    log_probs   (B, T) float32 log pi(token | prefix) at generation (0 after the end)
    sde_mask    (T,) bool      True: each step drew a token (False: greedy, held-out eval)
    step_spec   kind "token", noise_level = the sampling temperature (1: the policy itself)
    extra_fields["text"]  (B, N) uint8 the decoded answers; ["image"] (B, H, W, 3) uint8 the
                prompt's image when it has one (what the verifier reads)

``rollout.num_steps`` is the most tokens a completion may hold (one token per sampler step);
``rollout.sampler`` is ``sde`` (draw each token) or ``ode`` (greedy, the deterministic
sampler: held-out eval). Temperature is 1: the recorded log-probs are the policy's own.
"""

from __future__ import annotations

import asyncio
import copy

import torch
from torch import Tensor

from diffrl.channel import Channel
from diffrl.errors import ConfigError
from diffrl.models.family import ARModel
from diffrl.rollout.engine import RolloutConfig, sample_seeds
from diffrl.sync.bound import bound_of, linear_weights
from diffrl.sync.receipt import SyncReceipt, receipt_of
from diffrl.sync.weights import (
    BasePrints,
    MergedLoraTarget,
    SlotMap,
    SyncError,
    SyncReport,
    WeightUpdate,
)
from diffrl.types import PromptBatch, StepSpec, Trajectory, check_token_hashes

TEMPERATURE = 1.0
TOKEN_STEP = "token"  # StepSpec.kind of a trajectory of sampled tokens


class ARRolloutEngine:
    """Samples completions with a copy of an ``ARModel`` (the loaded model stays the actor's)."""

    def __init__(
        self,
        model: ARModel,
        cfg: RolloutConfig,
        lora_targets: list[str],
        device: torch.device,
        **layout,
    ) -> None:
        """``layout``: the diffusion engine's sharing and sharding options
        (``rollout.share_base``, a TP-sharded copy), which this engine does not take yet."""
        if cfg.share_base or layout.get("tp_mesh") is not None or layout.get("lora_rank"):
            raise ConfigError(
                "an autoregressive family's rollout holds its own whole copy of the model: "
                "set rollout.share_base=false (and parallel.rollout=replicated under tp)"
            )
        if cfg.compile or cfg.cuda_graphs or cfg.cfg_scale != 1:
            raise ConfigError(
                "rollout.compile, rollout.cuda_graphs and rollout.cfg_scale are diffusion "
                "sampler settings; an autoregressive family's rollout takes none of them "
                "(set them to false, false and 1)"
            )
        self.cfg, self.device, self.version = cfg, device, 0
        self.model = copy.deepcopy(model).to(device)  # type: ignore[attr-defined]
        self.model.eval().requires_grad_(False)
        self.family = model.family
        self.shared = self.collective = False  # (controller/sync.py, controller/midsync.py)
        base_prints = BasePrints.of_model(self.model, lora_targets)
        self.bound = bound_of(linear_weights(self.model, lora_targets))
        self.target = MergedLoraTarget(
            self.model, lora_targets, SlotMap(), cfg.base_copy, base_prints
        )

    @property
    def produces(self) -> frozenset[str]:
        return frozenset(self.family.media)

    def load_weights(self, update: WeightUpdate) -> SyncReport:
        if update.version < self.version:
            raise SyncError(f"stale weight update v{update.version} < current v{self.version}")
        report = self.target.apply(update)
        self.version = update.version
        return report

    def receipt(self) -> SyncReceipt:
        return receipt_of(self.target, self.version)

    def offer(self, update: WeightUpdate) -> None:
        raise SyncError(
            "run.async_sync=step swaps weights between two sampler steps of a diffusion "
            "rollout; an autoregressive family's rollout takes them between micro-batches: "
            "use run.async_sync=batch"
        )

    def take_synced(self) -> dict[str, float]:
        return {}

    async def stream(
        self,
        prompts: PromptBatch,
        seed: int,
        channel: Channel,
        *,
        group_size: int | None = None,
        sampler: str | None = None,
        num_steps: int | None = None,
        iteration: int = 0,
        first_prompt: int = 0,
    ) -> None:
        """One ``Trajectory`` per micro-batch of whole groups into ``channel`` as each is
        sampled (so scoring overlaps sampling), then closes it. Waits on the worker thread and
        on the channel's back-pressure only. ``first_prompt``: where these prompts start in a
        larger batch (a data-parallel rank's slice): their samples take that batch's seeds."""
        g = group_size or self.cfg.group_size
        per = max(1, self.cfg.max_batch // g)  # prompts per micro-batch
        offset = first_prompt * g
        seeds = sample_seeds(seed, offset + len(prompts) * g)[offset:]
        greedy = (sampler or self.cfg.sampler) == "ode"
        steps = num_steps or self.cfg.num_steps
        try:
            for k in range(0, len(prompts), per):
                sub = prompts.select(torch.arange(k, min(k + per, len(prompts))))
                traj = await asyncio.to_thread(
                    self._generate, sub, seeds[k * g : (k + len(sub)) * g], g,
                    first_prompt + k, steps, greedy,
                )  # fmt: skip
                await channel.put(traj, traj.policy_version)
        finally:
            channel.close()

    async def generate(self, prompts: PromptBatch, seed: int, **kw) -> Trajectory:
        """The whole batch as one trajectory (micro-batches joined)."""
        channel = Channel()
        producer = asyncio.create_task(self.stream(prompts, seed, channel, **kw))
        parts = [t async for t in channel]
        await producer
        return Trajectory.concat(parts)

    @torch.no_grad()
    def _generate(
        self, prompts: PromptBatch, seeds: Tensor, g: int, group_offset: int, steps: int,
        greedy: bool,
    ) -> Trajectory:  # fmt: skip
        """One micro-batch: its G completions per prompt, in one batched ``generate``. The
        draws come from the micro-batch's first sample's seed (a batched sampler draws every
        row's token from one generator)."""
        batch = prompts.repeat(g)
        check_token_hashes(batch, "the rollout engine")  # contract 3, on this rank
        ids = batch.input_ids.to(self.device)
        cond = None if batch.cond is None else batch.cond.to(self.device)
        version = self.version
        tokens, log_probs = self.model.sample(ids, cond, steps, greedy, int(seeds[0]))
        tokens = tokens.cpu()
        media = dict(self.family.decode(tokens))
        if batch.cond is not None:  # what the model saw (its image), for a verifier to read
            media |= self.family.condition_media(batch.cond)
        return Trajectory(
            prompts=batch,
            group=torch.arange(len(prompts)).repeat_interleave(g) + group_offset,
            seeds=seeds,
            x0=tokens,
            policy_version=version,
            log_probs=log_probs.float().cpu(),
            sde_mask=torch.full((steps,), not greedy),
            step_spec=StepSpec(TOKEN_STEP, TEMPERATURE, 1.0, ()),
            step_versions=torch.full((len(batch), steps), version, dtype=torch.int64),
            extra_fields=media,
        )
