"""Model-based scorers on tiny random checkpoints built and saved here (no download anywhere):
CLIPScore/PickScore, CLAP, the ImageBind-style AV scorer, OCR and JPEG size.

Each model scorer is checked for shape, finiteness, validity, determinism, agreement with the
model's own forward pass, and a clear error when its local path is missing.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig
from diffrl.reward.scorer import ScoreResult
from diffrl.reward.scorers import build_scorer, registered_scorers
from diffrl.reward.scorers.ocr import levenshtein, ocr_similarity, quoted_text

MODEL_SCORERS = (
    "clip_score",
    "pickscore",
    "clap",
    "imagebind",
    "imagebind_av",
    "ocr",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "vlm_judge",
)


def run(scorer, traj) -> ScoreResult:
    return asyncio.run(scorer.score(traj))


def byte_alphabet() -> list[str]:
    """256 printable stand-ins, one per byte value: the base alphabet a byte-level BPE needs
    so that any text tokenizes (printable Latin-1 bytes map to themselves, the rest to code
    points from 256 up)."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, shift = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shift))
            shift += 1
    return out


def bpe_files(folder: Path, vocab: dict[str, int]) -> tuple[str, str]:
    """vocab.json and an empty merges.txt: a BPE that never merges, i.e. one token per byte.
    Files (not dicts) so the tokenizer constructors of transformers 4.x and 5.x both take them."""
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return str(folder / "vocab.json"), str(folder / "merges.txt")


# the size of every tiny transformer stack below (CLIP text and vision towers, CLAP text)
TINY_LAYERS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def save_tiny(factory: pytest.TempPathFactory, name: str, model_cls, cfg, processor) -> Path:
    """Build a randomly initialised model (seed 0) and save it with its processor to a fresh
    folder, the way a real checkpoint sits on disk; returns the folder."""
    torch.manual_seed(0)
    path = factory.mktemp(name)
    model_cls(cfg).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def images(n: int, h: int = 40, w: int = 48, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, h, w, 3), generator=g, dtype=torch.uint8)


def test_registered_and_imports_stay_lazy() -> None:
    """The registry lists every scorer without importing transformers, httpx or rapidocr:
    a core install (no extras) must still import the package and its registry."""
    assert set(MODEL_SCORERS) <= set(registered_scorers())
    code = (
        "import sys\nfrom diffrl.reward.scorers import registered_scorers\nregistered_scorers()\n"
        "print(sorted(m for m in ('transformers', 'httpx', 'rapidocr_onnxruntime', 'uvicorn') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- CLIP / PickScore -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    chars = byte_alphabet()
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars])}
    bos, eos = len(vocab), len(vocab) + 1
    vocab |= {"<|startoftext|>": bos, "<|endoftext|>": eos}
    tok = transformers.CLIPTokenizer(*bpe_files(tmp_path_factory.mktemp("clip_tok"), vocab))
    ip = transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    cfg = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab),
            **TINY_LAYERS,
            max_position_embeddings=32,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=eos,
        ),
        vision_config=dict(
            **TINY_LAYERS,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )
    processor = transformers.CLIPProcessor(image_processor=ip, tokenizer=tok)
    return save_tiny(tmp_path_factory, "tiny_clip", transformers.CLIPModel, cfg, processor)


CLIP_TEXTS = ["a red circle", "a red circle", 'a sign that says "hi"', 'a sign that says "hi"']


def clip_reference(path: Path, imgs: Tensor, texts: list[str]) -> Tensor:
    """diag(logits_per_image) of CLIPModel's own forward: logit_scale.exp() * cos."""
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    inputs = proc.tokenizer(texts, padding=True, return_tensors="pt")
    pixels = proc.image_processor(images=list(imgs.numpy()), return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs, pixel_values=pixels["pixel_values"])
    return out.logits_per_image.diagonal(), float(model.logit_scale.detach().exp())


def test_clip_score_matches_model_and_is_deterministic(clip_dir: Path, media_traj) -> None:
    imgs = images(4)
    traj = media_traj(CLIP_TEXTS, image=imgs)
    scorer = build_scorer("clip_score", {"path": str(clip_dir), "batch_size": 3})
    assert scorer.name == "clip_score" and scorer.needs == frozenset({"image"})
    res = run(scorer, traj)
    assert res.scores.shape == (4,) and res.scores.dtype == torch.float32
    assert res.valid.all() and torch.isfinite(res.scores).all()
    assert (res.scores.abs() <= 1.0 + 1e-5).all()  # scale 1: a cosine
    assert torch.equal(run(scorer, traj).scores, res.scores)
    ref, logit_scale = clip_reference(clip_dir, imgs, CLIP_TEXTS)
    torch.testing.assert_close(res.scores, ref / logit_scale, rtol=1e-4, atol=1e-5)
    scaled = run(build_scorer("clip_score", {"path": str(clip_dir), "scale": 2.5}), traj)
    torch.testing.assert_close(scaled.scores, 2.5 * res.scores)


