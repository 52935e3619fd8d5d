"""``model.attention`` on every family's attention: the start-up equivalence check (fwd+bwd
against float64 SDPA math) at real-size head counts, head dims and sequence lengths, the kernels
each backend ran, and forward / forward+backward time per backend, all in one process (so the
times compare). Then the switch end to end: each family's tiny preset loaded with each backend
(the route into the real processors, the check on the captured calls, the record line).

    python benchmarks/attention_backends.py --out $OUT/attention.jsonl     # one GPU, bf16
    python benchmarks/attention_backends.py --smoke                        # CPU, about a minute

flex runs eager unless --compile-flex (eager flex materializes the scores: slow, and it may not
fit at Wan's 18,900 rows, which the row then says).

One JSON row per (case, backend) on stdout (and in --out). A backend that cannot run says why
in its row (package missing, no CUDA, a mask it cannot take, a failed backward, an error past
the bound). Geometry, batch 1, from the families' real presets (heads x head dim):

- tiny_dit: 4 x 32, 12 text + 64 image rows, a key mask over padded text (direct SDPA)
- sd3 (sd35-medium, 512 px, 333 text rows): joint 24 x 64 over 1,024 + 333 rows; the dual
  attention over the 1,024 image rows (JointAttnProcessor2_0: direct SDPA)
- flux (flux1-dev, 1,024 px, 512 text): joint 24 x 128 over 4,096 + 512 rows (dispatcher)
- qwen_image (1,024 px): joint 24 x 128 over 4,096 + 256 text rows, 56 of them padding masked
- wan (wan2.1-1.3b, 81 frames at 480 px): self 12 x 128 over 18,900 rows; cross to 512 text
- ltx2 (121 frames at 512 x 768: 6,144 video rows, 126 audio rows): video self 32 x 128,
  audio self 32 x 64, audio-to-video and video-to-audio cross 32 x 64, video-to-text cross
  32 x 128 with an additive mask over 1,024 text rows (256 padded)
- minimax_h3 (minimax-h3): the 5,144-row packed sequence, 56 x 128, alone and as two samples
  of 2,572 rows packed with a block-diagonal mask (how batched requests share a forward)
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass

import torch

from diffrl.errors import ConfigError
from diffrl.models import attention as attn

BACKENDS = ("sdpa", "math", "flash", "efficient", "cudnn", "flex", "flash3", "flash4")
PRESETS = ("sd35-tiny", "flux1-tiny", "qwen-image-tiny", "wan-tiny", "ltx2-tiny", "h3-tiny")


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    kind: str  # "sdpa": a direct SDPA call site; "dispatch": diffusers' dispatcher
    heads: int
    dim: int
    q_rows: int
    kv_rows: int
    mask: str = ""  # "" | "keys" (bool, padded keys) | "additive" (float over keys) | "packed"
    padded: int = 0  # masked key rows (keys, additive); "packed": the rows of the first sample


CASES = (
    Case("tiny_dit", "joint", "sdpa", 4, 32, 76, 76, "keys", 6),
    Case("sd3", "joint", "sdpa", 24, 64, 1357, 1357),
    Case("sd3", "dual", "sdpa", 24, 64, 1024, 1024),
    Case("flux", "joint", "dispatch", 24, 128, 4608, 4608),
    Case("qwen_image", "joint", "dispatch", 24, 128, 4352, 4352, "keys", 56),
    Case("wan", "self", "dispatch", 12, 128, 18900, 18900),
    Case("wan", "cross", "dispatch", 12, 128, 18900, 512),
    Case("ltx2", "video-self", "dispatch", 32, 128, 6144, 6144),
    Case("ltx2", "audio-self", "dispatch", 32, 64, 126, 126),
    Case("ltx2", "a2v-cross", "dispatch", 32, 64, 6144, 126),
    Case("ltx2", "v2a-cross", "dispatch", 32, 64, 126, 6144),
    Case("ltx2", "text-cross", "dispatch", 32, 128, 6144, 1024, "additive", 256),
    Case("minimax_h3", "packed", "dispatch", 56, 128, 5144, 5144),
    Case("minimax_h3", "packed-2", "dispatch", 56, 128, 5144, 5144, "packed", 2572),
)


def shrink(case: Case) -> Case:
    """The --smoke geometry: 2 heads, about 1/32 of the rows (masks kept in proportion)."""

    def rows(n: int) -> int:
        return max(8, n // 32)

    q, kv = rows(case.q_rows), rows(case.kv_rows)
    # masked rows in proportion, at least one and never all of them
    padded = min(kv - 1, max(1, case.padded * kv // case.kv_rows)) if case.padded else 0
    return Case(case.family, case.name, case.kind, 2, min(case.dim, 32), q, kv, case.mask, padded)


def make_call(case: Case, heads: int, device: torch.device) -> attn.Call:
    """One call of ``case`` with ``heads`` heads, in its call site's layout. q and k have twice
    unit scale, so the logits spread (std 4) and the softmax is far from flat, as in QK-normed
    DiT attention; v is unit scale."""
    g = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (1, case.q_rows, heads, case.dim), (1, case.kv_rows, heads, case.dim)
    q = torch.randn(shape_q, generator=g) * 2
    k, v = torch.randn(shape_kv, generator=g) * 2, torch.randn(shape_kv, generator=g)
    mask = None
    if case.mask == "keys":
        mask = torch.ones(1, 1, 1, case.kv_rows, dtype=torch.bool)
        mask[..., case.kv_rows - case.padded :] = False  # padded text (where does not matter)
    elif case.mask == "additive":
        mask = torch.zeros(1, 1, 1, case.kv_rows)
        mask[..., case.kv_rows - case.padded :] = -10000.0
    elif case.mask == "packed":
        seg = torch.arange(case.q_rows) >= case.padded  # two samples, block-diagonal
        mask = (seg[:, None] == seg[None, :])[None, None]
    if case.kind == "sdpa":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kw = {} if mask is None else {"attn_mask": mask.to(device)}
    return attn.Call(case.kind, q.to(device), k.to(device), v.to(device), kw)


def time_backend(
    call: attn.Call, backend: str, dtype: torch.dtype, repeats: int, compiled: bool = False
) -> dict:
    """Median milliseconds of one forward, and of forward+backward, at full heads. ``compiled``:
    the call under ``torch.compile`` (flex is fused only so, as in compiled blocks)."""
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (call.q, call.k, call.v))
    mask = call.kwargs.get("attn_mask")
    kw = dict(call.kwargs)
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        kw["attn_mask"] = mask.to(dtype)
    timed = attn.Call(call.kind, q, k, v, kw)

    def run(q, k, v):
        return attn._run(timed, backend, q, k, v)

    if compiled:
        run = torch.compile(run)
    with torch.no_grad():
        run(q, k, v)  # warm-up (and compile)
        fwd = attn.timed(lambda: run(q, k, v), repeats)
    grad = torch.ones_like(run(q, k, v))

    def step() -> None:
        run(q, k, v).backward(grad)

    step()
    suffix = "_compiled" if compiled else ""
    return {
        f"fwd_ms{suffix}": round(fwd * 1e3, 3),
        f"fwd_bwd_ms{suffix}": round(attn.timed(step, repeats) * 1e3, 3),
    }


def flops(case: Case, heads: int) -> float:
    """Attention matmul FLOPs of one forward (QK^T and PV), unmasked count."""
    return 4.0 * heads * case.q_rows * case.kv_rows * case.dim


def run_case(case: Case, backend: str, dtype: torch.dtype, dev: torch.device, args) -> dict:
    row: dict = dict(family=case.family, case=case.name, backend=backend, heads=case.heads)
    row.update(dim=case.dim, q_rows=case.q_rows, kv_rows=case.kv_rows, mask=case.mask or "none")
    row["dtype"] = str(dtype)[6:]
    why = attn.availability(backend, dev)
    if why:
        return {**row, "skipped": why}
    backward = not (backend == "flex" and dev.type == "cpu")  # flex has no CPU backward
    check_call = make_call(case, min(case.heads, args.check_heads), dev)
    try:
        (check,) = attn.check_calls([check_call], backend, dtype, backward=backward)
        row.update(error=check.error, math_error=check.math_error, bound=attn.BOUNDS[dtype],
                   checked="fwd+bwd" if backward else "fwd")  # fmt: skip
        if backward:
            row["kernels"] = attn.kernels_used([check_call], backend, dtype)
    except ConfigError as e:
        return {**row, "refused": str(e)}
    if args.no_timing or not backward:
        return row
    f = flops(case, case.heads)  # backward: 2.5x the forward's matmuls
    for compiled in (False, True) if backend == "flex" and args.compile_flex else (False,):
        sfx = "_compiled" if compiled else ""
        try:
            t = time_backend(
                make_call(case, case.heads, dev), backend, dtype, args.repeats, compiled
            )
        except Exception as e:  # noqa: BLE001 - an OOM or a kernel limit is the row's result
            row[f"timing_error{sfx}"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            torch.cuda.empty_cache() if dev.type == "cuda" else None
            continue
        row.update(t)
        row[f"fwd_tflops{sfx}"] = round(f / t[f"fwd_ms{sfx}"] / 1e9, 1)
        row[f"fwd_bwd_tflops{sfx}"] = round(3.5 * f / t[f"fwd_bwd_ms{sfx}"] / 1e9, 1)
    return row


def run_presets(backends: tuple[str, ...], dtype: str, dev: torch.device) -> list[dict]:
    """Each tiny preset loaded with each backend: the switch through the real processors."""
    from diffrl.models.registry import ModelConfig, load_model

    rows = []
    for preset in PRESETS:
        for backend in (*backends, "auto"):
            row: dict = {"preset": preset, "backend": backend, "dtype": dtype}
            try:
                model = load_model(ModelConfig(preset=preset, dtype=dtype, attention=backend), dev)
                row["record"] = model.attention_record.line()
            except ConfigError as e:
                row["refused"] = str(e)
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, shrunk geometry, float32")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--families", nargs="+", default=None, help="default: every family")
    p.add_argument("--check-heads", type=int, default=2, help="heads in the float64 check")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument(
        "--compile-flex",
        action="store_true",
        help="also time flex under torch.compile (fused; a compile per case: minutes)",
    )
    p.add_argument("--no-presets", action="store_true", help="skip the tiny presets' loads")
    p.add_argument("--out", default="", help="also write the rows here (JSON lines)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    if args.smoke:
        args.repeats = 2
    cases = [shrink(c) if args.smoke else c for c in CASES]
    if args.families:
        cases = [c for c in cases if c.family in args.families]
    meta = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype)[6:]}  # fmt: skip
    rows = [meta]
    print(json.dumps(meta), flush=True)
    t0 = time.perf_counter()
    for case in cases:
        for backend in args.backends:
            rows.append(run_case(case, backend, dtype, dev, args))
            print(json.dumps(rows[-1]), flush=True)
    if not args.no_presets:
        for row in run_presets(tuple(args.backends), str(dtype)[6:], dev):
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
