"""Contract 1 at start-up, without ground truth: pipeline parity.

The family's own diffusers pipeline is the reference for what its transformer must receive. The
probe runs that pipeline for the first ``calls`` denoising steps from a fixed noise and prompt,
with a forward pre-hook on the transformer that records every input (latents, timestep, guidance,
encoder states, ids, masks), then runs diffrl's rollout path for the same steps (the family's
tokenization, ``FamilyModel``'s convention, the rollout's sigma schedule and Euler step) over the
same transformer, and requires the same inputs call by call. It needs no trained weights: a
timestep off by 1000, a shift applied twice, reversed time or a dropped guidance input changes
what the transformer receives whatever its weights are. The second call also checks the
velocity's sign: its latents are the first call's output stepped by each side's update rule,
and the two steps must point the same way (in bfloat16 a step can be smaller than the tolerance
on the latents' values, so their direction is checked on its own).

The pipeline runs with diffrl's sigma grid handed in unshifted (``sigmas=``) and a
``FlowMatchEulerDiscreteScheduler`` that applies the rollout's ``shift`` once and no dynamic
shifting, so the two sides agree exactly when diffrl applies the shift once too.

A family opts in by subclassing ``HasReferencePipeline``: ``reference(model, shift)`` builds
its pipeline over the model's own components (the same transformer instance) and returns how
to call it. Everything here draws from its own generator; torch's global RNG is untouched.
"""

from __future__ import annotations

import inspect
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from diffrl.errors import ContractError, check, check_choice
from diffrl.models.convention import ProbeReport


@dataclass(frozen=True)
class ProbeConfig:
    """The start-up probes of contract 1. ``mode=off`` is the only way to skip them, and a skip
    is logged in ``metrics.jsonl`` (``probe/skipped``)."""

    mode: str = "on"  # on | off
    parity_calls: int = 2  # transformer calls compared (>= 2 also checks the velocity's sign)
    prompt: str = "a red circle above a blue square"  # the parity probe's prompt

    def __post_init__(self) -> None:
        # YAML reads a bare on/off as a boolean (``probe.mode=off`` arrives as False)
        spelled = {"False": "off", "false": "off", "True": "on", "true": "on"}
        object.__setattr__(self, "mode", spelled.get(str(self.mode), str(self.mode)))

    def validate(self) -> None:
        check_choice("mode", self.mode, ("on", "off"))
        check(self.parity_calls >= 1, "parity_calls", self.parity_calls, "must be >= 1")


@dataclass(frozen=True)
class Reference:
    """A family's diffusers pipeline, ready to run: ``call(prompt, noise, grid)`` runs it from
    ``noise`` (1, *latent_shape), diffrl's layout, converted by the family to the pipeline's)
    over the unshifted sigma ``grid`` (T values from 1 down); the probe stops it after the
    calls it compares. ``transformer`` is the module both sides call."""

    transformer: nn.Module
    call: Callable[[str, Tensor, Sequence[float]], Any]
    # inputs the pipeline passes that diffrl legitimately leaves to the transformer's default
    # (each with the reason), e.g. an attention-kwargs dict of None
    optional: dict[str, str] = field(default_factory=dict)


class NoReference(Exception):
    """A family with a reference pipeline, for a model that pipeline cannot run (e.g. a preset
    on its own codecs): parity does not apply, and the reconstruction probe must decide."""


@runtime_checkable
class HasReferencePipeline(Protocol):
    """A family whose own diffusers pipeline is the reference for the parity probe."""

    def reference(self, model: nn.Module, shift: float) -> Reference: ...


