"""Attention backends behind one switch, ``model.attention``, checked against SDPA math at
start-up and recorded.

Where the switch reaches a family's attention (diffusers 0.42.1):

- **Through diffusers' dispatcher** (``dispatch_attention_fn``): FLUX, Wan, LTX-2 (its video,
  audio and cross-stream attentions), Qwen-Image (its joint two-stream processor, also behind
  diffrl's ``FusedQKVProcessor``) and MiniMax-H3 (the packed sequence and its mask). Their
  processors carry ``_attention_backend``, set here per processor (not through
  ``set_attention_backend``, which also changes diffusers' process-wide active backend).
- **Calling ``F.scaled_dot_product_attention`` directly**: SD3's ``JointAttnProcessor2_0``
  (joint and dual attention) and the tiny DiT. SD3's processors are wrapped in
  :class:`RoutedProcessor`, the tiny DiT's ``Attention`` reads ``attention_backend``; both run
  the call under :func:`routed`: ``sdpa_kernel`` for PyTorch's own kernels, a redirect of that
  one call to diffusers' backend for ``flex``, ``flash3``, ``flash4``. The choice lives at the
  call site, so activation recompute in the backward picks the same kernel as the forward.

Any other attention module that calls SDPA its own way makes a non-default choice an error
(``unrouted``), never a silent partial switch. diffrl's own Ulysses SP attention
(``parallel/sp.py``) and reward models keep PyTorch's choice.

The start-up check (:func:`setup_attention`, from ``load_model``) runs the model once on the
empty prompt and a short one (rows of different text lengths, so padding masks appear), captures
each distinct attention call (its real shapes, masks, scale; at most ``CHECK_HEADS`` heads,
which are independent), and runs each through the chosen backend forward and backward against
SDPA math in float64. The largest error, relative to the reference's largest magnitude, must
stay under ``BOUNDS[dtype]``; it is logged beside SDPA math's own error in that dtype (the
yardstick). A profile of the same calls names the kernels that ran (on the GPU the CUDA kernels
too: what SDPA picked when ``auto`` resolves to ``sdpa``). The default ``sdpa`` runs none of
this (:func:`setup_attention` says why).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from diffrl.errors import CONTRACTS_LOG, ConfigError
from diffrl.models.family import transformer_root

# model.attention values. "sdpa" (the default) changes nothing: PyTorch picks per call.
SDPA_KERNELS: dict[str, SDPBackend] = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,  # PyTorch's built-in FA2 (flash-cpu on the CPU)
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
# the name each choice has in diffusers' dispatcher (AttentionBackendName values)
DIFFUSERS_NAME: dict[str, str] = {
    "math": "_native_math",
    "flash": "_native_flash",
    "efficient": "_native_efficient",
    "cudnn": "_native_cudnn",
    "flex": "flex",
    "flash3": "_flash_3",
    # diffusers 0.42.1 has FA4 only as a Hub kernel; diffrl hands its wrapper the installed
    # flash-attn-4 wheel's function instead of a download (the GPU machines reach no Hub)
    "flash4": "flash_4_hub",
}
CHOICES = ("sdpa", *SDPA_KERNELS, "flex", "flash3", "flash4", "auto")
CUDA_ONLY = ("efficient", "cudnn", "flash3", "flash4")
# auto, per device: the first that is installed and passes the check (flash3/flash4 take no
# mask, so a masked family falls through to cuDNN, then to PyTorch's own choice)
AUTO_ORDER = {"cuda": ("flash4", "flash3", "cudnn", "sdpa"), "cpu": ("sdpa",)}
# module a package choice needs -> how to install it (one line)
PACKAGES: dict[str, tuple[str, str]] = {
    "flash3": (
        "flash_attn_interface",
        "FlashAttention-3 (module flash_attn_interface, not installed here): build it from "
        "https://github.com/Dao-AILab/flash-attention/tree/main/hopper (cd hopper && "
        "python setup.py install)",
    ),
    "flash4": (
        "flash_attn.cute",
        "FlashAttention-4 (module flash_attn.cute, not installed here): pip install flash-attn-4",
    ),
}
# largest |out - ref| / max|ref| (outputs and q/k/v gradients) against float64 SDPA math
BOUNDS: dict[torch.dtype, float] = {
    torch.float32: 1e-3,  # allows TF32-class kernels; exact kernels land near 1e-6
    torch.bfloat16: 3e-2,  # bf16 keeps 8 bits: SDPA math itself lands near 5e-3
    torch.float16: 5e-3,
}
CHECK_HEADS = 4
MAX_CALLS = 8  # distinct attention signatures checked per model
# the capture's second row (the first is the empty prompt): rows of different text lengths in
# one batch are what make the families' padding masks appear. ShapesBench words, so that the
# tiny models' word tokenizers take it too
PROBE_PROMPT = "two blue squares"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def availability(choice: str, device: torch.device) -> str:
    """Why ``choice`` cannot run on ``device`` ("" when it can): its package, then the device."""
    if choice in PACKAGES and not _installed(PACKAGES[choice][0]):
        return PACKAGES[choice][1]
    if choice == "flash3":  # diffusers looks for the distribution too, not only the module
        from diffusers.models import attention_dispatch

        if not attention_dispatch._CAN_USE_FLASH_ATTN_3:
            return (
                "FlashAttention-3 as diffusers finds it (module flash_attn_interface is here, "
                "the flash_attn_3 distribution is not): reinstall it from flash-attention's hopper/"
            )
    if choice in CUDA_ONLY and device.type != "cuda":
        return f"a CUDA device (this model is on {device.type})"
    return ""


def require(choice: str, device: torch.device) -> None:
    missing = availability(choice, device)
    if missing:
        raise ConfigError(
            f"config key 'model.attention' = {choice!r} needs {missing}; "
            "sdpa, math and flash run on every device"
        )


# --- the route: one call site under a choice -------------------------------------------------


class _Redirect(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` to a diffusers backend; every other op passes
    through. Active only inside one attention call site (a mode is off while its own handler
    runs, so the backend's own SDPA call is not redirected again)."""

    def __init__(self, choice: str) -> None:
        super().__init__()
        self.choice = choice

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return dispatch_sdpa(self.choice, *args, **kwargs)
        return func(*args, **kwargs)


