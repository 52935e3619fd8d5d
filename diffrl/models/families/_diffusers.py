"""Plumbing shared by the diffusers families (SD3, FLUX, Qwen-Image, Wan).

A diffusers family loads in one of two ways, and both end in the same classes:

- a local pipeline directory (``model_index.json`` plus one subfolder per component), read with
  each class's own ``from_pretrained(local_files_only=True)``; ``check_pipeline_dir`` names what
  is missing before anything loads;
- a preset: the same classes built from a config dict with random weights
  (``random_component``). Real-size presets are built on the ``meta`` device and materialised
  straight onto the target device, so a 12 B transformer never needs its weights in CPU RAM.

Tokenizers are never downloaded: ``word_tokenizer`` builds a word-level
``PreTrainedTokenizerFast`` with the special tokens a tokenizer kind needs (CLIP, T5, Qwen), and
``save_pipeline_dir`` writes tiny directories that load back through ``from_pretrained``.

``DiffusersNet`` is the base of every family's native network: the trainable transformer is its
one registered submodule (peft targets it), the frozen encoders and VAE live in a ``Shared``
(one copy per process), and ``conditions`` runs the text encoders once per prompt row.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from diffrl.errors import ConfigError
from diffrl.models.family import EncodeCache, Shared
from diffrl.models.words import read_words

# --- pipeline directories -------------------------------------------------------------------


# The projections of diffusers' joint (MMDiT-style) attention, image and text streams alike:
# the LoRA targets SD3, FLUX and Qwen-Image share; each family adds its own MLP names.
JOINT_ATTENTION_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


def _layout(components: dict[str, str]) -> str:
    lines = ["  model_index.json"] + [f"  {sub}/  ({what})" for sub, what in components.items()]
    return "\n".join(lines)


def check_pipeline_dir(
    path: str, family: str, components: dict[str, str], optional: tuple[str, ...] = ()
) -> Path:
    """The pipeline directory ``path`` as a Path, or a ConfigError naming what is missing and
    the whole layout the family expects (``components``: subfolder -> what it holds; those in
    ``optional`` are listed but may be absent)."""
    root = Path(path).expanduser()
    expected = (
        f"model family {family!r} expects a diffusers pipeline directory:\n{_layout(components)}"
    )
    if not root.is_dir():
        raise ConfigError(f"model.path {str(root)!r} is not a directory; {expected}")
    missing = [] if (root / "model_index.json").is_file() else ["model_index.json"]
    missing += [
        f"{sub}/" for sub in components if sub not in optional and not (root / sub).is_dir()
    ]
    if missing:
        raise missing_error(root, family, components, missing)
    return root


def missing_error(root: Path, family: str, components: dict[str, str], missing) -> ConfigError:
    """The ConfigError for a pipeline directory that lacks ``missing`` (names, "vae/", ...)."""
    return ConfigError(
        f"model.path {str(root)!r} lacks {', '.join(missing)}; model family {family!r} expects "
        f"a diffusers pipeline directory:\n{_layout(components)}"
    )


def _is_tokenizer(cls) -> bool:
    return "Tokenizer" in cls.__name__


def load_component(root: Path, subfolder: str, cls, dtype: torch.dtype, device: torch.device):
    """One component of a pipeline directory, through its class's own ``from_pretrained``
    (under ``components_on_meta``: its class built on ``meta`` from its ``config.json``)."""
    path = root / subfolder
    if _ON_META.get() is not None and not _is_tokenizer(cls):
        if cls.__module__.startswith("diffusers"):
            config = cls.load_config(str(path))
        else:
            config = cls.config_class.from_pretrained(str(path))
        return random_component(cls, config, dtype, device)
    try:
        if _is_tokenizer(cls):
            return cls.from_pretrained(str(path), local_files_only=True)
        key = "torch_dtype" if cls.__module__.startswith("diffusers") else "dtype"
        model = cls.from_pretrained(str(path), local_files_only=True, **{key: dtype})
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load {cls.__name__} from {path}: {e}") from e
    return model.to(device).eval()


def save_pipeline_dir(path: str | Path, components: dict[str, object], pipeline_class: str) -> Path:
    """Write ``components`` (subfolder -> model or tokenizer, or None) in the diffusers layout:
    each one's ``save_pretrained`` into its subfolder, plus ``model_index.json``."""
    import diffusers

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    index: dict[str, object] = {
        "_class_name": pipeline_class,
        "_diffusers_version": diffusers.__version__,
    }
    for sub, obj in components.items():
        if obj is None:
            index[sub] = [None, None]
            continue
        obj.save_pretrained(str(root / sub))
        index[sub] = [type(obj).__module__.split(".")[0], type(obj).__name__]
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root


