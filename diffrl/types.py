"""Typed records on each edge of the data flow (DESIGN.md §1):

    PromptBatch ─▶ Trajectory ─▶ ScoredBatch ─▶ TrainBatch
     (data)        (rollout)      (reward)       (algorithm.prepare)

Shapes are in the comments: B samples, L text tokens, T sampler steps, (C, H, W) an image.
Media that a scorer may need (decoded images, video frames, audio) ride in ``extra_fields``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from diffrl.errors import ContractError

ROW = {"rows": True}
# the two modalities of a video+audio family's latent, in the order of its flat x (video
# elements first); a reward may also be "joint" (of both, shared by both under modality credit)
MODALITIES = ("video", "audio")  # field metadata: the field has one entry per row of its record


def rows(default=None):
    """A per-row field (a (B, ...) tensor, a (B,) tuple, or a nested record of B rows)."""
    return field(default=default, metadata=ROW)


def select_rows(record, index: Tensor):
    """The one row-selection helper: rows ``index`` of any record in this module (per-row
    fields picked, shared fields such as ``sigmas`` kept, ``extra_fields`` picked per key).
    Every ``prepare``, the actor's minibatching and ``concat`` go through it or its inverse."""
    idx = index.tolist()
    changes: dict[str, object] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if not f.metadata.get("rows") or value is None:
            continue
        if isinstance(value, dict):  # name -> (B, ...) tensor
            changes[f.name] = {k: v[index] for k, v in value.items()}
        elif isinstance(value, tuple):
            changes[f.name] = tuple(value[i] for i in idx)
        elif isinstance(value, Tensor):
            changes[f.name] = value[index.to(value.device)]
        else:
            changes[f.name] = select_rows(value, index)
    return replace(record, **changes)


def concat_rows(records: list):
    """Inverse of ``select_rows``: records joined row-wise; their shared fields must agree."""
    first = records[0]
    if len(records) == 1:
        return first
    changes: dict[str, object] = {}
    for f in dataclasses.fields(first):
        values = [getattr(r, f.name) for r in records]
        if not f.metadata.get("rows") or values[0] is None:
            continue
        if isinstance(values[0], dict):
            changes[f.name] = {k: torch.cat([v[k] for v in values]) for k in values[0]}
        elif isinstance(values[0], tuple):
            changes[f.name] = sum(values, ())
        elif isinstance(values[0], Tensor):
            changes[f.name] = torch.cat(values)
        else:
            changes[f.name] = concat_rows(values)
    return replace(first, **changes)


def host_to_device(t: Tensor, device: torch.device | str, dtype: torch.dtype | None = None):
    """``t`` on ``device`` (in ``dtype``, cast on the host), without the host waiting for the
    GPU: a copy from pageable host memory synchronises the stream, so to a GPU it goes through
    pinned memory, asynchronously (the pinned buffer is kept until the copy is done)."""
    device = torch.device(device)
    t = t if dtype is None else t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(record, device):
    """``record`` (any record in this module, or a tensor, dict or tuple of them) with every
    tensor on ``device``: a trajectory sampled on a GPU crosses a process boundary on the host."""
    if isinstance(record, Tensor):
        return record.to(device)
    if isinstance(record, dict):
        return {k: to_device(v, device) for k, v in record.items()}
    if isinstance(record, tuple):
        return tuple(to_device(v, device) for v in record)
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        changes = {
            f.name: to_device(getattr(record, f.name), device) for f in dataclasses.fields(record)
        }
        return replace(record, **changes)
    return record


