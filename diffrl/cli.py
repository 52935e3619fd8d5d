"""diffrl's command line: ``diffrl train [RECIPE] [key=value ...]`` and friends."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Callable

from diffrl.errors import CONTRACTS_LOG, DiffrlError
from diffrl.extras import install_hint


def _recipe_config(argv: list[str]):
    """``[RECIPE] [key=value ...]`` -> the loaded config (the default recipe when none)."""
    from diffrl.config import load_config

    recipe, overrides = _split(argv)
    return load_config(recipe or "recipes/shapes_nft.yaml", overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from diffrl.controller.loop import train

    cfg = _recipe_config(args.args)
    root = asyncio.run(train(cfg))
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        print(f"run directory: {root}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from diffrl.bench.mfu import bench

    cfg = _recipe_config(args.args)
    result = bench(
        args.kind, cfg, repeats=args.repeats, baseline=not args.no_baseline, profile=args.profile
    )
    for k, v in result.rows().items():
        print(f"{k:40s} {v:.4g}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from diffrl.parallel.plan import PlanOptions, condition_keys, model_facts, plan
    from diffrl.tasks import build_task

    cfg = _recipe_config(args.args)
    task = build_task(cfg.data)
    device = "cpu" if cfg.run.device == "cpu" else "cuda"  # whose kernels; auto: a GPU's
    facts = model_facts(cfg, device)
    opts = PlanOptions(
        world_size=args.world_size,
        tp=args.tp,
        etp=args.etp,
        dp_shard=args.dp_shard,
        dp_replicate=args.dp_replicate,
        sp=args.sp,
        gpu_gib=args.gpu_gb,
        share_rollout=args.share_rollout,
        rollout=args.rollout,
        offload_encoder=args.offload_encoder,
        train=args.train,
        conditioned=condition_keys(task, facts.model.family),
        device=device,
    )
    result = plan(cfg, opts, facts)
    print(result.table())
    return 0 if result.fits else 1


def cmd_pretrain(args: argparse.Namespace) -> int:
    from diffrl.pretrain import load_pretrain_config, pretrain

    pcfg = load_pretrain_config(args.args)
    path = pretrain(pcfg)
    print(f"base model written to {path}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if args.run:  # a trained run: its newest verified checkpoint, with the run's own config
        from diffrl.controller.tools import evaluate_run

        metrics = asyncio.run(evaluate_run(args.run, args.overrides))
    else:
        from diffrl.pretrain import evaluate_checkpoint

        metrics = evaluate_checkpoint(
            args.checkpoint,
            samples_per_prompt=args.samples,
            num_steps=args.steps,
            device=args.device,
        )
    for k, v in metrics.items():
        print(f"{k:28s} {v:.3f}")
    return 0


def cmd_serve_reward(args: argparse.Namespace) -> int:
    try:
        from diffrl.reward.http.server import ConnectionLimits, serve
    except ImportError as e:
        raise DiffrlError(
            f"serve-reward needs the server stack ({e.name} is missing): "
            "pip install -e '.[serve]' (fastapi, uvicorn, h11)"
        ) from None
    # flags left unset keep the library defaults (ConnectionLimits, serve's max_decoded_mb)
    given = {
        "header_timeout_s": args.header_timeout_s,
        "body_timeout_s": args.body_timeout_s,
        "max_connections": args.max_connections,
        "max_queued": args.max_queued,
        "queue_timeout_s": args.queue_timeout_s,
        "max_idle": args.max_idle_connections,
    }
    limits = ConnectionLimits(**{k: v for k, v in given.items() if v is not None})
    budgets = {"max_decoded_mb": args.max_decoded_mb, "max_request_mpx": args.max_request_mpx}
    budgets = {k: v for k, v in budgets.items() if v is not None}
    import diffrl.tasks  # noqa: F401  (registers the tasks' own scorers: shapes, avbench)

    serve(
        args.scorer,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_body_mb=args.max_body_mb,
        params=_scorer_params(args.scorer_param),
        limits=limits,
        **budgets,
    )
    return 0


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: a finite number > 0 (argparse turns the error into exit code 2)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            what = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"must be {what} > 0, got {text!r}")
        return value

    return parse


def cmd_export(args: argparse.Namespace) -> int:
    from diffrl.controller.tools import export_run

    path = export_run(args.run, args.out, args.adapter)
    print(f"LoRA written to {path} (diffusers: pipe.load_lora_weights({str(path.parent)!r}))")
    return 0


def _scorer_params(items: list[str]) -> dict:
    """``key=value`` pairs -> scorer params, with values typed as in recipe overrides
    (OmegaConf dotlist: ``mode=overall``, ``k=3``, ``needs=[image,video]``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [i for i in items if "=" not in i]
    if bad:
        raise DiffrlError(f"--scorer-param {bad[0]!r}: expected key=value")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(items), resolve=True)
    except OmegaConfBaseException as e:
        raise DiffrlError(f"--scorer-param: {e}") from None