# --- the load every diffusers family shares ----------------------------------------------------

# model.* keys where 0 = the family's default (height and width: only families whose settings
# have them render non-square frames)
SIZE_KEYS = ("resolution", "height", "width", "frames", "max_text_len")


def load_source(cfg, family: str, presets, from_dir, from_preset) -> tuple[dict, dict]:
    """The dispatch and defaults every diffusers family's ``load`` shares.

    ``from_dir(path, dtype)`` reads a local pipeline directory (``cfg.path``) and
    ``from_preset(name, dtype)`` builds a preset (``cfg.preset``, one of ``presets``) with
    random weights; each returns ``(parts, settings)``: the components, and the family's
    defaults (``resolution``, ``frames``, ``max_text_len``, and whatever else its ``build``
    takes). Anything else is a ConfigError naming both keys and the presets. Returns the parts
    and the settings, with the ``SIZE_KEYS`` the config sets (non-zero) taking precedence."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.path:
        parts, settings = from_dir(cfg.path, dtype)
    elif cfg.preset in presets:
        parts, settings = from_preset(cfg.preset, dtype)
    else:
        raise ConfigError(
            f"model family {family!r} needs model.path (a diffusers directory) or model.preset "
            f"(one of {sorted(presets)}); got preset {cfg.preset!r}"
        )
    for key in ("height", "width"):
        value = getattr(cfg, key, 0)
        if value and key not in settings:
            raise ConfigError(
                f"model.{key} = {value}: model family {family!r} renders square frames only; "
                "set model.resolution (and leave model.height/model.width 0)"
            )
    return parts, {k: (getattr(cfg, k) if k in SIZE_KEYS else 0) or v for k, v in settings.items()}


# --- random weights, built on the meta device -------------------------------------------------


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Parameters are created on ``meta`` (no memory, and their init is a no-op) while buffers
    (position ids, sin-cos tables) are computed for real: the same trick as accelerate's
    ``init_empty_weights(include_buffers=False)``, without needing accelerate."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _is_norm(module: nn.Module) -> bool:
    return (
        isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower()
    )


@torch.no_grad()
def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """In place: weights ~ N(0, std), biases 0, norm scales 1 (a plain, well-conditioned init
    for benchmarks and tests; the diffusers classes bring no init of their own).

    Host-memory weights are drawn on the GPU when there is one: the CPU generator is serial,
    and a 32 B text encoder kept on the host took minutes to fill there."""
    draw_on = torch.device("cuda") if torch.cuda.is_available() else None
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1 and _is_norm(module):
                p.fill_(1.0)
            elif p.device.type == "cpu" and draw_on is not None and p.numel() > 1 << 20:
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device=draw_on).normal_(0.0, std))
            else:
                p.normal_(0.0, std)


# Set by ``components_on_meta``: the ids of the components built there that the family asked
# for on the CPU (None = build for real)
_ON_META: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar(
    "diffrl_components_on_meta", default=None
)


@contextlib.contextmanager
def components_on_meta(host: set[int]) -> Iterator[None]:
    """Within the block, ``random_component`` and ``load_component`` build every model on the
    ``meta`` device: the real classes at the preset's or the directory's size, no memory (what
    ``diffrl plan`` counts). Tokenizers load for real (they are small). ``host`` collects the ids
    of the components the family asked for on the CPU (an offloaded encoder)."""
    token = _ON_META.set(host)
    try:
        yield
    finally:
        _ON_META.reset(token)


def _construct(cls, config) -> nn.Module:
    """``cls`` at ``config``'s size: a diffusers model through ``from_config``, a transformers
    model through its ``config_class`` (``config`` a dict, or already that config object)."""
    if hasattr(cls, "config_class") and not cls.__module__.startswith("diffusers"):
        return cls(config if not isinstance(config, dict) else cls.config_class(**config))
    return cls.from_config(config)


def _meta_component(cls, config, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        model = _construct(cls, config)
    return model.to(dtype=dtype).eval()


def random_component(cls, config: dict, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``cls`` at the size ``config`` says, with random weights, on ``device`` in ``dtype``
    (under ``components_on_meta``: on ``meta``, no weights).

    Works for diffusers models (``cls.from_config(config)``) and transformers models
    (``cls(cls.config_class(**config))``)."""
    host = _ON_META.get()
    if host is not None:
        model = _meta_component(cls, config, dtype)
        if torch.device(device).type == "cpu":
            host.add(id(model))
        return model
    with _params_on_meta():
        model = _construct(cls, config)
    buffers = dict(model.named_buffers())
    if any(p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype=dtype)  # free on meta
    model = model.to_empty(device=torch.device(device))
    for name, buf in buffers.items():  # to_empty wiped the real buffers: put them back
        owner, _, leaf = name.rpartition(".")
        cast = dtype if buf.is_floating_point() else buf.dtype
        model.get_submodule(owner)._buffers[leaf] = buf.to(device=device, dtype=cast)
    init_weights(model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- tokenizers -------------------------------------------------------------------------------

COMMON_WORDS = tuple(
    """
the of and to in is it that for on with as at by from this be are was an or not but all
one two three four five six seven eight nine ten many some few big small large tiny little
dog cat bird horse fish tree flower house car boat city street river mountain sky sun moon
star cloud rain snow sea beach forest field road window door table chair book cup bottle
man woman child people person face hand eye hair photo painting drawing picture image scene
style light dark bright black white gray brown orange purple pink gold silver wooden glass
standing sitting running flying under over near behind front next above below inside
""".split()  # noqa: SIM905
)


# the tiny presets' vocabulary: ShapesBench's words (so its prompts tokenize) and common ones
TINY_WORDS: tuple[str, ...] = tuple(sorted(set(read_words("shapes")) | set(COMMON_WORDS)))

# Words of Qwen-Image's prompt template (qwen_image.py), so the template itself tokenizes.
_QWEN_TEMPLATE = "system user assistant describe detailing color shape size texture quantity text "
QWEN_TEMPLATE_WORDS = tuple((_QWEN_TEMPLATE + "spatial relationships objects background").split())

_SPECIALS = {
    # kind -> (specials placed before the words, specials placed after, unk)
    # CLIP's bos/eos take the two highest ids as in the real vocabulary, so its pooled-output
    # rule (argmax of the ids, or first eos) finds the eos either way.
    "clip": (["[UNK]"], ["<|startoftext|>", "<|endoftext|>"], "[UNK]"),
    "t5": (["<pad>", "</s>", "<unk>"], [], "<unk>"),
    "qwen": (["[UNK]"], ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "[UNK]"),
}


def word_tokenizer(words, kind: str, max_len: int):
    """A word-level ``PreTrainedTokenizerFast`` over ``words`` with the special tokens of
    ``kind`` ("clip", "t5" or "qwen"): lowercased, split on whitespace and punctuation,
    unknown words -> the unk token. It round-trips through save_pretrained/AutoTokenizer."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    if kind not in _SPECIALS:
        raise ConfigError(f"tokenizer kind {kind!r}; known: {sorted(_SPECIALS)}")
    before, after, unk = _SPECIALS[kind]
    words = sorted(set(words) | (set(QWEN_TEMPLATE_WORDS) if kind == "qwen" else set()))
    vocab = {tok: i for i, tok in enumerate([*before, *words, *after])}
    tok = Tokenizer(WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([*before, *after])
    specials: dict[str, str] = {"unk_token": unk}
    if kind == "clip":
        bos, eos = after
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
        )
        specials |= {"bos_token": bos, "eos_token": eos, "pad_token": eos}
    elif kind == "t5":
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", vocab["</s>"])]
        )
        specials |= {"eos_token": "</s>", "pad_token": "<pad>"}
    else:  # qwen: no bos/eos added; the chat template is text the family writes around a prompt
        specials |= {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_len, **specials)


def tokenize_padded(tokenizer, texts: list[str], max_len: int) -> tuple[Tensor, Tensor]:
    """(B, max_len) int64 ids and (B, max_len) bool mask, padded and truncated to max_len."""
    enc = tokenizer(
        list(texts), padding="max_length", max_length=max_len, truncation=True, return_tensors="pt"
    )
    return enc["input_ids"].long(), enc["attention_mask"].bool()


# --- the native network -----------------------------------------------------------------------


class DiffusersNet(nn.Module):
    """Base of a diffusers family's native network: ``forward(x, t_native, input_ids)``.

    ``transformer`` is the one registered submodule (LoRA goes there; ``FamilyModel`` module
    names start with ``net.transformer.``). The frozen text encoders and VAE are in
    ``self.frozen`` (a ``Shared``: every copy of the model uses the same ones), and
    ``conditions`` encodes each distinct prompt row once (``EncodeCache``). Subclasses
    implement ``encode_uncached`` and ``forward``. Its ``input_ids`` stay on the host
    (``FamilyModel.ids_device``): they only key the cache and feed the encoders."""

    host_ids = True

    def __init__(self, transformer: nn.Module, **frozen) -> None:
        super().__init__()
        self.transformer = transformer
        self.frozen = Shared(**frozen)
        self.cache = EncodeCache()
        for m in self.frozen_modules():
            m.requires_grad_(False).eval()

    def frozen_modules(self) -> list[nn.Module]:
        return [m for m in vars(self.frozen).values() if isinstance(m, nn.Module)]

    def encode_uncached(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        """(b, L) ids -> a tuple of (b, ...) tensors (the transformer's text conditions)."""
        raise NotImplementedError

    def compute_device(self) -> torch.device:
        """Where this net computes: its transformer's device (an offloaded encoder is brought
        there to encode)."""
        return next(self.transformer.parameters()).device

    @torch.no_grad()
    def _encode(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        """The rows the cache misses, encoded on the compute device (the ids arrive from the
        host, see ``host_ids``)."""
        for m in self.frozen_modules():
            m.eval()
        return self.encode_uncached(input_ids.to(self.compute_device()))

    def conditions(self, input_ids: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
        """(B, L) ids -> the text conditions batched as (B, ...) tensors, in ``dtype``."""
        rows = self.cache.get(input_ids, self._encode)
        out = tuple(torch.stack(parts) for parts in zip(*rows, strict=True))
        return (
            out
            if dtype is None
            else tuple(t.to(dtype) if t.is_floating_point() else t for t in out)
        )


# --- causal video autoencoders ----------------------------------------------------------------

_VAE_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_VAE_LOCKS_GUARD = threading.Lock()


def vae_lock(vae: nn.Module) -> threading.Lock:
    """One lock per autoencoder. Wan's and Qwen-Image's causal VAEs keep a per-instance
    feature cache across the frames of one call (``clear_cache``, ``_feat_map``), so two
    threads decoding at once (the held-out eval beside the next step's prefetched rollout)
    mix each other's caches: hold this around every encode and decode."""
    with _VAE_LOCKS_GUARD:
        return _VAE_LOCKS.setdefault(vae, threading.Lock())
