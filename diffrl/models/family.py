"""The ``ModelFamily`` protocol: all the engines know about one family of models; the optional
capabilities a family declares (``ResolutionFree``, ``TakesConditions``, ``EncodesClips``,
``HasModalities``); and
``FamilySpec``, the one record each ``models/families/<name>.py`` exports as ``FAMILY``.

A family is data plus a few functions (STYLE 12). It says its native time convention and its
LoRA targets as data, tokenizes prompts once (contract 3), runs its text encoders once per
prompt (cached across the prompt's G samples), wraps its diffusers class so that the engines
see diffrl's canonical velocity (contract 1), decodes latents into media for the reward
(``extra_fields``), and lays out the rollout copy for serving (contract 2).

The engines never hold a family directly: they hold a ``FamilyModel`` (an ``nn.Module``), whose
``forward(x, sigma, input_ids)`` is the canonical velocity and whose ``family`` attribute is
shared, not copied, by every copy of the model (the rollout's, the evaluator's, the actor's),
so frozen text encoders and VAEs exist once per process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from diffrl.errors import ContractError
from diffrl.models.convention import broadcast, get_convention, noised
from diffrl.types import hash_rows

# contract 1's helpers, and contract 3's hash (it lives with the records that carry it),
# re-exported beside the family
__all__ = ["broadcast", "hash_rows", "noised"]


@dataclass(frozen=True)
class TokenBatch:
    """The one tokenization of a list of prompts (contract 3)."""

    input_ids: Tensor  # (B, L) int64; a family with several tokenizers concatenates their rows
    attention_mask: Tensor  # (B, L) bool, True = a real token
    hashes: tuple[str, ...]  # (B,) ``hash_row`` of each row of input_ids


def hash_row(row: Tensor) -> str:
    return hash_rows(row[None])[0]


@runtime_checkable
class ModelFamily(Protocol):
    """One model family. ``net`` is its native network: ``net(x, t_native, input_ids)`` returns
    the native model output, in the convention ``native_convention`` names."""

    name: str
    native_convention: str  # a key of diffrl.models.convention.CONVENTIONS
    lora_targets: tuple[str, ...]  # Linear-module name suffixes; explicit, never "all-linear"
    media: frozenset[str]  # the extra_fields ``decode`` fills ("image", or "video" and "fps")

    def tokenize(self, texts: Sequence[str]) -> TokenBatch: ...

    def null_ids(self) -> Tensor:  # (L,) ids of the empty prompt (the CFG unconditional branch)
        ...

    def latent_shape(self) -> tuple[int, ...]:  # one sample's x: (C, H, W) or (C, F, H, W)
        ...

    def decode(self, latents: Tensor) -> dict[str, Tensor]:  # (B, *latent_shape) -> media
        ...

    def encode_pixels(self, pixels: Tensor) -> Tensor:  # (B, 3, H, W) in [-1, 1] -> latents
        ...

    def serving_layout(self, model: nn.Module):  # re-lays the rollout copy; returns a SlotMap
        ...

    def flops(
        self, batch: int, input_ids: Tensor | None = None, cond: Tensor | None = None
    ) -> float:  # model FLOPs of one forward over ``batch`` samples (what counts: below)
        ...


# What ``flops`` counts, the way torch.utils.flop_counter.FlopCounterMode counts it (the tests
# hold each family to the counter, tests/models/test_flops.py): every matmul at 2 FLOPs per
# multiply-add (Linear, bmm, convolution), and attention as its two matmuls, QK^T and PV,
# 4 N_q N_k d per attention (d = heads x head width). Neither counts elementwise work (norms,
# activations, softmax, RoPE, modulation, residual adds), embedding lookups or index copies.
# These are model FLOPs of the forward; recompute under activation checkpointing is counted by
# ``diffrl.bench.flops`` (hardware FLOPs), not here. ``input_ids`` (batch, L): the forward's
# prompt rows, for families whose sequence follows the real text length (default: the longest
# text the family takes); ``cond``: the per-row conditions the forward packs (FL2VA keyframes).


def linear_flops(rows: float, d_in: float, d_out: float) -> float:
    """A Linear (or a 1x1 conv, or a patch conv with d_in = C p^2) over ``rows`` rows."""
    return 2.0 * rows * d_in * d_out


def attention_flops(n_q: float, n_k: float, d: float) -> float:
    """QK^T and PV of one attention: n_q queries over n_k keys, d = heads x head width."""
    return 4.0 * n_q * n_k * d


# --- optional capabilities: a family declares each by subclassing it ----------------------------


@runtime_checkable
class ResolutionFree(Protocol):
    """A family whose network runs at latent shapes other than ``latent_shape()`` (another
    resolution): continuous batching of mixed-resolution requests needs it. Without it,
    ``FamilyModel.forward`` takes ``latent_shape()`` only."""

    def accepts_shape(self, shape: tuple[int, ...]) -> bool: ...


@runtime_checkable
class HasMediaGeometry(Protocol):
    """A family that says what a task renders its conditions at."""

    def media_geometry(self) -> dict[str, float]:  # frames, size (px), fps, sample_rate
        ...


@runtime_checkable
class TakesConditions(HasMediaGeometry, Protocol):
    """A family whose network takes per-prompt conditions beyond the text (FL2VA's first and
    last frames), encoded once in the data stage and carried as ``PromptBatch.cond``."""

    def encode_conditions(self, conditions: Sequence[dict]) -> Tensor:  # -> (N, ...) latents
        ...


@runtime_checkable
class EncodesClips(Protocol):
    """A video+audio family that encodes ground-truth clips into its joint latent (the
    time-convention probe and the AVBench pretraining read clips through it)."""

    def encode_clip(self, video: Tensor, audio: Tensor) -> Tensor:  # (B,T,H,W,3), (B,S) -> (B,D)
        ...


@runtime_checkable
class HasModalities(Protocol):
    """A video+audio family whose flat latent x (B, D) holds the video's elements first and the
    audio's after: ``algorithm.modality_credit`` trains each part on its own rewards."""

    def modality_split(self) -> tuple[int, int]:  # (n_video, n_audio) elements of one x
        ...