def _split(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


class _TrainHelp(argparse.Action):
    """``diffrl train -h``: the usage, then the config keys by section (``config_help``)."""

    def __init__(self, option_strings, dest, **kw) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from diffrl.config_help import config_keys_help

        parser.print_help()
        print(f"\n{config_keys_help()}")
        parser.exit()


def _take_trailing(parser: argparse.ArgumentParser, args, extra: list[str]) -> None:
    """argparse fills a ``nargs="*"`` positional only from the words before the first flag:
    the words after the flags (``bench rollout --repeats 1 run.threads=1``) belong to the
    same list (a command's recipe and overrides; ``eval``'s overrides)."""
    if not extra:
        return
    dest = "overrides" if args.command == "eval" else "args"
    if any(e.startswith("-") for e in extra) or not isinstance(getattr(args, dest, None), list):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setattr(args, dest, [*getattr(args, dest), *extra])


def _refusal(e: Exception, command: str) -> str | None:
    """The one line a failure the user can act on is shown as (the command exits 2), or None
    for one to raise with its traceback."""
    if isinstance(e, DiffrlError):
        return str(e)
    if isinstance(e, OSError):  # a full disk in a write diffrl does not wrap (TensorBoard, ...)
        from diffrl.diskio import DISK_ERRNOS, disk_message

        return disk_message(e) if e.errno in DISK_ERRNOS else None
    if isinstance(e, ImportError):  # an optional extra not installed: say which
        hint = install_hint(e)
        return None if hint is None else f"diffrl {command} needs {hint}"
    return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # what the start-up contract checks found is shown, not only their failures
    logging.getLogger(CONTRACTS_LOG).setLevel(logging.INFO)
    # an offloaded encoder's first visits say how long they take (real-size H3: the encode)
    logging.getLogger("diffrl.models.host_offload").setLevel(logging.INFO)
    parser = argparse.ArgumentParser(prog="diffrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "train",
        help="RL post-training from a recipe (default: shapes_nft)",
        add_help=False,  # its -h also lists the config keys (read only when asked: imports)
    )
    p.add_argument("-h", "--help", action=_TrainHelp, help="this help and every config key")
    p.add_argument(
        "args", nargs="*", help="[RECIPE] [key=value ...]: RECIPE a path, or a name in recipes/"
    )
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser(
        "bench",
        help="throughput, step latency and MFU of a recipe's engines "
        "(rollout|train|epoch|pipeline)",
    )
    p.add_argument("kind", choices=("rollout", "train", "epoch", "pipeline"))
    p.add_argument("args", nargs="*", help="[RECIPE.yaml] [key=value ...]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-loop baseline")
    p.add_argument(
        "--profile",
        default="",
        metavar="FILE",
        help="after the timings, profile one more repeat (torch.profiler) and write its kernel "
        "table and time by kernel kind to FILE",
    )
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser(
        "plan", help="per-GPU memory of a recipe's layout, by component, and the knob to turn"
    )
    p.add_argument("args", nargs="*", help="[RECIPE.yaml] [key=value ...]")
    # the parallel degrees: the recipe's parallel.* keys, overridden by these; the world size is
    # this flag's here (diffrl train takes the launcher's)
    for flag in ("world-size", "tp", "etp", "dp-shard", "dp-replicate", "sp"):
        p.add_argument(f"--{flag}", type=int, help="parallel degree (default 1; dp-shard: fill)")
    p.add_argument("--gpu-gb", type=_positive(float), default=141.0, help="GiB per GPU (H200)")
    p.add_argument(
        "--share-rollout", action="store_true", help="rollout and eval sample the actor's weights"
    )
    p.add_argument(
        "--rollout",
        choices=("replicated", "sharded"),
        help="under tp, the rollout's and evaluator's DiT copies whole on every rank or in the "
        "actor's TP layout (default: the recipe's parallel.rollout, else replicated)",
    )
    p.add_argument(
        "--offload-encoder",
        action=argparse.BooleanOptionalAction,
        help="text encoder in host memory (default: where the family puts it)",
    )
    p.add_argument("--train", choices=("lora", "full"), default="lora")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("pretrain", help="flow-matching pre-training of the built-in tiny DiT")
    p.add_argument("args", nargs="*", help="key=value overrides (steps=, out=, hidden=, ...)")
    p.set_defaults(fn=cmd_pretrain)
    p = sub.add_parser(
        "eval", help="held-out metrics of a run's newest checkpoint, or of a base checkpoint"
    )
    p.add_argument("run", nargs="?", default="", help="a run directory (runs/<name>)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for the run")
    p.add_argument("--checkpoint", default="builtin:shapes_dit", help="a base model, no run")
    p.add_argument("--samples", type=int, default=2, help="samples per eval prompt")
    p.add_argument("--steps", type=int, default=10, help="ODE sampler steps")
    p.add_argument("--device", default="auto")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("export", help="write a run's LoRA in the format diffusers loads")
    p.add_argument("run", help="a run directory (runs/<name>)")
    p.add_argument(
        "--out", required=True, help="directory to write pytorch_lora_weights.safetensors"
    )
    p.add_argument("--adapter", default="", help="default | ema (default: what the run evaluates)")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("serve-reward", help="serve a registered scorer over HTTP (for 'http')")
    p.add_argument("--scorer", required=True, help="registered scorer name, e.g. shapes")
    p.add_argument("--host", default="127.0.0.1", help="non-loopback needs $DIFFRL_REWARD_TOKEN")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=256, help="most samples per request")
    p.add_argument(
        "--max-body-mb", type=_positive(float), default=64.0, help="largest request body"
    )
    p.add_argument(
        "--max-decoded-mb",
        type=_positive(float),
        help="most decoded media per request, from the PNG headers (default 256)",
    )
    p.add_argument(
        "--max-request-mpx",
        type=_positive(float),
        help="most pixels (images x size, video frames too) one request may have scored, in "
        "Mpx of 2^20 (default 32)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=_positive(float),
        help="a socket's request head must arrive within this (default 10)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=_positive(float),
        help="a request body must arrive within this of its head (default 60)",
    )
    p.add_argument(
        "--max-connections",
        type=_positive(int),
        help="most authenticated requests uploading or being scored at once; more wait in a "
        "queue (default 64)",
    )
    p.add_argument(
        "--max-queued", type=_positive(int), help="most requests waiting (default 256), 503 past"
    )
    p.add_argument(
        "--queue-timeout-s",
        type=_positive(float),
        help="a request waits at most this for its turn, then 503 (default 10)",
    )
    p.add_argument(
        "--max-idle-connections",
        type=_positive(int),
        help="most sockets without a request; past it the oldest is closed (default 512)",
    )
    p.add_argument(
        "--scorer-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scorer constructor param (repeatable)",
    )
    p.set_defaults(fn=cmd_serve_reward)
    args, extra = parser.parse_known_args(argv)
    _take_trailing(parser, args, extra)
    try:
        return args.fn(args)
    except (DiffrlError, OSError, ImportError) as e:
        refusal = _refusal(e, args.command)
        if refusal is None:
            raise
        print(f"diffrl: error: {refusal}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diffrl: interrupted; resume by running the same command again", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