def test_pickscore_uses_the_checkpoint_logit_scale(clip_dir: Path, media_traj) -> None:
    imgs = images(4, seed=1)
    scorer = build_scorer("pickscore", {"path": str(clip_dir)})
    assert scorer.name == "pickscore"
    res = run(scorer, media_traj(CLIP_TEXTS, image=imgs))
    ref, _ = clip_reference(clip_dir, imgs, CLIP_TEXTS)
    torch.testing.assert_close(res.scores, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "clap"])
def test_missing_checkpoint_is_a_clear_error(name: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        build_scorer(name, {"path": str(tmp_path / "no_such_dir")})
    with pytest.raises(FileNotFoundError, match="hub id is not accepted"):
        build_scorer(name, {"path": "openai/clip-vit-base-patch32"})
    with pytest.raises(ValueError, match="needs params.path"):
        build_scorer(name, {})


# --- CLAP --------------------------------------------------------------------------------------

CLAP_RATE = 8000  # the tiny feature extractor's rate


@pytest.fixture(scope="module")
def clap_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for c in byte_alphabet():
        vocab[c] = len(vocab)
    vocab["<mask>"] = len(vocab)
    tok = transformers.RobertaTokenizer(*bpe_files(tmp_path_factory.mktemp("clap_tok"), vocab))
    fe = transformers.ClapFeatureExtractor(
        feature_size=16,
        sampling_rate=CLAP_RATE,
        hop_length=160,
        max_length_s=1,
        fft_window_size=256,
        frequency_max=CLAP_RATE // 2,
        truncation="rand_trunc",
        padding="repeatpad",
    )
    cfg = transformers.ClapConfig(
        text_config=dict(
            vocab_size=len(vocab),
            **TINY_LAYERS,
            max_position_embeddings=40,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            projection_dim=16,
        ),
        audio_config=dict(
            spec_size=64,
            num_mel_bins=16,
            patch_size=4,
            patch_stride=(4, 4),
            patch_embeds_hidden_size=16,
            hidden_size=32,  # = patch_embeds_hidden_size * 2 ** (len(depths) - 1)
            depths=[1, 1],
            num_attention_heads=[2, 2],
            window_size=4,
            freq_ratio=4,
            enable_fusion=False,
            projection_dim=16,
        ),
        projection_dim=16,
    )
    processor = transformers.ClapProcessor(feature_extractor=fe, tokenizer=tok)
    return save_tiny(tmp_path_factory, "tiny_clap", transformers.ClapModel, cfg, processor)


CLAP_TEXTS = ["a dog barks", "a dog barks", "rain on a roof", "a violin"]


def tones(rate: int, seconds: float, freqs=(220.0, 440.0, 880.0, 1500.0)) -> Tensor:
    t = torch.arange(int(rate * seconds)) / rate
    return torch.stack([0.5 * torch.sin(2 * math.pi * f * t) for f in freqs]).float()


def test_clap_matches_model_and_is_deterministic(clap_dir: Path, media_traj) -> None:
    from transformers import ClapModel, ClapProcessor

    audio = tones(CLAP_RATE, 0.8)
    traj = media_traj(CLAP_TEXTS, audio=audio)
    scorer = build_scorer("clap", {"path": str(clap_dir), "sample_rate": CLAP_RATE})
    assert scorer.needs == frozenset({"audio"})
    res = run(scorer, traj)
    assert res.scores.shape == (4,) and res.valid.all() and torch.isfinite(res.scores).all()
    assert torch.equal(run(scorer, traj).scores, res.scores)
    model, proc = (
        ClapModel.from_pretrained(clap_dir).eval(),
        ClapProcessor.from_pretrained(clap_dir),
    )
    feats = proc.feature_extractor(
        list(audio.numpy()), sampling_rate=CLAP_RATE, return_tensors="pt"
    )
    with torch.no_grad():
        out = model(**proc.tokenizer(CLAP_TEXTS, padding=True, return_tensors="pt"), **feats)
    ref = out.logits_per_audio.diagonal() / model.logit_scale_a.exp()
    torch.testing.assert_close(res.scores, ref, rtol=1e-4, atol=1e-4)


def test_clap_resamples_crops_and_marks_bad_audio(clap_dir: Path, media_traj) -> None:
    """Audio at twice the model's rate scores like the same tones at the model's rate; a long
    clip is cropped deterministically; a row with NaN samples is invalid, the rest are not."""
    native = run(
        build_scorer("clap", {"path": str(clap_dir), "sample_rate": CLAP_RATE}),
        media_traj(CLAP_TEXTS, audio=tones(CLAP_RATE, 0.8)),
    )
    hi = build_scorer("clap", {"path": str(clap_dir), "sample_rate": 2 * CLAP_RATE})
    resampled = run(hi, media_traj(CLAP_TEXTS, audio=tones(2 * CLAP_RATE, 0.8)))
    torch.testing.assert_close(resampled.scores, native.scores, rtol=0, atol=0.01)
    lo = build_scorer("clap", {"path": str(clap_dir), "sample_rate": CLAP_RATE})  # wrong rate
    misread = run(lo, media_traj(CLAP_TEXTS, audio=tones(2 * CLAP_RATE, 0.8)))
    assert (misread.scores - native.scores).abs().max() > 0.02  # so the check above has teeth
    long = media_traj(CLAP_TEXTS, audio=tones(2 * CLAP_RATE, 2.5))  # > the 1 s window
    assert torch.equal(run(hi, long).scores, run(hi, long).scores)
    bad = tones(CLAP_RATE, 0.8)
    bad[1, 100] = float("nan")
    res = run(
        build_scorer("clap", {"path": str(clap_dir), "sample_rate": CLAP_RATE}),
        media_traj(CLAP_TEXTS, audio=bad),
    )
    assert res.valid.tolist() == [True, False, True, True]
    assert torch.isnan(res.scores[1])
    torch.testing.assert_close(res.scores[[0, 2, 3]], native.scores[[0, 2, 3]])


# --- ImageBind-style audio-video -----------------------------------------------------------


class TinyAV(nn.Module):
    """Two linear towers over crude summaries: enough to exercise the scripted interface."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.v = nn.Linear(3, 8)

    @torch.jit.export
    def embed_audio(self, audio: Tensor, sample_rate: int) -> Tensor:
        b, n = audio.shape[0], (audio.shape[1] // 16) * 16
        return self.a(audio[:, :n].reshape(b, 16, -1).abs().mean(-1))

    @torch.jit.export
    def embed_video(self, frames: Tensor) -> Tensor:
        return self.v(frames.float().mean(dim=(1, 2, 3)) / 255.0)

    def forward(self, frames: Tensor) -> Tensor:
        return self.embed_video(frames)


class NoVideo(nn.Module):
    def forward(self, audio: Tensor) -> Tensor:
        return audio


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_imagebind_av_scripted_embedder(tmp_path: Path, media_traj) -> None:
    torch.manual_seed(0)
    module = TinyAV().eval()
    path = tmp_path / "av.pt"
    torch.jit.script(module).save(str(path))
    audio = torch.rand(5, 800) * 2 - 1
    audio[3, 7] = float("inf")
    video = torch.randint(0, 256, (5, 2, 8, 8, 3), dtype=torch.uint8)
    traj = media_traj(["x"] * 5, audio=audio, video=video)
    scorer = build_scorer(
        "imagebind_av", {"path": str(path), "sample_rate": 16000, "batch_size": 2}
    )
    assert scorer.needs == frozenset({"audio", "video"})
    res = run(scorer, traj)
    assert res.scores.shape == (5,) and res.valid.tolist() == [True, True, True, False, True]
    with torch.no_grad():
        ref = torch.cosine_similarity(module.embed_audio(audio, 16000), module.embed_video(video))
    torch.testing.assert_close(res.scores[res.valid], ref[res.valid])
    assert torch.equal(run(scorer, traj).scores[res.valid], res.scores[res.valid])

    with pytest.raises(FileNotFoundError, match="never downloads"):
        build_scorer("imagebind_av", {"path": str(tmp_path / "missing.pt")})
    torch.jit.script(NoVideo()).save(str(tmp_path / "bad.pt"))
    with pytest.raises(ValueError, match="lacks.*embed_audio"):
        build_scorer("imagebind_av", {"path": str(tmp_path / "bad.pt")})


def test_imagebind_av_accepts_any_embedder_object(media_traj) -> None:
    class Same:
        def embed_audio(self, audio: Tensor, sample_rate: int) -> Tensor:
            return torch.ones(audio.shape[0], 4)

        def embed_video(self, frames: Tensor) -> Tensor:
            return torch.ones(frames.shape[0], 4)

    scorer = build_scorer("imagebind_av", {"embedder": Same(), "scale": 3.0})
    traj = media_traj(["x"] * 2, audio=torch.zeros(2, 10), video=torch.zeros(2, 1, 2, 2, 3))
    with pytest.raises(KeyError, match="no 'sample_rate' field"):  # no rate anywhere
        run(scorer, traj)
    traj = traj.with_fields(sample_rate=torch.full((2,), 8000.0))  # as an omni rollout sets it
    assert run(scorer, traj).scores.tolist() == pytest.approx([3.0, 3.0])
    wrong = build_scorer("imagebind_av", {"embedder": Same(), "sample_rate": 16000})
    with pytest.raises(ValueError, match="16000 Hz but the trajectory's audio is 8000 Hz"):
        run(wrong, traj)
    with pytest.raises(ValueError, match="exactly one of"):
        build_scorer("imagebind_av", {})


# --- OCR ------------------------------------------------------------------------------------


def test_levenshtein_and_similarity() -> None:
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0 and levenshtein("flaw", "lawn") == 2
    assert ocr_similarity("Diff RL", "diffrl") == 1.0  # case and spaces ignored
    assert ocr_similarity("OPEN diffrl NOW", "diffrl") == 1.0  # extra text is free
    assert ocr_similarity("diffr", "diffrl") == pytest.approx(1 - 1 / 6)
    assert ocr_similarity("", "diffrl") == 0.0
    assert ocr_similarity("xb", "ab") == 0.5  # one substitution in two letters
    assert ocr_similarity("completely different", "ab") == 0.0  # capped at len(target)
    assert quoted_text('a sign that says "Hello World"') == "Hello World"
    assert quoted_text("a mug with “café” on it") == "café"
    with pytest.raises(ValueError, match="no text in double quotes"):
        quoted_text("a sign with nothing quoted")


def render_word(word: str, h: int = 96, w: int = 256) -> np.ndarray:
    """Black text on white, large enough to read; falls back to Pillow's bitmap font,
    upscaled, when no scalable font is available."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        font = ImageFont.load_default(size=48)
        img = Image.new("RGB", (w, h), "white")
        ImageDraw.Draw(img).text((10, 20), word, fill="black", font=font)
    except (TypeError, OSError):  # Pillow < 10.1 or no FreeType
        small = Image.new("RGB", (w // 4, h // 4), "white")
        ImageDraw.Draw(small).text((3, 6), word, fill="black")
        img = small.resize((w, h), Image.NEAREST)
    return np.array(img)


def test_ocr_reads_a_rendered_word(media_traj) -> None:
    pytest.importorskip("rapidocr_onnxruntime", reason="rapidocr-onnxruntime not installed")
    scorer = build_scorer(
        "ocr",
        {
            "ocr_kwargs": {
                "det_limit_side_len": 256,
                "det_limit_type": "max",
                "intra_op_num_threads": 1,
            }
        },
    )
    img = torch.from_numpy(render_word("diffrl"))
    blank = torch.full_like(img, 255)
    traj = media_traj(
        ['a sign that says "diffrl"', 'a sign that says "banana"', 'a sign that says "diffrl"'],
        image=torch.stack([img, img, blank]),
    )
    res = run(scorer, traj)
    assert res.valid.all()
    right, wrong, empty = res.scores.tolist()
    assert right >= 5 / 6  # at most one misread letter
    assert wrong < 0.5 and empty == 0.0
    assert res.metrics["exact"] <= 1 / 3 + 1e-6
    with pytest.raises(ValueError, match="no text in double quotes"):
        run(scorer, media_traj(["a blank sign"], image=blank[None]))


# --- JPEG size ------------------------------------------------------------------------------


def test_flat_image_is_more_compressible_than_noise(media_traj) -> None:
    flat = torch.full((64, 64, 3), 128, dtype=torch.uint8)
    noise = images(1, 64, 64)[0]
    traj = media_traj(["x", "y"], image=torch.stack([flat, noise]))
    comp = run(build_scorer("jpeg_compressibility"), traj)
    incomp = run(build_scorer("jpeg_incompressibility", {"scale": 2.0}), traj)
    assert comp.valid.all() and incomp.valid.all()
    assert comp.scores[0] > comp.scores[1] and incomp.scores[1] > incomp.scores[0]
    assert (comp.scores < 0).all()
    torch.testing.assert_close(incomp.scores, -comp.scores / 2.0)
    assert comp.metrics["size_kb"] == pytest.approx(float(-comp.scores.mean()))


def test_model_scorer_in_the_pool(clip_dir: Path, media_traj) -> None:
    """A recipe's reward.scorers entries reach the scorers as constructor params."""
    pool = RewardPool(
        RewardConfig(
            scorers=[
                ScorerConfig("clip_score", weight=1.0, params={"path": str(clip_dir)}),
                ScorerConfig("jpeg_incompressibility", weight=0.1, params={"scale": 10.0}),
            ]
        )
    )
    pool.check_inputs({"image"})
    batch, metrics = asyncio.run(pool.score(media_traj(CLIP_TEXTS, image=images(4))))
    assert batch.valid.all() and torch.isfinite(batch.rewards).all()
    assert (
        "reward/clip_score/mean" in metrics and "reward/jpeg_incompressibility/size_kb" in metrics
    )