# --- autoregressive families: a kind of their own --------------------------------------------

# where a prompt's image goes in its text: an AR family expands it into its own image tokens
IMAGE_MARKER = "<image>"
NO_TOKEN = -1  # a completion's ids after it ended (its first end-of-turn token), in x0


@runtime_checkable
class ARFamily(Protocol):
    """An autoregressive (token-sampling) family, such as an omni thinker that reads text and
    images and answers in text. It is a kind beside ``ModelFamily``, not one of them: it has no
    time convention, no latents, no velocity. What carries over is the rest of the map:
    prompts tokenized once (contract 3; here left-padded, so that a batch's completions start
    in one column), LoRA targets named explicitly, weight sync into the rollout's copy
    (contract 2), media in ``extra_fields`` (contract 4: the answer's text as UTF-8 bytes).

    Its model (``ARModel`` below) samples completions as ``Trajectory.x0`` (B, T) int64 ids,
    ``NO_TOKEN`` after the first end-of-turn, with their per-token log-probs recorded at
    generation in ``Trajectory.log_probs`` (B, T)."""

    name: str
    native_convention: str  # "": no time convention (contract 1 does not apply)
    lora_targets: tuple[str, ...]
    media: frozenset[str]  # the extra_fields its rollout fills ("text", and "image" with one)

    def tokenize(self, texts: Sequence[str]) -> TokenBatch: ...  # left-padded, template applied

    def decode(self, tokens: Tensor) -> dict[str, Tensor]:  # (B, T) ids -> {"text": bytes}
        ...

    def decode_text(self, tokens: Tensor) -> list[str]: ...  # (B, T) completion ids -> answers

    def condition_media(self, cond: Tensor) -> dict[str, Tensor]:  # PromptBatch.cond -> media
        ...

    def latent_shape(self) -> tuple[int, ...]:  # (tokens,) the most one sample can hold
        ...

    def serving_layout(self, model: nn.Module): ...  # -> SlotMap (contract 2)

    def flops(self, batch: int) -> float: ...


@runtime_checkable
class ARModel(Protocol):
    """What the engines call on an AR family's model (an ``nn.Module`` peft can wrap)."""

    family: ARFamily

    def sample(
        self, input_ids: Tensor, cond: Tensor | None, max_tokens: int, greedy: bool, seed: int
    ) -> tuple[Tensor, Tensor]:  # -> tokens (B, T) (NO_TOKEN after the end), log-probs (B, T)
        ...

    def forward(
        self, tokens: Tensor, temperature: Tensor, input_ids: Tensor, cond: Tensor | None = None
    ) -> Tensor:  # (B, T) log-probs of ``tokens`` after ``input_ids`` (0 where NO_TOKEN)
        ...


