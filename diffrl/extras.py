"""Which optional extra (``[project.optional-dependencies]`` in pyproject.toml) brings which
top-level module, so that a command missing one says how to install it in one line instead of
ending in a traceback (``diffrl plan`` on a diffusers recipe with ``pip install -e .`` only)."""

from __future__ import annotations

# top-level module -> the extra that installs it (keep in step with pyproject.toml)
EXTRAS: dict[str, str] = {
    "diffusers": "models",
    "transformers": "models",
    "tokenizers": "models",
    "sentencepiece": "models",
    "ray": "ray",
    "transfer_queue": "ray",
    "fastapi": "serve",
    "uvicorn": "serve",
    "h11": "serve",
    "starlette": "serve",
    "rapidocr_onnxruntime": "ocr",
}


def install_hint(error: ImportError) -> str | None:
    """``"<module> (not installed here): pip install -e '.[<extra>]'"`` when ``error`` is about a
    module one of diffrl's extras brings; None for any other import error (a real bug)."""
    root = (error.name or "").split(".")[0]
    extra = EXTRAS.get(root)
    if extra is None:
        return None
    return f"{root} (not installed here): pip install -e '.[{extra}]'"
