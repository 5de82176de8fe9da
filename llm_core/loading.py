"""Loading: settings -> BitsAndBytesConfig + tokenizer + model -> LoadedModel with a load report.

The only module that decides device, dtype, quantization and attention. It never generates text.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from .config import ModelSettings, parse_max_memory
from .errors import ModelLoadError, SettingsError
from .memory.device import free_memory
from .models import ModelSource, resolve_source
from .types import LoadedModel, LoadReport

log = logging.getLogger(__name__)
EXPANDABLE_SEGMENTS = "expandable_segments:True"

Progress = Callable[[str], None]

_VERSIONED_PACKAGES = ("torch", "transformers", "accelerate", "bitsandbytes", "gradio")


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries that decide speed and memory (read from metadata, no imports)."""
    out = {}
    for name in _VERSIONED_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def resolve_device(settings: ModelSettings) -> torch.device:
    if settings.device == "cpu":
        return torch.device("cpu")
    if settings.device == "cuda":
        if not torch.cuda.is_available():
            raise SettingsError("DEVICE=cuda, but no CUDA GPU is visible to PyTorch; set DEVICE=auto or cpu.")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True  # PyTorch computes bfloat16 on any CPU (emulated where the ISA lacks it)


def resolve_compute_dtype(settings: ModelSettings, device: torch.device) -> torch.dtype:
    """The dtype activations are computed in (and plain weights stored in when quantization == none)."""
    name = settings.compute_dtype
    if settings.quantization == "int8":
        return torch.float16  # bitsandbytes LLM.int8 computes in float16
    if name == "auto":
        if settings.quantization == "none" and device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if bf16_supported(device) else torch.float16
    if name == "bfloat16" and not bf16_supported(device):
        raise SettingsError("COMPUTE_DTYPE=bfloat16, but this GPU has no bfloat16 support; use float16 or auto.")
    return getattr(torch, name)


def build_quantization_config(settings: ModelSettings, device: torch.device) -> Any | None:
    """BitsAndBytesConfig for nf4/fp4/int8, None for quantization == none."""
    if settings.quantization == "none":
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise SettingsError(
            f"QUANTIZATION={settings.quantization} needs the bitsandbytes package, which is not installed; "
            "run `make setup` or set QUANTIZATION=none."
        )
    from transformers import BitsAndBytesConfig

    if settings.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=settings.max_memory is not None)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=settings.quantization,
        bnb_4bit_use_double_quant=settings.use_double_quant,
        bnb_4bit_compute_dtype=resolve_compute_dtype(settings, device),
        llm_int8_enable_fp32_cpu_offload=settings.max_memory is not None,
    )


def resolve_attention(settings: ModelSettings) -> tuple[str, str | None]:
    """(implementation to use, a note for the user when the requested one is unavailable)."""
    wanted = settings.attn_implementation
    if wanted == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "sdpa", "flash_attention_2 requested but the flash-attn package is not installed; using sdpa."
    return wanted, None


def resolve_device_map(settings: ModelSettings, device: torch.device) -> Any:
    if settings.max_memory is not None:
        return "auto"  # accelerate places layers within max_memory, spilling to CPU (offload: slow)
    return {"": device.index if device.type == "cuda" else "cpu"}


def _preset_name(settings: ModelSettings) -> str:
    """The quantization preset a setting names, as the Compare view says it (nf4 without double quant: nf4-nodq)."""
    return "nf4-nodq" if settings.quantization == "nf4" and not settings.use_double_quant else settings.quantization


def count_quantized_linears(model: Any) -> int:
    # By class name, without importing bitsandbytes here: its import logs a caught ImportError whose traceback
    # would keep this frame (and so the model) alive wherever log records are kept.
    names = {"Linear4bit", "Linear8bitLt"}
    return sum(type(m).__name__ in names and type(m).__module__.startswith("bitsandbytes") for m in model.modules())


def context_length_of(config: Any, tokenizer: Any) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    tok_max = getattr(tokenizer, "model_max_length", None)
    return tok_max if isinstance(tok_max, int) and 0 < tok_max < 10**7 else 2048