def is_autoregressive(model: nn.Module) -> bool:
    """Whether ``model`` (a loaded model) samples tokens: its family is an ``ARFamily``
    (``decode_text`` is what no diffusion family has)."""
    return isinstance(getattr(model, "family", None), ARFamily)


# --- the record a family module exports ------------------------------------------------------

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@dataclass(frozen=True)
class Builtin:
    """A weights file shipped inside the package (``diffrl/assets/<file>``), named
    ``builtin:<name>`` in a config, and the command that writes it."""

    file: str
    command: str  # e.g. "diffrl pretrain preset=sd3-shapes"
    preset: str = ""  # the preset the weights fit ("" = the family's own format, no preset)

    @property
    def path(self) -> Path:
        return ASSETS / self.file


@dataclass(frozen=True)
class FamilySpec:
    """Everything about one model family, as data: each ``models/families/<name>.py`` exports
    one as ``FAMILY``, and ``models/registry.py`` is the dict of them. Nothing outside the
    family's module names the family.

    ``load(cfg, device)`` builds a ``FamilyModel`` from a ``ModelConfig``; the instance it
    holds (``model.family``, a ``family_class``) is what the engines call at run time. The
    parallel plans map module-path patterns to styles (``parallel/tp.py``), applied outside
    the model; ``geometry`` is what ``diffrl plan`` counts activations with."""

    load: Callable[..., FamilyModel]  # (cfg: ModelConfig, device) -> FamilyModel
    # the ModelFamily ``load`` puts on the model; the record reads its name, convention, LoRA
    # targets, serving layout and FLOP count off it (declared once, on the class)
    family_class: type
    # model.preset name -> what it builds (the family's own size spec: widths, layers, ...)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # "builtin:<name>" -> a shipped file (model.checkpoint for the tiny DiT, else model.weights)
    builtins: Mapping[str, Builtin] = field(default_factory=dict)
    # tensor parallelism: the DiT's plan (module pattern -> style), None = no TP plan
    tp_plan: Mapping[str, Any] | None = None
    # ETP: the text encoders' plans, by the encoder's config.model_type
    etp_plans: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Ulysses SP: "diffusers" = the transformer class's own ``_cp_plan`` (parallel/sp.py
    # ``enable_ulysses``), "" = none (parallel.sp must stay 1)
    sp_plan: str = ""
    # memory geometry for ``diffrl plan``: (model, widths, conditioned) -> models.memory.Geometry
    geometry: Callable[..., Any] | None = None

    @property
    def name(self) -> str:
        return self.family_class.name

    @property
    def native_convention(self) -> str:  # a key of diffrl.models.convention.CONVENTIONS
        return self.family_class.native_convention

    @property
    def lora_targets(self) -> tuple[str, ...]:  # Linear-module suffixes, never "all-linear"
        return tuple(self.family_class.lora_targets)

    @property
    def serving_layout(self) -> Callable[..., Any]:  # (family, model) -> SlotMap (contract 2)
        return self.family_class.serving_layout

    @property
    def flops(self) -> Callable[..., float]:  # (family, batch, ids, cond) -> one forward's
        return self.family_class.flops


class Shared:
    """Holds frozen modules (text encoders, a VAE) that every copy of a model shares.

    ``copy.deepcopy`` of the model (the rollout and evaluator take copies) returns this same
    object, and ``nn.Module`` does not register it, so peft never targets these modules and
    their weights exist once per process.
    """

    def __init__(self, **modules) -> None:
        self.__dict__.update(modules)

    def __deepcopy__(self, memo) -> Shared:
        return self