def dispatch_sdpa(
    choice: str,
    query: Tensor,  # (B, H, S_q, D): SDPA's layout
    key: Tensor,  # (B, H, S_kv, D)
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:  # (B, H, S_q, D)
    """An SDPA call answered by diffusers' backend for ``choice`` (which takes (B, S, H, D))."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    out = dispatch_attention_fn(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, backend=_diffusers_backend(choice),
    )  # fmt: skip
    return out.transpose(1, 2)


def routed(choice: str) -> contextlib.AbstractContextManager:
    """The context one direct SDPA call site runs under for ``choice``."""
    if choice == "sdpa":
        return contextlib.nullcontext()
    if choice in SDPA_KERNELS:
        return sdpa_kernel([SDPA_KERNELS[choice]])
    return _Redirect(choice)


class RoutedProcessor:
    """A diffusers attention processor that calls SDPA directly (SD3's ``JointAttnProcessor2_0``),
    run under :func:`routed`. Its ``__call__`` keeps the wrapped one's parameters: diffusers'
    ``Attention.forward`` passes a processor only the keyword arguments its signature names."""

    def __init__(self, inner, choice: str) -> None:
        self.inner = inner
        self.choice = choice

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 *args, **kwargs):  # fmt: skip
        with routed(self.choice):
            return self.inner(
                attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs
            )


# processors known to call F.scaled_dot_product_attention directly, with the signature above
# (AttnProcessor2_0 takes temb besides: none of the families has one; it stays unrouted)
DIRECT_PROCESSORS = ("JointAttnProcessor2_0",)


def _diffusers_backend(choice: str):
    from diffusers.models.attention_dispatch import AttentionBackendName

    name = AttentionBackendName(DIFFUSERS_NAME[choice])
    if choice == "flash4":
        _install_flash4()
    return name


def _install_flash4() -> None:
    """diffusers' FA4 wrapper calls the kernel its Hub registry holds; give it the wheel's."""
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    entry = _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB]
    if entry.kernel_fn is None:
        from flash_attn.cute import flash_attn_func

        entry.kernel_fn = flash_attn_func


@dataclass
class Route:
    dispatch: int = 0  # processors of diffusers' dispatcher given the backend
    direct: int = 0  # direct SDPA call sites put under routed()
    unrouted: list[str] = field(default_factory=list)  # attention modules the switch misses

    def describe(self) -> str:
        parts = []
        if self.dispatch:
            parts.append(f"{self.dispatch} dispatcher processors")
        if self.direct:
            parts.append(f"{self.direct} direct SDPA call sites")
        return " + ".join(parts) or "no attention modules"


def apply(model: torch.nn.Module, choice: str, change: bool = True) -> Route:
    """Put every attention call site of the transformer of ``model`` (a ``FamilyModel``) under
    ``choice``, in place; ``sdpa`` restores PyTorch's own choice. The text encoders and the VAE
    keep theirs. ``change=False`` only says where it would reach. Returns where it reached."""
    route = Route()
    for name, module in transformer_root(model).named_modules():
        if isinstance(getattr(module, "attention_backend", None), str):  # the tiny DiT's own
            if change:
                module.attention_backend = choice
            route.direct += 1
            continue
        processor = getattr(module, "processor", None)
        if processor is None or not callable(processor):
            continue
        if isinstance(processor, RoutedProcessor):
            if change:
                processor.choice = choice
            route.direct += 1
        elif hasattr(processor, "_attention_backend"):
            if change:
                backend = None if choice == "sdpa" else _diffusers_backend(choice)
                processor._attention_backend = backend
            route.dispatch += 1
        elif type(processor).__name__ in DIRECT_PROCESSORS:
            if change and choice != "sdpa":
                module.processor = RoutedProcessor(processor, choice)
            route.direct += 1
        else:
            route.unrouted.append(f"{name} ({type(processor).__name__})")
    return route


# --- the start-up check --------------------------------------------------------------------


@dataclass
class Call:
    """One captured attention call: ``kind`` "sdpa" (SDPA's layout, (B, H, S, D)) or
    "dispatch" (diffusers' dispatcher, (B, S, H, D)); tensors cut to a few heads."""

    kind: str
    q: Tensor
    k: Tensor
    v: Tensor
    kwargs: dict  # attn_mask, scale, is_causal, ... as the call passed them

    def signature(self) -> str:
        mask = self.kwargs.get("attn_mask")
        m = "none" if mask is None else f"{tuple(mask.shape)} {str(mask.dtype)[6:]}"
        return f"{self.kind} q{tuple(self.q.shape)} k{tuple(self.k.shape)} mask {m}"


def _cut(t, heads_dim: int):
    """At most CHECK_HEADS heads of a q/k/v or mask (size-1 dims stay), detached."""
    if not isinstance(t, Tensor) or t.ndim < 3:
        return t.detach().clone() if isinstance(t, Tensor) else t
    if t.ndim == 4 and t.shape[heads_dim] > CHECK_HEADS:
        t = t.narrow(heads_dim, 0, CHECK_HEADS)
    return t.detach().clone()


class _Capture(TorchFunctionMode):
    """Records the SDPA calls made inside the transformer (``inside`` is set by hooks on it: the
    text encoders' attention is not the switch's business)."""

    def __init__(self, calls: dict[str, Call]) -> None:
        super().__init__()
        self.calls = calls
        self.inside = False
        self.inside_dispatch = False

    def add(self, call: Call) -> None:
        if self.inside and len(self.calls) < MAX_CALLS:
            self.calls.setdefault(call.signature(), call)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.inside_dispatch:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            q, k, v = (_cut(bound.pop(n), 1) for n in ("query", "key", "value"))
            bound["attn_mask"] = _cut(bound.get("attn_mask"), 1)
            self.add(Call("sdpa", q, k, v, bound))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _capturing(calls: dict[str, Call], root: torch.nn.Module) -> Iterator[None]:
    """Record the attention calls that ``root`` makes while the block runs: direct SDPA calls,
    and the calls that reach diffusers' active backend (wrapped for the duration)."""
    mode = _Capture(calls)
    hooks = [
        root.register_forward_pre_hook(lambda *_: setattr(mode, "inside", True)),
        root.register_forward_hook(lambda *_: setattr(mode, "inside", False), always_call=True),
    ]
    try:
        with _recording(mode):
            yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def _recording(mode: _Capture) -> Iterator[None]:
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry
    except ImportError:  # the tiny DiT without diffusers: direct SDPA calls only
        registry = None
    if registry is None:
        with mode:
            yield
        return
    name = registry._active_backend
    native = registry._backends[name]

    def recording(query, key, value, **kw):
        cut = {k: (_cut(v, 2) if k == "attn_mask" else v) for k, v in kw.items()}
        mode.add(Call("dispatch", _cut(query, 2), _cut(key, 2), _cut(value, 2), cut))
        mode.inside_dispatch = True
        try:
            return native(query=query, key=key, value=value, **kw)
        finally:
            mode.inside_dispatch = False

    registry._backends[name] = recording
    try:
        with mode:
            yield
    finally:
        registry._backends[name] = native


def capture_calls(model: torch.nn.Module) -> list[Call]:
    """The distinct attention calls of one forward of ``model`` (a ``FamilyModel``) on two rows,
    the empty prompt and ``PROBE_PROMPT``, at sigma 0.5, under the routes in place (PyTorch's
    and diffusers' defaults when run before :func:`apply`). Draws from its own generator: the
    run's random stream is untouched."""
    param = next(model.parameters())
    fam = model.family
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, *fam.latent_shape(), generator=gen).to(param.device)
    ids = torch.stack([fam.null_ids(), fam.tokenize([PROBE_PROMPT]).input_ids[0]])
    calls: dict[str, Call] = {}
    with torch.no_grad(), _capturing(calls, transformer_root(model)):
        model(x, torch.full((2,), 0.5, device=param.device), ids.to(model.ids_device(param.device)))
    return list(calls.values())


def _run(call: Call, choice: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    kw = dict(call.kwargs)
    if call.kind == "sdpa":
        if choice in ("flex", "flash3", "flash4"):
            return dispatch_sdpa(choice, q, k, v, **kw)
        with routed(choice):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    backend = None if choice == "sdpa" else _diffusers_backend(choice)
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    return dispatch_attention_fn(q, k, v, **{n: kw[n] for n in names if n in kw}, backend=backend)


def _fwd_bwd(call: Call, choice: str, dtype: torch.dtype, grad: Tensor | None) -> list[Tensor]:
    """Output and (unless ``grad`` is None) q, k, v gradients of ``call`` under ``choice`` in
    ``dtype``."""
    need = grad is not None
    q, k, v = (t.to(dtype, copy=True).requires_grad_(need) for t in (call.q, call.k, call.v))
    mask = call.kwargs.get("attn_mask")
    saved = call.kwargs
    if isinstance(mask, Tensor) and mask.is_floating_point():
        call.kwargs = {**saved, "attn_mask": mask.to(dtype)}
    try:
        out = _run(call, choice, q, k, v)
    finally:
        call.kwargs = saved
    if grad is None:
        return [out.detach()]
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(t.grad for t in (q, k, v))]


def _rel(got: list[Tensor], ref: list[Tensor]) -> float:
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        r = r.double()
        scale = r.abs().max().clamp_min(1e-12)
        worst = max(worst, ((g.double() - r).abs().max() / scale).item())
    return worst


@dataclass
class CallCheck:
    signature: str
    error: float  # choice vs float64 math, outputs and gradients
    math_error: float  # SDPA math in the model's dtype vs float64 math: the yardstick


def check_calls(
    calls: list[Call], choice: str, dtype: torch.dtype, backward: bool = True
) -> list[CallCheck]:
    """Each call forward (and backward) under ``choice`` against float64 SDPA math; raises
    ``ConfigError`` naming the call, the error and the bound when one exceeds ``BOUNDS``, or
    when the kernel fails (cuDNN's backward on torch 2.11, flex's backward on the CPU)."""
    bound = BOUNDS[dtype]
    out = []
    for call in calls:
        gen = torch.Generator().manual_seed(1)
        probe = torch.randn(call.q.shape[:-1] + call.v.shape[-1:], generator=gen)
        grad = probe.to(call.q.device)
        grad = grad if backward else None
        ref = _fwd_bwd(call, "math", torch.float64, grad)
        own = _fwd_bwd(call, "math", dtype, grad)
        passes = "forward+backward" if backward else "forward"
        try:
            got = _fwd_bwd(call, choice, dtype, grad)
        except Exception as e:  # noqa: BLE001 - any kernel failure is the refusal below
            raise ConfigError(
                f"config key 'model.attention' = {choice!r} fails on this model's attention "
                f"({call.signature()}, {str(dtype)[6:]}, {passes}): "
                f"{type(e).__name__}: {' '.join(str(e).split())[:300]}; "
                "model.attention=sdpa (PyTorch's own choice) is the fallback"
            ) from None
        err = _rel(got, ref)
        if not err <= bound:  # NaN fails too
            raise ConfigError(
                f"config key 'model.attention' = {choice!r}: error {err:.2e} against SDPA math "
                f"on {call.signature()} exceeds the {str(dtype)[6:]} bound {bound:.0e} (SDPA "
                f"math itself: {_rel(own, ref):.2e}); model.attention=sdpa is the fallback"
            )
        out.append(CallCheck(call.signature(), err, _rel(own, ref)))
    return out


KERNEL_WORDS = ("attention", "attn", "fmha", "flash", "cudnn", "flex", "sdpa", "triton_tem")


def attention_ops(fn: Callable[[], object], cuda: bool = False) -> list[str]:
    """The attention ops (``aten::_scaled_dot_product_*``, flex) that ``fn`` runs, forward and
    backward, and with ``cuda`` the device kernels: read from a profile (math decomposes below
    autograd, so only the profiler's op records name it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    names = set()
    for ev in prof.events():
        name, low = ev.name, ev.name.lower()
        if not any(w in low for w in KERNEL_WORDS):
            continue
        op = (name.startswith("aten::_") and "attention" in low) or "flex_attention" in low
        if op or (cuda and ev.device_type.name == "CUDA"):
            names.add(name if len(name) <= 80 else name[:77] + "...")
    return sorted(names)


def kernels_used(calls: list[Call], choice: str, dtype: torch.dtype) -> list[str]:
    """What ``choice`` ran on ``calls``, forward and backward (:func:`attention_ops`): where
    SDPA picks its own kernel, this is what it picked."""

    def run() -> None:
        for call in calls:
            grad = torch.ones(call.q.shape[:-1] + call.v.shape[-1:], device=call.q.device)
            _fwd_bwd(call, choice, dtype, grad)

    return attention_ops(run, cuda=bool(calls) and calls[0].q.device.type == "cuda")


@dataclass
class AttentionRecord:
    """What ``model.attention`` did on one model: logged at start-up, kept on the model."""

    requested: str
    used: str
    device: str
    dtype: str
    route: str
    kernels: list[str]
    checks: list[CallCheck]
    skipped: list[str] = field(default_factory=list)  # auto: candidates passed over, and why
    seconds: float = 0.0

    def line(self) -> str:
        worst = max((c.error for c in self.checks), default=float("nan"))
        yard = max((c.math_error for c in self.checks), default=float("nan"))
        bound = BOUNDS[getattr(torch, self.dtype)]
        head = f"model.attention={self.requested}"
        if self.requested != self.used:
            head += f" -> {self.used}"
        text = f"{head} on {self.device} ({self.dtype}), via {self.route}: "
        if self.checks:
            text += (
                f"{len(self.checks)} attention call kinds fwd+bwd within {worst:.1e} of SDPA math "
                f"(bound {bound:.0e}; math itself {yard:.1e}) in {self.seconds:.2f} s; "
            )
        text += "kernels: " + (", ".join(self.kernels) or "not profiled")
        if self.skipped:
            text += "; passed over: " + "; ".join(self.skipped)
        return text


_CHECKED: dict[tuple, tuple[list[CallCheck], list[str]]] = {}


def setup_attention(model: torch.nn.Module, choice: str) -> AttentionRecord:
    """Apply ``model.attention`` to a loaded ``FamilyModel`` after checking it on the model's own
    attention calls (see the module docstring); returns the record (also logged, and kept as
    ``model.attention_record``).

    The default ``sdpa`` changes nothing and runs nothing: no forward at load (under
    ``parallel.etp`` the text encoder must not run before it is sharded), so the kernel PyTorch
    picks is not profiled there; ``auto`` and ``benchmarks/attention_backends.py`` profile it.
    Any other choice runs one forward (two rows: the empty prompt and a short one) at load.
    Checks are cached per process by family, device, dtype, choice and call signatures: a
    second load repeats none."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    record = AttentionRecord(choice, choice, str(device), str(dtype)[6:], "", [], [])
    if choice == "sdpa":
        record.route = apply(model, "sdpa", change=False).describe()
        record.kernels = [
            "PyTorch's choice per call, not profiled"
            + (" (on the CPU: its flash-cpu kernel or math)" if device.type == "cpu" else "")
        ]
        return _log(model, record)
    start = time.perf_counter()
    if choice != "auto":
        require(choice, device)
    apply(model, "sdpa")  # capture the calls as PyTorch's default makes them
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        calls = capture_calls(model)
    candidates = AUTO_ORDER["cuda" if device.type == "cuda" else "cpu"]
    for candidate in candidates if choice == "auto" else (choice,):
        missing = availability(candidate, device)
        if missing:
            record.skipped.append(f"{candidate} needs {missing.split(' (')[0]}")
            continue
        route = apply(model, candidate)
        if route.unrouted and candidate != "sdpa":
            apply(model, "sdpa")
            raise ConfigError(
                f"config key 'model.attention' = {candidate!r} cannot reach "
                f"{len(route.unrouted)} attention module(s) that call SDPA their own way "
                f"({route.unrouted[0]}, ...); use model.attention=sdpa"
            )
        sig = tuple(c.signature() for c in calls)
        key = (model.family.name, str(device), dtype, candidate, sig)
        try:
            if key not in _CHECKED:
                checks = check_calls(calls, candidate, dtype)
                _CHECKED[key] = (checks, kernels_used(calls, candidate, dtype))
        except ConfigError as e:
            apply(model, "sdpa")
            if choice != "auto":
                raise
            record.skipped.append(f"{candidate}: {str(e).split(': ', 1)[-1][:160]}")
            continue
        record.checks, record.kernels = _CHECKED[key]
        record.used, record.route = candidate, route.describe()
        break
    record.seconds = time.perf_counter() - start
    return _log(model, record)


def _log(model: torch.nn.Module, record: AttentionRecord) -> AttentionRecord:
    logging.getLogger(CONTRACTS_LOG).info("%s", record.line())
    model.attention_record = record  # what ran, for benchmarks and tests
    return record


def timed(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall seconds of ``fn`` (synchronised on CUDA): for the benchmark script."""
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