def flow_scheduler(shift: float):
    """The reference pipelines' scheduler: the rollout's shift applied once to the sigmas
    handed in, no resolution-dependent (dynamic) shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False
    )


@dataclass(frozen=True)
class ParityReport:
    calls: int  # transformer calls compared
    inputs: tuple[str, ...]  # the inputs compared at each call
    worst: float  # worst difference as a fraction of its tolerance (< 1 passes)
    seconds: float  # wall time of both runs


@dataclass(frozen=True)
class ProbeResult:
    """What the start-up probes found (``build.run_probe``), logged at step 0."""

    skipped: bool = False  # probe.mode=off
    parity: ParityReport | None = None
    reconstruction: ProbeReport | None = None
    parity_note: str = ""  # why parity did not run (a family with no diffusers pipeline)

    def metrics(self) -> dict[str, float]:
        nan = float("nan")
        p, r = self.parity, self.reconstruction
        return {
            "probe/skipped": float(self.skipped),
            "probe/cosine": r.cosine if r is not None else nan,
            "probe/parity_worst": p.worst if p is not None else nan,
            "probe/parity_s": p.seconds if p is not None else nan,
        }


class _Enough(Exception):
    """Raised from the hook to stop a pipeline once its first calls are recorded."""


@contextmanager
def recording(module: nn.Module, calls: int) -> Iterator[list[dict[str, Any]]]:
    """Records the bound inputs of ``module``'s next ``calls`` forwards (detached copies, the
    defaults of those left out filled in), then raises ``_Enough`` from the next one."""
    signature = inspect.signature(module.forward)
    seen: list[dict[str, Any]] = []

    def hook(_mod, args, kwargs):
        if len(seen) >= calls:
            raise _Enough
        bound = signature.bind_partial(*args, **kwargs)
        # an argument passed at forward's default is the same call as one left out: compare
        # what forward sees, so a pipeline's explicit ``flag=False`` is not a "dropped input"
        bound.apply_defaults()
        seen.append({k: _snapshot(v) for k, v in bound.arguments.items()})

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _snapshot(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, list | tuple):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, dict | list | tuple) and len(value) == 0)


# per-dtype tolerance on a tensor input, relative to its largest entry: float32 leaves room for
# the encoders' different reduction orders, bfloat16 for one rounding of each side's latents
_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# in bfloat16 and float16 a tensor is judged as a whole, by its relative rms difference: a text
# encoder tens of layers deep, run by the pipeline and by diffrl on differently padded rows,
# differs by a few percent there (real size, random weights, on an H200: Qwen-Image's states
# 0.043, MiniMax-H3's 0.046; in float32 Qwen-Image's agree within 0.15 of _RTOL's 1e-4), with
# single entries off by up to 2.6x the max-entry bound above. A wrong template, layer, length
# or token offset moves the whole tensor (rel rms near 1); a flipped step is seen by direction
_RMS = {torch.bfloat16: 0.15, torch.float16: 0.1}


def _compare(
    name: str, ref: Any, ours: Any, rtol: float, rms: float | None = None
) -> tuple[float, str]:
    """(difference as a fraction of its tolerance, what differs) for one input: tensors by
    their largest entry's difference (``rtol`` of the largest entry), or, given ``rms``, tensors
    of more than 4 entries by their relative rms difference."""
    if isinstance(ref, Tensor) or isinstance(ours, Tensor):
        if not (isinstance(ref, Tensor) and isinstance(ours, Tensor)):
            return math.inf, f"{name}: pipeline passes {_kind(ref)}, diffrl passes {_kind(ours)}"
        if ref.is_floating_point() != ours.is_floating_point() and ref.numel() and ours.numel():
            return math.inf, f"{name}: pipeline passes {ref.dtype}, diffrl passes {ours.dtype}"
        a, b = ref.double(), ours.double()
        if a.shape != b.shape:
            if a.numel() == b.numel() == 1 or (a.numel() == 1 or b.numel() == 1):
                a, b = a.reshape(-1), b.reshape(-1)  # a scalar timestep vs a (1,) one
                a, b = torch.broadcast_tensors(a, b)
            else:
                return math.inf, f"{name}: pipeline shape {tuple(a.shape)}, diffrl {tuple(b.shape)}"
        if not ref.is_floating_point():
            bad = int((a != b).sum())
            return (math.inf, f"{name}: {bad} of {a.numel()} entries differ") if bad else (0.0, "")
        scale = float(a.abs().max()) if a.numel() else 0.0
        tol = rtol * scale + 1e-6
        err = float((a - b).abs().max()) if a.numel() else 0.0
        if rms is not None and a.numel() > 4:  # a low-precision tensor: judged as a whole
            rel = float((a - b).norm() / a.norm().clamp_min(1e-12))
            frac = rel / rms
            return frac, f"{name}: rel rms difference {rel:.3g} against tolerance {rms:.3g}"
        where = ""
        if a.numel() <= 4:
            where = f" (pipeline {a.flatten().tolist()}, diffrl {b.flatten().tolist()})"
        elif a.numel():  # where it differs most, and how much overall (relative rms)
            at = tuple(int(i) for i in torch.unravel_index((a - b).abs().argmax(), a.shape))
            rel = float((a - b).norm() / a.norm().clamp_min(1e-12))
            where = f" at index {at} (pipeline {a[at]:.4g}, diffrl {b[at]:.4g}; rel rms {rel:.3g})"
        return err / tol, f"{name}: max |difference| {err:.4g} against tolerance {tol:.3g}{where}"
    if isinstance(ref, list | tuple) and isinstance(ours, list | tuple):
        if len(ref) != len(ours):
            return math.inf, f"{name}: pipeline passes {len(ref)} items, diffrl {len(ours)}"
        parts = [
            _compare(f"{name}[{i}]", r, o, rtol, rms)
            for i, (r, o) in enumerate(zip(ref, ours, strict=True))
        ]
        return max(parts, default=(0.0, ""), key=lambda p: p[0])
    if isinstance(ref, dict) and isinstance(ours, dict):
        keys = sorted(set(ref) | set(ours))
        parts = [_compare(f"{name}.{k}", ref.get(k), ours.get(k), rtol, rms) for k in keys]
        return max(parts, default=(0.0, ""), key=lambda p: p[0])
    if isinstance(ref, float) or isinstance(ours, float):
        try:
            a, b = float(ref), float(ours)
        except (TypeError, ValueError):
            return math.inf, f"{name}: pipeline passes {ref!r}, diffrl passes {ours!r}"
        tol = rtol * abs(a) + 1e-6
        return abs(a - b) / tol, f"{name}: pipeline {a!r}, diffrl {b!r}"
    if ref != ours:
        return math.inf, f"{name}: pipeline passes {ref!r}, diffrl passes {ours!r}"
    return 0.0, ""


_TIME = re.compile("timestep|sigma|guidance")
LATENTS = "hidden_states"  # diffusers transformers' name for the latents they denoise


def _kind(v: Any) -> str:
    return f"a tensor {tuple(v.shape)}" if isinstance(v, Tensor) else repr(v)


def compare_calls(
    ref: list[dict[str, Any]],
    ours: list[dict[str, Any]],
    rtol: float,
    family: str,
    optional: dict[str, str] | None = None,
    rms: float | None = None,
) -> tuple[float, tuple[str, ...]]:
    """Raise ``ContractError`` naming the first input that differs; else (worst fraction of
    tolerance, the inputs compared)."""
    optional = optional or {}
    if len(ours) < len(ref):
        raise ContractError(
            f"pipeline parity ({family}): the pipeline called its transformer {len(ref)} times "
            f"in the probed steps, diffrl {len(ours)} times"
        )
    worst, names = 0.0, set()
    for k, (r, o) in enumerate(zip(ref, ours[: len(ref)], strict=True)):
        # the time inputs first: their error names the cause most plainly
        for key in sorted(set(r) | set(o), key=lambda n: (not _TIME.search(n), n)):
            if key == "return_dict":
                continue
            rv, ov = r.get(key), o.get(key)
            if _empty(rv) and _empty(ov):
                continue
            if _empty(ov) and key in optional:
                continue
            if _empty(ov):
                raise ContractError(
                    f"pipeline parity ({family}), transformer call {k}: the pipeline passes "
                    f"{key!r} ({_kind(rv)}) and diffrl's rollout does not (a dropped input)"
                )
            if _empty(rv):
                raise ContractError(
                    f"pipeline parity ({family}), transformer call {k}: diffrl's rollout passes "
                    f"{key!r} ({_kind(ov)}) and the pipeline does not"
                )
            frac, what = _compare(key, rv, ov, rtol, rms)
            names.add(key)
            if not frac < 1.0:
                raise ContractError(
                    f"pipeline parity ({family}), transformer call {k}: the rollout's input "
                    f"differs from the family's diffusers pipeline, {what}. A time input off in "
                    "scale (sigma vs 1000 sigma), a shift applied twice, reversed time, a "
                    "flipped velocity (call 1's latents) or another text encoding does this"
                )
            worst = max(worst, frac)
        if k:
            _check_direction(family, k, ref[k - 1 : k + 1], ours[k - 1 : k + 1])
    return worst, tuple(sorted(names))


def _check_direction(family: str, k: int, ref: list[dict], ours: list[dict]) -> None:
    """The latents' step into call ``k`` must go the pipeline's way. In bfloat16 a step is
    about one rounding of the latents, under the tolerance on their values, so a flipped
    velocity can pass the comparison above; the steps' inner product still sees it (positive
    when they agree, whatever their rounding; negative when one side moved backwards)."""
    (r0, r1), (o0, o1) = ((c[0].get(LATENTS), c[1].get(LATENTS)) for c in (ref, ours))
    if not all(isinstance(t, Tensor) for t in (r0, r1, o0, o1)):
        return
    if not r0.shape == r1.shape == o0.shape == o1.shape:
        return  # the comparison above names a shape change
    d_ref, d_ours = (r1.double() - r0.double()).flatten(), (o1.double() - o0.double()).flatten()
    dot = float(d_ref @ d_ours)
    if dot < 0:
        cos = dot / float(d_ref.norm() * d_ours.norm())
        raise ContractError(
            f"pipeline parity ({family}), transformer call {k}: diffrl's rollout stepped the "
            f"latents against the pipeline's step (cosine {cos:.3f} between the two steps): a "
            "flipped velocity or a reversed update rule"
        )


@torch.no_grad()
def pipeline_parity(
    model,
    schedule: Callable[[int, float], Tensor],
    step: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    num_steps: int,
    shift: float,
    prompt: str,
    calls: int = 2,
    seed: int = 0,
) -> ParityReport:
    """Run the family's pipeline and diffrl's rollout path (``schedule(num_steps, shift)`` the
    sigmas, ``step(x, v, sigma, sigma_next)`` the ODE update) for ``calls`` transformer calls
    from the same noise and prompt; raise ``ContractError`` on the first input that differs."""
    fam = model.family
    if not isinstance(fam, HasReferencePipeline):
        raise NoReference(f"family {fam.name!r} has no diffusers pipeline")
    start = time.perf_counter()
    calls = min(calls, num_steps)
    param = next(model.net.parameters())
    ref = fam.reference(model, shift)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((1, *fam.latent_shape()), generator=g).to(param.device)
    grid = torch.linspace(1.0, 0.0, num_steps + 1)[:-1].tolist()
    with recording(ref.transformer, calls) as want, suppress(_Enough):
        ref.call(prompt, noise.clone(), grid)
    sigmas = schedule(num_steps, shift).to(param.device)
    ids = fam.tokenize([prompt]).input_ids.to(model.ids_device(param.device))
    with recording(ref.transformer, calls) as got:
        x = noise.clone()
        with suppress(_Enough):
            for k in range(calls):
                v = model(x, sigmas[k : k + 1], ids)
                x = step(x, v, sigmas[k], sigmas[k + 1])
    label = f"{fam.name}, declared convention {model.convention.name!r}"
    rtol, rms = _RTOL.get(param.dtype, 1e-4), _RMS.get(param.dtype)
    worst, names = compare_calls(want, got, rtol, label, dict(ref.optional), rms)
    return ParityReport(len(want), names, worst, time.perf_counter() - start)