def configure_cuda_allocator() -> str:
    """Use expandable segments unless the operator configured the allocator: a KV cache that grows step by step
    otherwise fragments the caching allocator (measured on an H200 under an 8 GiB cap: 1.6 GiB reserved but
    unusable, and an OOM at 6.95 GiB allocated; and ~0.9 GiB of unusable fragments after the fast path's graph
    captures). Before the first CUDA allocation the environment variable does it; when something already
    initialised CUDA's allocator (a notebook, another library, a benchmark that capped the process first) the
    setting is applied to the live allocator, so segments made from now on expand. Returns what is in effect."""
    configured = any(os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    if configured:
        return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            set_allocator_settings(EXPANDABLE_SEGMENTS)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the budget guard still counts what is reserved
            log.info("Could not switch the live CUDA allocator to expandable segments: %s", exc)
            return ""
    return EXPANDABLE_SEGMENTS


def set_allocator_settings(conf: str) -> None:
    """Apply PYTORCH_CUDA_ALLOC_CONF-style settings to the live caching allocator (torch's accelerator API where
    this torch has it, else the CUDA one it replaced)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(conf)


def load_model(settings: ModelSettings, progress: Progress | None = None) -> LoadedModel:
    """Load tokenizer and model once per process, as `settings` says. Raises ModelLoadError/SettingsError."""
    say = progress or (lambda _msg: None)
    configure_cuda_allocator()
    device = resolve_device(settings)
    compute_dtype = resolve_compute_dtype(settings, device)
    quant_config = build_quantization_config(settings, device)
    attention, attention_note = resolve_attention(settings)
    device_map = resolve_device_map(settings, device)
    notes = [attention_note] if attention_note else []
    if settings.max_memory is not None:
        notes.append("MAX_MEMORY is set: layers that do not fit are offloaded to CPU, which is much slower.")

    say(f"Locating {settings.display_name}…")
    source = resolve_source(settings)
    common: dict[str, Any] = {"revision": source.revision, "token": settings.hf_token,
                              "trust_remote_code": settings.trust_remote_code}
    cpu_format, cpu_note = _cpu_path_format(settings, device, source, common)
    if cpu_format is not None:  # the CPU path quantizes the float weights itself (llm_core.fast.cpu), not bitsandbytes
        quant_config, compute_dtype = None, torch.float32
        notes.append(cpu_note)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    say(f"Loading tokenizer of {source.display_name}…")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.name_or_path, **common)
    except Exception as exc:
        raise ModelLoadError(_load_failure_message(source, "tokenizer", exc)) from exc
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelLoadError(f"{source.display_name} has no chat template; choose an instruct/chat model.")

    dtype_name = str(compute_dtype).removeprefix("torch.")
    say(f"Loading weights of {source.display_name} ({settings.quantization}, {dtype_name})…")
    kwargs: dict[str, Any] = dict(common, dtype="auto" if cpu_format else compute_dtype, attn_implementation=attention,
                                  device_map=device_map)
    if quant_config is not None:
        kwargs["quantization_config"] = quant_config
    if settings.max_memory is not None:
        kwargs["max_memory"] = parse_max_memory(settings.max_memory)
    try:
        model = AutoModelForCausalLM.from_pretrained(source.name_or_path, **kwargs)
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        raise ModelLoadError(
            f"{source.display_name} does not fit in memory with QUANTIZATION={settings.quantization}. "
            "Try QUANTIZATION=nf4, a smaller model, or MAX_MEMORY for CPU offload (slow)."
        ) from exc
    except Exception as exc:
        raise ModelLoadError(_load_failure_message(source, "model", exc)) from exc
    model.eval()
    extra: dict[str, Any] = {}
    if cpu_format is not None:
        from .fast.cpu_weights import quantize_for_cpu

        say(f"Quantizing {source.display_name} for the CPU path ({cpu_format})…")
        extra["cpu_weights"] = quantize_for_cpu(model, cpu_format)
        free_memory(device)  # the float weights' heap pages back to the OS: RSS is what the CPU path holds
    elif wants_int8_token_tables(settings, device, model.config):
        from .fast.tables import quantize_token_tables

        say(f"Quantizing the token table and lm_head of {source.display_name} to int8…")
        extra["token_tables"] = tables = quantize_token_tables(model)
        if "skipped" not in tables:
            kind = "one tied table" if tables["tied"] else "two tables"
            notes.append(f"Token table and lm_head in int8 with a scale per row ({kind}): "
                         f"{tables['bytes_before'] / 2**30:.2f} -> {tables['bytes_after'] / 2**30:.2f} GiB "
                         "(INT8_TOKEN_TABLE=false keeps them as loaded).")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - t0

    placement = getattr(model, "hf_device_map", None) or {}
    offloaded = any(str(v) in ("cpu", "disk") for v in placement.values()) and device.type == "cuda"
    report = LoadReport(
        model=source.display_name,
        origin=source.origin,
        revision=source.revision,
        quantization=cpu_format if cpu_format in ("int4", "int8") else settings.quantization,
        double_quant=settings.use_double_quant and cpu_format is None,
        compute_dtype="bfloat16" if cpu_format in ("int4", "int8") else str(compute_dtype).removeprefix("torch."),
        attention=getattr(model.config, "_attn_implementation", attention),
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        offloaded=offloaded,
        weights_bytes=int(model.get_memory_footprint()),
        load_s=round(load_s, 3),
        context_length=context_length_of(model.config, tokenizer),
        versions=library_versions(),
        notes=tuple(notes),
        quantized_linear_layers=count_quantized_linears(model) if cpu_format is None else sum(
            len(layer) for layer in extra["cpu_weights"].layers),
        quantization_requested=_preset_name(settings) if cpu_format in ("int4", "int8") else "",
    )
    say(f"Loaded {source.display_name} in {load_s:.1f} s.")
    return LoadedModel(model, tokenizer, settings, device, compute_dtype, report, source, extra)


def _cpu_path_format(settings: ModelSettings, device: torch.device, source: ModelSource,
                     common: dict[str, Any]) -> tuple[str | None, str]:
    """The CPU path's weight format (llm_core.fast.cpu) and the note saying why, or (None, "") where it does not
    run: off CPU, DECODE_PATH=plain/fast, MAX_MEMORY, or a model it does not implement (DECODE_PATH=cpu: an error)."""
    if device.type != "cpu" or settings.decode_path not in ("auto", "cpu") or settings.max_memory is not None:
        if settings.decode_path == "cpu":
            raise SettingsError("DECODE_PATH=cpu runs on the CPU only (DEVICE=cpu, no MAX_MEMORY); "
                                "use DECODE_PATH=auto.")
        return None, ""
    from transformers import AutoConfig

    from .fast.cpu import cpu_path_support, cpu_weight_format

    try:
        config = AutoConfig.from_pretrained(source.name_or_path, **common)
    except Exception as exc:
        raise ModelLoadError(_load_failure_message(source, "config", exc)) from exc
    ok, why = cpu_path_support(config)
    if not ok:
        if settings.decode_path == "cpu":
            raise SettingsError(f"DECODE_PATH=cpu cannot run this model: {why}. Use DECODE_PATH=auto.")
        return None, ""
    fmt = cpu_weight_format(settings.quantization)
    if fmt == "dense":
        return fmt, "CPU decode path: weights as stored (QUANTIZATION=none)."
    return fmt, (f"CPU decode path: QUANTIZATION={settings.quantization} computes with {fmt} weight-only kernels "
                 "(torch's AVX-512/AVX2 CPU kernels, bf16 activations) instead of bitsandbytes, which is several "
                 "times slower on CPU (docs/cpu.md).")


def wants_int8_token_tables(settings: ModelSettings, device: torch.device, config: Any) -> bool:
    """INT8_TOKEN_TABLE: as set (true: any device), else on where the CUDA fast path will serve nf4/int8 weights
    (not with DECODE_PATH=plain); never with MAX_MEMORY offload."""
    if settings.max_memory is not None:  # offloaded layers: accelerate's hooks own where the weights live
        return False
    if settings.int8_token_table is not None:
        return settings.int8_token_table
    if device.type != "cuda" or settings.quantization not in ("nf4", "int8") or settings.decode_path == "plain":
        return False
    from .fast.support import config_fast_path_support

    return config_fast_path_support(config, settings.quantization)[0]


def estimate_weights_bytes(settings: ModelSettings) -> int:
    """Bytes the weights will take once loaded with `settings`, computed from the config alone (meta tensors).

    Linear layers inside the network are quantized (nf4/fp4: 0.5 byte per weight plus one absmax per 64 weights,
    itself 8-bit with double quant; int8: 1 byte plus a row scale); embeddings, norms and lm_head stay in the
    compute dtype, as bitsandbytes leaves them. Used to decide whether another model fits before loading it.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_source(settings)
    try:
        config = AutoConfig.from_pretrained(source.name_or_path, revision=source.revision, token=settings.hf_token,
                                            trust_remote_code=settings.trust_remote_code)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=settings.trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(_load_failure_message(source, "config", exc)) from exc
    device = resolve_device(settings)
    dtype_bytes = torch.empty((), dtype=resolve_compute_dtype(settings, device)).element_size()
    head = model.get_output_embeddings()
    quantizable = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            quantizable += module.weight.numel()
    total = sum(p.numel() for p in model.parameters())  # tied embeddings are one parameter
    if getattr(config, "tie_word_embeddings", False) and head is not None:
        input_embeddings = model.get_input_embeddings()
        if input_embeddings is not None and head.weight is not input_embeddings.weight:
            total -= head.weight.numel()  # meta init may leave the tie undone; loading ties them
    rest = total - quantizable
    tables = 0
    if head is not None and wants_int8_token_tables(settings, device, config):  # int8 rows + an fp32 scale each
        embed = model.get_input_embeddings()
        shared = bool(getattr(config, "tie_word_embeddings", False))
        for table in [head] if shared or embed is None else [head, embed]:
            rest -= table.weight.numel()
            tables += table.weight.numel() + table.weight.shape[0] * 4
    if settings.quantization in ("nf4", "fp4"):
        absmax = quantizable / 64 * (1 if settings.use_double_quant else 4)
        quantized = quantizable * 0.5 + absmax
    elif settings.quantization == "int8":
        quantized = quantizable * 1.0 + quantizable / 4096 * 4  # row-wise fp32 scales (approximate)
    else:
        quantized = quantizable * dtype_bytes
    return int(quantized + rest * dtype_bytes + tables)


def _load_failure_message(source: ModelSource, what: str, exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    hint = ""
    if source.origin == "hub":
        hint = (" Check the id and your network; gated models need HF_TOKEN. Offline machines need a local "
                "folder in MODEL_ID.")
    return f"Could not load the {what} of {source.display_name}: {text}.{hint}"