@dataclass(frozen=True)
class PromptBatch:
    """Prompts tokenized once, in the data stage; the same ``input_ids`` travel everywhere."""

    texts: tuple[str, ...] = rows()  # (B,)
    input_ids: Tensor = rows()  # (B, L) int64, right-padded
    ids_hash: tuple[str, ...] = rows()  # (B,) stable per-row hash of input_ids (token drift)
    prompt_ids: Tensor = rows()  # (B,) int64 index of each prompt in its prompt set
    # (B, ...) float conditions beyond the text, encoded once in the data stage with the
    # tokens (FL2VA: first/last keyframe latents, (B, 2, C, 1, h, w)); None = text only
    cond: Tensor | None = rows()
    cond_hash: tuple[str, ...] | None = rows()  # (B,) hash_cond_rows(cond), made with it

    def __post_init__(self) -> None:
        n = len(self.texts)
        if self.input_ids.ndim != 2 or self.input_ids.shape[0] != n:
            raise ValueError(f"input_ids must be (B={n}, L), got {tuple(self.input_ids.shape)}")
        if len(self.ids_hash) != n or self.prompt_ids.shape != (n,):
            raise ValueError("ids_hash and prompt_ids must have one entry per prompt")
        if self.cond is not None and self.cond.shape[0] != n:
            raise ValueError(f"cond must have one row per prompt ({n}), got {self.cond.shape[0]}")
        if (self.cond is None) != (self.cond_hash is None) or len(self.cond_hash or ()) != (
            0 if self.cond is None else n
        ):
            raise ValueError("cond_hash must hold one hash per row of cond, and exist only with it")

    def __len__(self) -> int:
        return len(self.texts)

    def repeat(self, g: int) -> PromptBatch:
        """Each prompt ``g`` times in a row: [p0]*g + [p1]*g + ... (a group per prompt)."""
        return PromptBatch(
            texts=tuple(t for t in self.texts for _ in range(g)),
            input_ids=self.input_ids.repeat_interleave(g, dim=0),
            ids_hash=_repeat(self.ids_hash, g),
            prompt_ids=self.prompt_ids.repeat_interleave(g),
            cond=None if self.cond is None else self.cond.repeat_interleave(g, dim=0),
            cond_hash=None if self.cond_hash is None else _repeat(self.cond_hash, g),
        )

    def select(self, index: Tensor) -> PromptBatch:
        return select_rows(self, index)


@dataclass(frozen=True)
class StepSpec:
    """How a trajectory's stochastic steps were taken; training recomputes log-probs with
    exactly these settings (carried with the data, so they cannot drift apart)."""

    kind: str  # "flow_grpo" | "cps" (see diffrl.rollout.samplers.STOCHASTIC_STEPS)
    noise_level: float
    cfg_scale: float  # classifier-free guidance used at every step (1 = off)
    null_ids: tuple[int, ...]  # (L,) ids of the empty prompt (the unconditional CFG branch)
    # whether samples may share a forward input at some step (shared initial noise, tree
    # noise): only then does training look for rows to merge (flow_grpo.shared_rows)
    shares_inputs: bool = True


@dataclass(frozen=True)
class Trajectory:
    """What the rollout engine produced for B = n_prompts * G samples."""

    prompts: PromptBatch = rows()  # B rows, grouped: rows [k*G, (k+1)*G) share a prompt
    group: Tensor = rows()  # (B,) int64 group id (one per prompt in this batch)
    seeds: Tensor = rows()  # (B,) int64 seed of each sample's initial noise and SDE noise
    # (B, *S) final clean sample in the family's latent space; S = (C, H, W) for images,
    # (C, F, H, W) for video ([-1, 1] pixels for the pixel-space tiny DiT)
    x0: Tensor = rows()
    sigmas: Tensor | None = None  # (T+1,) the sampler's sigma schedule, 1 -> 0
    policy_version: int = 0  # version of the weights that sampled this trajectory
    latents: Tensor | None = rows()  # (B, T+1, *S) x at each sigma (kept when asked)
    log_probs: Tensor | None = rows()  # (B, T) per-step Gaussian log-prob (SDE; 0 for ODE)
    sde_mask: Tensor | None = None  # (T,) bool: steps taken stochastically (with log-probs)
    step_spec: StepSpec | None = None  # how the stochastic steps were taken
    # (B, T) int64: the policy version that took each step. All policy_version, unless a weight
    # update arrived mid-rollout (run.async_sync=step): then the later steps carry the newer one
    step_versions: Tensor | None = rows()
    # media, e.g. "image" (B, H, W, 3) uint8; "video" (B, T, H, W, 3) uint8 with "fps" (B,)
    extra_fields: dict[str, Tensor] = field(default_factory=dict, metadata=ROW)
    # a video+audio family's flat x as (n_video, n_audio) elements, video first (its
    # ``modality_split()``); None for a family of one modality
    modality_split: tuple[int, int] | None = None
    # (B, T, 2) the per-step log-prob split by modality (video, audio): each the mean over its
    # own elements, so (n_v lp_v + n_a lp_a) / (n_v + n_a) = log_probs; with modality_split
    modality_log_probs: Tensor | None = rows()

    def __len__(self) -> int:
        return self.x0.shape[0]

    def with_fields(self, **fields: Tensor) -> Trajectory:
        return replace(self, extra_fields={**self.extra_fields, **fields})

    @staticmethod
    def concat(parts: list[Trajectory]) -> Trajectory:
        """Join micro-batches (each holding whole groups) back into one trajectory."""
        first = parts[0]
        if len(parts) == 1:
            return first
        # micro-batches that record their steps' versions may start under different weights (a
        # sync mid-rollout); the joined trajectory's policy_version is then the oldest
        per_step = all(p.step_versions is not None for p in parts)
        if not per_step and len({p.policy_version for p in parts}) != 1:
            raise ValueError("cannot concat trajectories sampled by different policy versions")
        if len({p.step_spec for p in parts}) != 1 or any(
            not _same_mask(p.sde_mask, first.sde_mask) for p in parts
        ):
            raise ValueError("cannot concat trajectories sampled with different SDE settings")

        joined = concat_rows(parts)
        return replace(joined, policy_version=min(p.policy_version for p in parts))