class EncodeCache:
    """Text-encoder outputs per prompt row, keyed by the row's id hash: a prompt sampled G
    times (and trained on, and evaluated) is encoded once. Bounded, oldest evicted first."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity, self.store = capacity, {}
        self.hits = self.misses = 0
        # set (to why) once every row a run can ask for is in the store: a miss then raises.
        # Under ETP an encode is a collective of the encoder's group (``parallel/etp.py``), so a
        # miss on one rank alone would hang the group instead of encoding.
        self.sealed = ""

    def __deepcopy__(self, memo) -> EncodeCache:
        return self  # the encoders are shared, so their outputs are too

    def get(self, ids: Tensor, encode) -> list[tuple[Tensor, ...]]:
        """ids (B, L) -> one tuple of per-row tensors each; ``encode(ids_missing)`` returns a
        tuple of (b, ...) tensors for the rows not cached."""
        keys = hash_rows(ids)
        todo = [k for k in dict.fromkeys(keys) if k not in self.store]
        if todo and self.sealed:
            raise ContractError(
                f"text-encoder cache miss on prompt row(s) {todo[:4]} (id hashes; {len(todo)} "
                f"missing) after the cache was sealed: {self.sealed}"
            )
        if todo:
            out = encode(ids[[keys.index(k) for k in todo]])
            for j, k in enumerate(todo):
                self.store[k] = tuple(t[j].detach() for t in out)
            while len(self.store) > self.capacity:
                self.store.pop(next(iter(self.store)))
        self.misses += len(todo)
        self.hits += len(keys) - len(todo)
        return [self.store[k] for k in keys]


class FamilyModel(nn.Module):
    """The canonical velocity of a family's network: forward(x, sigma, input_ids) = eps - x0.

    ``convention`` converts sigma to the network's native time and the native output back
    (contract 1); it defaults to the family's own declaration, and a different one (a wrong
    declaration, or a deliberate adapter) is what the start-up probe checks.
    """

    def __init__(self, net: nn.Module, family: ModelFamily, convention: str = "") -> None:
        super().__init__()
        self.net = net
        self._family = Shared(family=family)  # shared across copies, unregistered
        self.convention = get_convention(convention or family.native_convention)

    @property
    def family(self) -> ModelFamily:
        return self._family.family

    def ids_device(self, device: torch.device | str) -> torch.device:
        """Where this model wants ``input_ids``. A diffusers net looks its text conditions up
        by the ids' content (``EncodeCache``, keyed on their hashes, taken on the host), so its
        ids stay in host memory: a forward then never waits for ids copied back from the GPU.
        A net that embeds the ids itself (the tiny DiT) takes them on ``device``."""
        return torch.device("cpu") if getattr(self.net, "host_ids", False) else torch.device(device)

    def forward(
        self, x: Tensor, sigma: Tensor, input_ids: Tensor, cond: Tensor | None = None
    ) -> Tensor:
        """The canonical velocity eps - x0 at ``sigma``; ``cond`` (B, ...) are per-row
        conditions beyond the text (FL2VA keyframe latents), for families that take them."""
        if sigma.ndim == 0:
            sigma = sigma.expand(x.shape[0])
        fam, shape = self.family, tuple(x.shape[1:])
        if shape != tuple(fam.latent_shape()) and not (
            isinstance(fam, ResolutionFree) and fam.accepts_shape(shape)
        ):
            raise ContractError(
                f"{self.family.name}: x has per-sample shape {tuple(x.shape[1:])}, the family "
                f"samples {tuple(self.family.latent_shape())}"
            )
        # the network runs in its own dtype (bf16 weights take bf16 inputs); diffrl's tensors
        # (latents, noise, log-prob maths) stay in theirs, so cast at this one boundary
        dtype = next(self.net.parameters()).dtype
        t = self.convention.to_native(sigma)
        t = t.to(dtype) if t.is_floating_point() else t
        if cond is None:
            native = self.net(x.to(dtype), t, input_ids)
        elif not isinstance(self.family, TakesConditions):
            raise ContractError(
                f"{self.family.name}: this family takes no conditions beyond the text, but the "
                f"batch carries some of shape {tuple(cond.shape)} (an FL2VA task on a T2V model?)"
            )
        else:
            native = self.net(x.to(dtype), t, input_ids, cond=cond.to(dtype))
        return (native * self.convention.velocity_sign).to(x.dtype)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of every ``nn.ModuleList`` child of a family model's transformer
    (``net.transformer``, or the net itself), under a peft wrapper or not: the units that
    regional compile and FSDP2 take one at a time."""
    root = transformer_root(model)
    return [b for child in root.children() if isinstance(child, torch.nn.ModuleList) for b in child]


def transformer_root(model: torch.nn.Module) -> torch.nn.Module:
    """A family model's transformer (``net.transformer``, or the net itself), under a peft
    wrapper or not: what block lists and TP plans' module paths are relative to."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    net = base.net
    return getattr(net, "transformer", net)
