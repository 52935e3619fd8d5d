"""The engine builders: the task, the model family and the three engines a run needs, from its
config, by registered name. The controller receives what ``build`` returns and knows no task or
family by name; each Ray host (``backends/ray.py``) builds its own engine with the same
``rollout_side``/``actor_side``, so this module sits below both and imports neither.
``diffrl.backends.build_engines`` picks the backend.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import torch

from diffrl.actor.engine import ActorConfig, ActorEngine
from diffrl.algorithms.modality import check_family
from diffrl.algorithms.registry import Algorithm, get_algorithm
from diffrl.config import Config
from diffrl.engines import ActorEngineProtocol, RewardEngineProtocol, RolloutEngineProtocol
from diffrl.errors import CONTRACTS_LOG, ConfigError
from diffrl.models.convention import ProbeReport, probe_convention
from diffrl.models.family import (
    EncodesClips,
    FamilyModel,
    HasMediaGeometry,
    TakesConditions,
    is_autoregressive,
)
from diffrl.models.probe import NoReference, ProbeResult, pipeline_parity
from diffrl.models.registry import family as family_spec
from diffrl.models.registry import load_model, lora_targets
from diffrl.parallel.etp import encode_all, shard_encoders
from diffrl.parallel.fsdp import shard_frozen_base
from diffrl.parallel.launch import SOLO, Ranks, local_device
from diffrl.parallel.launch import start as start_ranks
from diffrl.parallel.launch import stop as stop_ranks
from diffrl.parallel.sp import sp_hook
from diffrl.parallel.tp_lora import tp_hook
from diffrl.resources import check_model_fits
from diffrl.reward.pool import RewardPool, close_pool
from diffrl.rollout.ar import ARRolloutEngine
from diffrl.rollout.engine import RolloutEngine
from diffrl.rollout.samplers import euler_step, sigma_schedule
from diffrl.sync.bound import BoundReport, check_bound, match_targets
from diffrl.sync.shared_base import SharedBaseTarget, check_share_base, check_share_ranks
from diffrl.tasks import PromptSet, PromptSource, Task, build_task, prompt_source
from diffrl.tasks.base import ConditionedTask, ProbeData

log = logging.getLogger(__name__)
contracts = logging.getLogger(CONTRACTS_LOG)


@dataclass
class Engines:
    cfg: Config
    device: torch.device
    task: Task
    prompts: PromptSource  # training prompts, tokenized once
    eval_set: PromptSet  # held-out prompts, tokenized once
    rollout: RolloutEngineProtocol
    evaluator: RolloutEngineProtocol  # samples held-out eval with the trained adapter
    rewards: RewardEngineProtocol
    actor: ActorEngineProtocol
    algorithm: Algorithm
    probe: ProbeResult
    # releases what the engines hold (scorer clients, remote actors); awaited once at the end
    close: Callable[[], Awaitable[None]] | None = None
    # the other processes of a torchrun launch (parallel/launch.py): who writes the run
    # directory, metrics averaged over ranks, a stop any rank saw. One process: SOLO
    ranks: Ranks = SOLO
    # the bound-module gate's counts (diffrl/sync/bound.py): what the adapter is on
    bound: BoundReport | None = None
    # parallel.etp > 1: the text encoders sharded and the prompts encoded at start-up
    etp: str = ""
    # the model parallelism the actor applied, in a line for the console ("" = none)
    layout: str = ""

    async def aclose(self) -> None:
        if self.close is not None:
            await self.close()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"config key 'run.device' = {name!r}: CUDA is not available here")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_probe(cfg: Config, task: Task, model: FamilyModel) -> ProbeResult:
    """Contract 1 at start-up, on every family and recipe: pipeline parity against the family's
    own diffusers pipeline (any weights), then reconstruction of known x0 (the task's ground
    truth, else a synthetic image through the family's encoder), which decides only on trained
    weights. Raises on a wrong convention. ``probe.mode=off`` is the one way to skip, and the
    skip is logged. Runs under a forked RNG: the run's own random draws are untouched."""
    if is_autoregressive(model):  # contract 1 is about a time convention, which it has none of
        contracts.info("time-convention probes: not applicable (autoregressive family)")
        return ProbeResult(skipped=True)
    if cfg.probe.mode == "off":
        contracts.warning("time-convention probes skipped: probe.mode=off (see probe/skipped)")
        return ProbeResult(skipped=True)
    param = next(model.parameters())
    devices = [param.device] if param.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        parity, note = None, ""
        try:
            parity = pipeline_parity(
                model, sigma_schedule, euler_step, cfg.rollout.num_steps, cfg.rollout.shift,
                cfg.probe.prompt, cfg.probe.parity_calls,
            )  # fmt: skip
            contracts.info(
                "pipeline parity (%s): %d transformer calls equal the diffusers pipeline's "
                "(%s; worst %.2f of tolerance) in %.2f s", model.family.name, parity.calls,
                ", ".join(parity.inputs), parity.worst, parity.seconds,
            )  # fmt: skip
        except NoReference as e:
            note = str(e)
            contracts.info("pipeline parity: not applicable (%s); reconstruction decides", note)
        recon = reconstruction_probe(task, model)
    if parity is not None and not (recon is not None and recon.conclusive):
        contracts.info("time convention decided by pipeline parity alone")
    if parity is None and not (recon is not None and recon.conclusive):
        contracts.warning(
            "time convention unchecked: %s, and the reconstruction probe could not decide", note
        )
    return ProbeResult(parity=parity, reconstruction=recon, parity_note=note)


def reconstruction_probe(task: Task, model: FamilyModel) -> ProbeReport | None:
    """The declared convention against known x0: the task's ground truth when it has some,
    else synthetic images through the family's encoder. Decides only where the weights
    predict the flow-matching velocity (trained ones); says so when they do not."""
    data, fam = task.probe_data(), model.family
    param = next(model.parameters())
    x0 = None
    if data is not None and data.video is not None and isinstance(fam, EncodesClips):
        x0 = fam.encode_clip(data.video.to(param.device), data.audio.to(param.device))
    elif data is not None and data.pixels is not None:
        x0 = image_latents(task.name, fam, data.pixels.to(param.device, param.dtype))
    if x0 is None:  # no usable ground truth: make it
        data = synthetic_probe_data(fam)
        x0 = image_latents("synthetic", fam, data.pixels.to(param.device, param.dtype))
    if x0 is None:
        return None
    ids = fam.tokenize(data.texts).input_ids.to(model.ids_device(param.device))
    report = probe_convention(model, x0.to(param.dtype), ids)
    if report.conclusive:
        contracts.info(
            "reconstruction probe: the declared convention %r fits known x0 (cos %.3f)",
            model.convention.name, report.cosine,
        )  # fmt: skip
    else:
        contracts.info("reconstruction probe undecided: %s", report.reason)
    return report


def synthetic_probe_data(fam, n: int = 4) -> ProbeData:
    """``n`` fixed synthetic images (a two-colour gradient and a disc; no random draw) at the
    family's pixel size, with a caption each."""
    if isinstance(fam, HasMediaGeometry):
        side = int(fam.media_geometry()["size"])
    elif len(fam.latent_shape()) >= 3:  # (C, [F,] h, w): an 8x autoencoder's pixels, refit once
        side = 8 * int(fam.latent_shape()[-1])
    else:
        raise ConfigError(
            f"family {fam.name!r} samples flat latents and says no media geometry: the "
            "start-up probe cannot size its synthetic images (declare HasMediaGeometry)"
        )
    return ProbeData(synthetic_images(n, side), [SYNTHETIC_CAPTION] * n)


SYNTHETIC_CAPTION = "a bright disc on a smooth colour gradient"


def synthetic_images(n: int, side: int) -> torch.Tensor:
    """(n, 3, side, side) in [-1, 1]: image i is a diagonal gradient between two colours with
    a disc of a third colour, placed and coloured by i."""
    yy, xx = torch.meshgrid(torch.linspace(0, 1, side), torch.linspace(0, 1, side), indexing="ij")
    out = torch.empty(n, 3, side, side)
    for i in range(n):
        a = torch.tensor([(i * 0.37) % 1, 0.2, 0.8]).view(3, 1, 1)
        b = torch.tensor([0.9, (i * 0.61) % 1, 0.1]).view(3, 1, 1)
        ramp = ((xx + yy) / 2)[None]
        img = a * (1 - ramp) + b * ramp
        cx, cy = 0.3 + 0.4 * ((i * 0.53) % 1), 0.3 + 0.4 * ((i * 0.29) % 1)
        disc = ((xx - cx) ** 2 + (yy - cy) ** 2) < 0.04
        img = torch.where(disc[None], torch.tensor([1.0, 1.0, (i % 2) * 1.0]).view(3, 1, 1), img)
        out[i] = img * 2 - 1
    return out


def image_latents(source: str, fam, pixels):
    """``pixels`` encoded at the model's latent size (resized once when they do not fit); None
    (with a warning) when they still do not."""
    x0 = fam.encode_pixels(pixels)
    want = tuple(fam.latent_shape())
    if len(want) > 1 and tuple(x0.shape[1:]) != want and x0.shape[-1] != want[-1]:
        pixels = torch.nn.functional.interpolate(
            pixels, scale_factor=want[-1] / x0.shape[-1], mode="bilinear", antialias=True
        )
        x0 = fam.encode_pixels(pixels)
    if tuple(x0.shape[1:]) != want:
        log.warning(
            "reconstruction probe: the %s images encode to %s, the model samples %s",
            source, tuple(x0.shape[1:]), want,
        )  # fmt: skip
        return None
    return x0


def prompt_set(task: Task, model: FamilyModel, prompts) -> PromptSet:
    """The data stage: prompts tokenized once (contract 3) and, for a task with conditions
    beyond the text (FL2VA's first/last frames), those encoded once beside the tokens."""
    fam = model.family
    if not (isinstance(task, ConditionedTask) and task.needs_conditions):
        return PromptSet(prompts, fam.tokenize)
    if not isinstance(fam, TakesConditions):
        raise ConfigError(
            f"task {task.name!r} conditions each prompt on frames, and model family "
            f"{fam.name!r} takes no conditions beyond the text"
        )
    conds = task.prompt_conditions(prompts, fam.media_geometry())
    return PromptSet(prompts, fam.tokenize, fam.encode_conditions(conds))


@dataclass
class RolloutSide:
    """What the rollout's process builds: the data stage, the probe and the two rollout
    engines (the training rollout and the held-out evaluator), over one loaded model."""

    task: Task
    base: FamilyModel
    train: PromptSet
    eval_set: PromptSet
    probe: ProbeResult
    rollout: RolloutEngine | ARRolloutEngine
    evaluator: RolloutEngine | ARRolloutEngine
    etp: str = ""  # under parallel.etp > 1: what was sharded and encoded at start-up


def setup_process(cfg: Config, threads: int = 0) -> torch.device:
    """Threads, seeds and device: the same in every process that builds an engine, so each
    one's random draws are those of the one-process run (a torchrun rank's device is its own
    GPU)."""
    if threads or cfg.run.threads:
        torch.set_num_threads(threads or cfg.run.threads)
    seed_everything(cfg.run.seed)
    return pick_device(local_device(cfg.run.device))


def rollout_side(
    cfg: Config, device: torch.device, ranks: Ranks = SOLO, probe: bool = True
) -> RolloutSide:
    """``probe=False``: no start-up probe (a further Ray rollout replica of the same model and
    config, whose first replica ran it; ``backends/ray.py``)."""
    task = build_task(cfg.data)
    base = load_model(cfg.model, device)
    check_family(cfg.algorithm.modality_credit, base.family)  # before any work
    check_model_fits(cfg, base, expanded_targets(base, actor_targets(cfg)), device, ranks.dp_size)
    sharded = []
    if ranks.etp_size > 1:  # before anything encodes (parallel/etp.py)
        sharded = shard_encoders(base, family_spec(cfg.model.resolved_family), ranks.etp_mesh)
    train = prompt_set(task, base, task.prompts("train"))
    test_prompts = task.prompts("test")
    if cfg.data.eval_prompts:
        test_prompts = test_prompts[: cfg.data.eval_prompts]
    eval_set = prompt_set(task, base, test_prompts)
    checked = run_probe(cfg, task, base) if probe else ProbeResult(skipped=True)
    etp = ""
    if ranks.etp_size > 1:  # every row the run can ask for, in step on the ETP group; sealed
        for prompts in (train, eval_set):  # presentations with conditions (H3's FL2VA)
            if prompts.cond is not None and hasattr(base.net, "encode_with_conditions"):
                base.net.encode_with_conditions(
                    prompts.input_ids, prompts.cond, cfg.rollout.max_batch
                )
        rows = [train.input_ids, eval_set.input_ids, base.family.null_ids()]
        n = encode_all(base, rows, ranks.meshes.group("etp"), cfg.rollout.max_batch)
        etp = (
            f"ETP: text encoder(s) {', '.join(sharded)} sharded over {ranks.etp_size} ranks; "
            f"{n} prompt rows encoded at start-up, the encode cache sealed"
        )
    rollout_targets = expanded_targets(base, actor_targets(cfg))
    # rollout.share_base: both copies alias the loaded model and hold the LoRA beside it;
    # parallel.rollout=sharded under tp: both copies sharded with the actor's plan and tp group
    kw: dict = {}
    if cfg.rollout.share_base:
        check_share_ranks(ranks)
        kw = dict(lora_rank=cfg.actor.lora.rank)
    elif ranks.rollout_tp:
        kw = dict(tp_mesh=ranks.tp_mesh, tp_plan=family_spec(cfg.model.resolved_family).tp_plan)
    # an autoregressive family samples tokens: its own engine, behind the same Protocol
    engine = ARRolloutEngine if is_autoregressive(base) else RolloutEngine
    rollout = engine(base, cfg.rollout, rollout_targets, device, **kw)
    # held-out eval measures the policy itself: its own guidance, full precision, and independent
    # initial noise for every sample even when the rollout shares it within a group (DanceGRPO)
    eval_rollout = dataclasses.replace(
        cfg.rollout,
        cfg_scale=cfg.rollout.eval_cfg_scale,
        shared_init_noise=False,
        antithetic_noise=False,
        tree_noise=False,
        ode_dtype="float32",
    )
    evaluator = engine(base, eval_rollout, rollout_targets, device, **kw)
    if cfg.rollout.share_base:
        targets = [e.target for e in (rollout, evaluator)]
        held = sum(t.factor_bytes() for t in targets if isinstance(t, SharedBaseTarget))
        dit = sum(p.nbytes for p in base.parameters())
        contracts.info(  # (their shared base's row prints checked: contract 2)
            "rollout.share_base: the rollout and the evaluator alias the loaded model's %.2f "
            "MiB of weights (base row prints verified) and hold %.2f MiB of LoRA factors "
            "between them", dit / 2**20, held / 2**20,
        )  # fmt: skip
    return RolloutSide(task, base, train, eval_set, checked, rollout, evaluator, etp)


def actor_targets(cfg: Config) -> list[str]:
    return list(cfg.actor.lora.targets) or list(lora_targets(cfg.model))


def actor_side(
    cfg: Config, base: FamilyModel, device: torch.device, ranks: Ranks = SOLO
) -> ActorEngine:
    """The actor over ``base`` (peft wraps it in place). Built after ``load_model`` with no
    random draw in between, in one process or in its own. Under torchrun the frozen base is
    sharded over the data-parallel ranks and the adapters' gradients averaged over them."""
    algorithm = get_algorithm(cfg.algorithm.name)
    dp = ranks.dp_size > 1
    tp = None  # tensor parallel: the base and adapters sharded with the family's plan
    if ranks.meshes is not None and ranks.meshes.size("tp") > 1:
        assert ranks.meshes.main is not None, "a tp axis > 1 has a main mesh"
        spec = family_spec(cfg.model.resolved_family)
        tp = tp_hook(ranks.meshes.main["tp"], spec.tp_plan, spec.name, ranks.rollout_tp)
    sp = sp_group = None  # sequence parallel: the DiT's sequence sharded with the class's plan
    if ranks.meshes is not None and ranks.meshes.size("sp") > 1:
        assert ranks.meshes.main is not None, "an sp axis > 1 has a main mesh"
        spec = family_spec(cfg.model.resolved_family)
        sp, sp_group = (
            sp_hook(ranks.meshes.main["sp"], spec.name, spec.sp_plan, ranks.meshes.size("tp")),
            ranks.meshes.group("sp"),
        )
    return ActorEngine(
        base, actor_with_horizon(cfg), actor_targets(cfg), algorithm, cfg.algorithm, device,
        cfg.run.seed,
        shard=shard_frozen_base(ranks.meshes.fsdp_mesh) if dp else None,
        dp_group=ranks.dp_group if dp else None,
        rows_groups=ranks.rows_groups,
        tensor_parallel=tp,
        sequence_parallel=sp,
        sp_group=sp_group,
    )  # fmt: skip


def check_config(cfg: Config) -> Algorithm:
    """The rules that span components, checked before any backend builds an engine; returns
    the run's algorithm."""
    cfg.check_across()  # load_config ran it too; a config built in code may not have been
    check_share_base(cfg)
    return get_algorithm(cfg.algorithm.name)


def build(cfg: Config) -> Engines:
    """The run's engines in this process (``run.backend=local``)."""
    algorithm = check_config(cfg)
    ranks = start_ranks(cfg)  # torchrun: the process group and meshes; else SOLO
    cfg.data.check_loop(cfg.run.mode, ranks.dp_size)
    device = setup_process(cfg)
    side = rollout_side(cfg, device, ranks)
    rewards = RewardPool(cfg.reward)
    rewards.check_inputs(produced=set(side.rollout.produces))
    actor = actor_side(cfg, side.base, device, ranks)
    bound = check_bound(actor_targets(cfg), side.base.family.name, actor.bound, side.rollout.bound)

    async def close() -> None:
        try:
            await close_pool(rewards)
        finally:
            stop_ranks()

    return Engines(
        cfg,
        device,
        side.task,
        prompt_source(side.train, cfg.data, cfg.run.seed, (ranks.dp_rank, ranks.dp_size)),
        side.eval_set,
        side.rollout,
        side.evaluator,
        rewards,
        actor,
        algorithm,
        side.probe,
        close=close,
        ranks=ranks,
        bound=bound,
        etp=side.etp,
        layout=actor.layout,
    )


def actor_with_horizon(cfg: Config) -> ActorConfig:
    """``actor.lr_horizon`` = 0 decays the learning rate over the whole run: run.steps RL steps
    of ``actor.minibatches`` optimizer steps each."""
    actor = cfg.actor
    if actor.lr_schedule == "constant" or actor.lr_horizon:
        return actor
    horizon = cfg.run.steps * actor.minibatches
    if horizon and actor.lr_warmup >= horizon:
        raise ConfigError(
            f"config key 'actor.lr_warmup' = {actor.lr_warmup}: must be < the schedule's "
            f"horizon, run.steps x actor.minibatches = {horizon} (or set actor.lr_horizon)"
        )
    return dataclasses.replace(actor, lr_horizon=horizon)


def expanded_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """Suffix targets ("attn.to_q") -> the full module names the rollout must receive; every
    suffix must match a Linear (``BoundModuleError`` names the family and the suffix)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    family = getattr(getattr(model, "family", None), "name", type(model).__name__)
    chosen = set().union(*match_targets(linears, targets, family, "rollout copy").values())
    return [n for n in linears if n in chosen]  # in the model's module order