def _same_mask(a: Tensor | None, b: Tensor | None) -> bool:
    """Both None, or equal tensors."""
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


@dataclass(frozen=True)
class ScoredBatch:
    """A trajectory plus rewards. Samples whose optional scorer failed are ``valid=False``
    and are excluded from advantages; they are never scored 0."""

    traj: Trajectory = rows()
    rewards: Tensor = rows()  # (B,) float32 weighted sum over scorers
    per_scorer: dict[str, Tensor] = rows()  # name -> (B,) raw score (NaN where missing)
    valid: Tensor = rows()  # (B,) bool
    # modality ("video", "audio", "joint") -> (B,) the weighted scores declared of it
    # (``reward.scorers[*].modality``); they sum to ``rewards``. Empty = all joint
    modality_rewards: dict[str, Tensor] = field(default_factory=dict, metadata=ROW)

    def __len__(self) -> int:
        return self.rewards.shape[0]

    @staticmethod
    def concat(parts: list[ScoredBatch]) -> ScoredBatch:
        return replace(concat_rows(parts), traj=Trajectory.concat([p.traj for p in parts]))


@dataclass(frozen=True)
class TrainBatch:
    """What the actor trains on; ``algorithm.prepare`` fills the fields its loss reads (each
    algorithm its own: ``optimality`` for DiffusionNFT, ``advantages`` and the path for
    FlowGRPO, ``rewards`` and ``pairs`` for Diffusion-DPO)."""

    input_ids: Tensor = rows()  # (B, L) int64, the same tensor the rollout saw
    ids_hash: tuple[str, ...] = rows()  # (B,) hashes from the data stage
    x0: Tensor = rows()  # (B, *S) clean samples
    cond: Tensor | None = rows()  # (B, ...) the data stage's conditions beyond the text
    cond_hash: tuple[str, ...] | None = rows()  # (B,) their hashes from the data stage
    seeds: Tensor = rows()  # (B,) for reproducible training noise
    group: Tensor | None = rows()  # (B,) group id
    optimality: Tensor | None = rows()  # (B,) DiffusionNFT's r in [0, 1]
    advantages: Tensor | None = rows()  # (B,) FlowGRPO's clipped group advantage
    rewards: Tensor | None = rows()  # (B,) raw rewards (Diffusion-DPO's pairs come from them)
    noise_key: Tensor | None = rows()  # (B,) int64: rows with one key share training noise
    latents: Tensor | None = rows()  # (B, T+1, *S) (algorithms that need the path)
    log_probs: Tensor | None = rows()  # (B, T) rollout log-probs
    sigmas: Tensor | None = None  # (T+1,)
    # (P, 2) int64 (winner, loser) row indices; the batch holds pairs as rows 2p, 2p+1
    pairs: Tensor | None = None
    sde_mask: Tensor | None = None  # (T,) bool, from the trajectory
    step_spec: StepSpec | None = None  # from the trajectory
    step_versions: Tensor | None = rows()  # (B, T) int64, from the trajectory
    # algorithm.modality_credit: (B, 2) per modality (video, audio), from its own rewards plus
    # the joint ones: DiffusionNFT's r, FlowGRPO's clipped advantage
    modality_optimality: Tensor | None = rows()
    modality_advantages: Tensor | None = rows()
    modality_split: tuple[int, int] | None = None  # from the trajectory
    modality_log_probs: Tensor | None = rows()  # (B, T, 2) from the trajectory
    # the actor's version when this update starts, set by the async loop with
    # run.async_sync=step: FlowGRPO weighs the steps an older version took by truncated
    # importance sampling against it (None: no per-step correction, today's loss)
    prox_version: int | None = None

    def __len__(self) -> int:
        return self.x0.shape[0]

    def select(self, index: Tensor, device=None, host: tuple[str, ...] = ()) -> TrainBatch:
        """Rows ``index`` (optionally moved to ``device``, but for the fields named in ``host``);
        pairs are re-indexed as consecutive (winner, loser) rows, which is how the actor orders
        pairwise batches."""
        out = select_rows(self, index)
        if self.pairs is not None:
            out = replace(out, pairs=torch.arange(len(index)).reshape(-1, 2))
        if device is None:
            return out
        moved = {
            f.name: getattr(out, f.name).to(device)
            for f in dataclasses.fields(out)
            if f.metadata.get("rows")
            and isinstance(getattr(out, f.name), Tensor)
            and f.name not in host
        }
        return replace(out, **moved)


def train_batch(scored: ScoredBatch, **fields: Tensor) -> TrainBatch:
    """Every row of a scored batch as a ``TrainBatch`` carrying the trajectory's data plus the
    algorithm's own per-row ``fields``; ``prepare`` then selects the rows it trains on."""
    t = scored.traj
    return TrainBatch(
        input_ids=t.prompts.input_ids,
        ids_hash=t.prompts.ids_hash,
        x0=t.x0,
        cond=t.prompts.cond,
        cond_hash=t.prompts.cond_hash,
        seeds=t.seeds,
        group=t.group,
        latents=t.latents,
        log_probs=t.log_probs,
        sigmas=t.sigmas,
        sde_mask=t.sde_mask,
        step_spec=t.step_spec,
        step_versions=t.step_versions,
        modality_split=t.modality_split,
        modality_log_probs=t.modality_log_probs,
        prox_version=None,  # set by the async loop (run.async_sync=step), not by prepare
        **fields,
    )


def hash_rows(ids: Tensor) -> tuple[str, ...]:
    """Per-row stable fingerprint of (B, L) token ids (the first 16 hex digits of sha256): the
    token-drift check compares these. Little-endian int64 bytes make it independent of the
    tensor's dtype, device and platform, so two processes can compare them."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.ndim != 2:
        raise ValueError(f"ids must have shape (B, L), got {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
    rows = ids.detach().to("cpu", torch.int64).numpy().astype("<i8", copy=False)
    return tuple(hashlib.sha256(np.ascontiguousarray(r).tobytes()).hexdigest()[:16] for r in rows)


def hash_cond_rows(cond: Tensor) -> tuple[str, ...]:
    """Per-row fingerprint of (B, ...) float conditions (FL2VA's keyframe latents): sha256 of
    each row's exact bytes as little-endian float32, with its shape, so it is the same on every
    platform and device. float32 holds bf16 and fp16 values exactly (the data stage encodes in
    float32), so a row hashes alike in any of them; any changed value changes it."""
    if not isinstance(cond, Tensor) or not cond.is_floating_point() or cond.ndim < 1:
        raise TypeError(f"cond must be a (B, ...) float tensor, got {type(cond).__name__}")
    flat = cond.detach().to("cpu", torch.float32).flatten(1).numpy()  # (B, ...): B may be 0
    shape = repr(tuple(cond.shape[1:])).encode()
    rows = flat.astype("<f4", copy=False)
    return tuple(
        hashlib.sha256(shape + np.ascontiguousarray(r).tobytes()).hexdigest()[:16] for r in rows
    )


def _repeat(hashes: tuple[str, ...], g: int) -> tuple[str, ...]:
    return tuple(h for h in hashes for _ in range(g))


def _place(where: str) -> str:
    """``where``, with this process's rank when it is one of several (torchrun)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"{where} on rank {dist.get_rank()} of {dist.get_world_size()}"
    return where


def drifted_rows(record: PromptBatch | TrainBatch) -> list[str]:
    """Contract 3's findings on one record, as sentences (none: it holds the data stage's
    ids and conditions): its ``input_ids`` and ``cond`` re-hashed against the hashes the data
    stage made and the record carries."""
    out = _differ("input_ids", record.input_ids, record.ids_hash, hash_rows, "tokenized")
    if record.cond is not None and record.cond_hash is not None:
        what = "cond (conditioning frames/latents)"
        out += _differ(what, record.cond, record.cond_hash, hash_cond_rows, "encoded")
    elif record.cond is not None:
        out.append("cond arrived without the data stage's cond_hash (made where it is encoded)")
    elif record.cond_hash is not None:
        out.append("cond was dropped on the way (the record still carries its cond_hash)")
    return out


def _differ(name: str, value: Tensor, carried: tuple[str, ...], hash_fn, made: str) -> list[str]:
    if len(carried) != len(value):
        return [f"{len(value)} rows of {name} carry {len(carried)} hashes"]
    now = hash_fn(value)
    bad = [i for i, (a, b) in enumerate(zip(now, carried, strict=True)) if a != b]
    return [f"{name} of rows {_rows(bad)} changed since the data stage {made} them"] if bad else []


def _rows(index: list[int]) -> str:
    return str(index[:8]) + (f" (+{len(index) - 8} more)" if len(index) > 8 else "")


def drift_error(where: str, findings: list[str]) -> ContractError:
    return ContractError(
        f"token drift at {where}: {'; '.join(findings)} (hash mismatch). Prompts are tokenized "
        "and their conditions encoded once, in the data stage, and must travel unchanged"
    )


def check_token_hashes(record: PromptBatch | TrainBatch, where: str = "the actor") -> None:
    """Contract 3: ``record`` holds exactly the ids (and conditions) the data stage produced;
    else ``ContractError`` naming ``where`` (and this rank, under torchrun) and the rows."""
    findings = drifted_rows(record)
    if findings:
        raise drift_error(_place(where), findings)


def images_from_uint8(x: Tensor) -> Tensor:
    """(B, H, W, C) uint8 -> (B, C, H, W) float in [-1, 1], the model's space (the inverse of
    ``images_to_uint8`` up to rounding)."""
    return x.permute(0, 3, 1, 2).float() / 127.5 - 1


def images_to_uint8(x: Tensor) -> Tensor:
    """(B, C, H, W) in [-1, 1] -> (B, H, W, C) uint8, the form scorers read."""
    return (
        ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    )


def text_to_bytes(texts: list[str], width: int = 0) -> Tensor:
    """(B, N) uint8: each text's UTF-8 bytes, zero-padded to ``width`` (0: the longest); how a
    text answer (an autoregressive family's media) rides in ``extra_fields["text"]``, a tensor
    like any other. A fixed width lets micro-batches' records join row-wise."""
    raw = [t.encode() for t in texts]
    longest = max([1, *map(len, raw)])
    if width and longest > width:
        raise ValueError(f"a text of {longest} bytes does not fit the width {width}")
    out = torch.zeros(len(raw), width or longest, dtype=torch.uint8)
    for i, b in enumerate(raw):
        out[i, : len(b)] = torch.tensor(list(b), dtype=torch.uint8)
    return out


def bytes_to_text(t: Tensor) -> list[str]:
    """Inverse of ``text_to_bytes``: (B, N) uint8 -> B strings (trailing zero bytes dropped)."""
    return [bytes(row.tolist()).rstrip(b"\0").decode() for row in t.cpu()]
