"""Settings: the one place where configuration is read, parsed and validated; knows nothing about torch.

Precedence, highest first: command-line flags (`overrides`), process environment, a `.env` file, defaults.
Every setting is declared once, as a dataclass field made by `setting()`; `SPECS`, `.env.example` and the CLI flags
are derived from those fields.
Unknown keys in a `.env` file and unknown flags fail loudly; so do malformed or contradictory values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SettingsError

QUANTIZATION_MODES = ("nf4", "fp4", "int8", "none")
DTYPES = ("auto", "bfloat16", "float16", "float32")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICES = ("auto", "cuda", "cpu")
DECODE_PATHS = ("auto", "fast", "plain", "cpu")
# Fast path: prompts up to this many tokens are prefilled from CUDA graphs, right-padded to 64s (H200, Llama-2-7B,
# 512 tokens: TTFT 10.8 ms bf16 / 18.4 ms NF4 with no spread, against 17-28 / 21-46 ms compiled and launched per
# reply; the graphs' pool holds 180 / 260 MB at 704 tokens: bench/results/2026-11-30-h200-prefill-probe.json)
DEFAULT_PREFILL_GRAPH_TOKENS = 1024
SMALL_CARD_PREFILL_GRAPH_TOKENS = 256  # auto where memory bounds the fast path's cache: the graph pool costs context
DEFAULT_PREFILL_CHUNK_TOKENS = 2048
SMALL_CARD_PREFILL_CHUNK_TOKENS = 1024  # auto where memory bounds the cache: a smaller working-memory peak
COMPARE_MODES = ("nf4", "nf4-nodq", "fp4", "int8", "none")  # quantization presets of llm_core.engine.compare
# The KV cache, one name end to end (KV_CACHE, GenerationSettings.kv_cache, the memory model, the fast path):
# auto = bf16 where the card holds the model's context (up to 32k) in bf16, else int8 (llm_core.memory.plan.
# choose_kv_cache); bf16 = the compute dtype; int8 / int4 = quantized rows with scales; offload = bf16 in CPU RAM
KV_CACHE_MODES = ("auto", "bf16", "int8", "int4", "offload")
# Older names still accepted (existing .env files): dynamic = bf16, quantized = int8
KV_CACHE_ALIASES = {"dynamic": "bf16", "quantized": "int8"}
KV_LAYOUTS = ("slots", "paged")  # the batched fast path's KV storage (llm_core.fast.batched)
LAUNCH_OVERLAPS = ("auto", "early", "off")  # programmatic dependent launch of the fast path's decode kernels
GEMV_INPUTS = ("plain", "planar")  # how the fast path's one-token NF4 kernel reads its activations
NF4_FRAGS = ("auto", "off", "on")  # a second copy of the NF4 codes in mma fragment order for the batched step
PREFIX_ATTENTIONS = ("gather", "paged", "split")  # how a later prefill chunk of the paged pool reads its prefix
ENGINES = ("local", "openai")  # openai: chat through a running OpenAI-compatible server (llm_core.engine.remote)

# Gradio's own environment variables (Hugging Face Spaces sets the first two) and the setting each stands in for
# when that setting is not given as a flag, in the environment or in .env: ours win when set.
GRADIO_FALLBACKS = (("HOST", "GRADIO_SERVER_NAME"), ("PORT", "GRADIO_SERVER_PORT"), ("MCP_SERVER", "GRADIO_MCP_SERVER"))

# Hard limits for values that also arrive through the UI/API (sliders are built from these).
MAX_NEW_TOKENS_RANGE = (1, 4096)
HISTORY_TURNS_RANGE = (0, 64)
HISTORY_TRIM_STEP_RANGE = (0.0, 0.5)
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.0, 1.0)
TOP_K_RANGE = (0, 1000)
REPETITION_PENALTY_RANGE = (1.0, 2.0)
MAX_MESSAGE_CHARS_RANGE = (1, 1_000_000)
MAX_HISTORY_MESSAGES_RANGE = (0, 100_000)
MAX_HISTORY_CHARS_RANGE = (0, 100_000_000)
MAX_BATCH_SIZE_RANGE = (1, 64)
MAX_SYSTEM_PROMPT_CHARS_RANGE = (0, 1_000_000)
SESSION_MAX_WAITING_RANGE = (0, 16)
COMPARE_MAX_LOADED_RANGE = (1, 16)
LOGIN_MAX_FAILURES_RANGE = (1, 1000)
UI_UPDATE_INTERVAL_RANGE = (0.0, 1.0)
UI_MAX_UPDATES_RANGE = (0, 100_000)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MIN_SAMPLING_TEMPERATURE = 0.01  # logits / 1e-300 overflow to inf and sampling gets NaN probabilities


# --- parsing -------------------------------------------------------------------------------------

def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be true or false, got {value!r}.")


def _parse_opt_bool(name: str, value: Any) -> bool | None:
    return None if str(value).strip() == "" else _parse_bool(name, value)


def _parse_auto_int(name: str, value: Any) -> int | None:
    """A whole number, or None for `auto` / empty (the engine decides)."""
    return None if str(value).strip().lower() in ("", "auto") else _parse_int(name, value)


def _parse_int(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(str(value).strip()) if not isinstance(value, (int, float)) else int(value)
    except ValueError:
        raise SettingsError(f"{name} must be a whole number, got {value!r}.") from None


def _parse_float(name: str, value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{name} must be a number, got {value!r}.") from None


def _parse_opt_str(name: str, value: Any) -> str | None:
    text = str(value).strip()
    return text or None


def _parse_str(name: str, value: Any) -> str:
    return str(value)


_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(name: str, value: Any) -> int | None:
    """"7.5GiB", "8000MiB", "8e9" -> bytes; empty -> None. Must be positive."""
    text = str(value).strip().lower().replace(" ", "")
    if not text or text == "auto":
        return None
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):] or "b"
    try:
        amount = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise SettingsError(f"{name}={value!r} is not a size; write e.g. {name}=7.5GiB or 8000MiB.") from None
    if amount <= 0:
        raise SettingsError(f"{name} must be a positive size, got {value!r}.")
    return int(amount)


def _parse_list(name: str, value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return tuple(item.strip() for item in items if str(item).strip())


def _check_addresses(name: str, items: tuple[str, ...]) -> None:
    import ipaddress

    for item in items:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise SettingsError(f"{name} takes IP addresses or networks (e.g. 127.0.0.1,10.0.0.0/8), got {item!r}. "
                                "List only the reverse proxies in front of the demo; '*' would let every client "
                                "choose its own address.") from None


def _check_origins(name: str, items: tuple[str, ...]) -> None:
    import re

    for item in items:
        if item != "*" and not re.fullmatch(r"https?://[^/\s]+", item):
            raise SettingsError(f"{name} takes web origins such as https://chat.example.com or http://localhost:3000 "
                                f"(scheme and host, no path), or *, got {item!r}.")


def _parse_opt_int(name: str, value: Any) -> int | None:
    return None if str(value).strip() == "" else _parse_int(name, value)


def _parse_choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def parse(name: str, value: Any) -> str:
        text = str(value).strip().lower()
        _check_choice(name, text, choices)
        return text

    parse.choices = choices  # type: ignore[attr-defined]  # what check_declared checks values set in code against
    return parse


def canonical_kv_cache(value: Any, name: str = "KV_CACHE") -> str:
    """A KV cache mode as the rest of the code names it: lower-cased, an old alias (dynamic, quantized) mapped to
    its mode; SettingsError for anything else."""
    text = str(value).strip().lower()
    text = KV_CACHE_ALIASES.get(text, text)
    _check_choice(name, text, KV_CACHE_MODES)
    return text


def _parse_kv_cache(name: str, value: Any) -> str:
    return canonical_kv_cache(value, name)


_parse_kv_cache.choices = KV_CACHE_MODES  # type: ignore[attr-defined]  # as check_declared reads them


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SettingsError(f"{name}={value!r} is not supported; choose one of: {', '.join(choices)}.")


def _check_range(name: str, value: float, bounds: tuple[float, float]) -> None:
    lo, hi = bounds
    if not lo <= value <= hi:
        raise SettingsError(f"{name} must be between {lo} and {hi}, got {value}.")


def parse_max_memory(text: str) -> dict[int | str, str]:
    """"0=6GiB,cpu=24GiB" -> {0: "6GiB", "cpu": "24GiB"} (accelerate's max_memory format)."""
    out: dict[int | str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, amount = part.partition("=")
        key, amount = key.strip(), amount.strip()
        if not sep or not amount or not (key.isdigit() or key in ("cpu", "disk")):
            raise SettingsError(
                f"MAX_MEMORY entry {part!r} is malformed; write e.g. MAX_MEMORY=0=6GiB,cpu=24GiB."
            )
        if not amount[0].isdigit():
            raise SettingsError(f"MAX_MEMORY amount {amount!r} must start with a number, e.g. 6GiB.")
        out[int(key) if key.isdigit() else key] = amount
    if not out:
        raise SettingsError("MAX_MEMORY is empty; write e.g. MAX_MEMORY=0=6GiB,cpu=24GiB or leave it unset.")
    return out


def parse_auth(text: str) -> list[tuple[str, str]]:
    """"alice:pw1,bob:pw2" -> [("alice", "pw1"), ("bob", "pw2")]. Messages never echo a password."""
    pairs = []
    for i, part in enumerate(filter(None, (p.strip() for p in text.split(","))), start=1):
        user, sep, password = part.partition(":")
        if not sep or not user or not password:
            raise SettingsError(f"AUTH entry {i} is malformed; write AUTH=user:password[,user2:password2].")
        pairs.append((user, password))
    return pairs


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Minimal dotenv reader: KEY=VALUE lines, '#' comments, optional quotes. Unknown keys fail."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise SettingsError(f"{path}:{lineno}: expected KEY=VALUE, got {line!r}.")
        if key not in SPEC_BY_NAME:
            raise SettingsError(f"{path}:{lineno}: unknown setting {key!r}. Known settings: {', '.join(SPEC_BY_NAME)}.")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key] = value
    return out


def setting(name: str, default: Any, parser: Callable[[str, Any], Any], help: str, *,
            within: tuple[float, float] | None = None, secret: bool = False) -> Any:
    """A settings field and its one declaration: environment/.env key, parser, help (for .env.example and the CLI)
    and the range its value must lie in (checked by check_declared, and written at the end of the help). Secrets are
    kept out of repr."""
    if within is not None:
        help = f"{help}; from {within[0]} to {within[1]}"
    return field(default=default, repr=not secret, metadata={
        "setting": {"name": name, "parser": parser, "help": help, "secret": secret, "within": within}})


def check_declared(section: Any) -> None:
    """SettingsError for a field of a settings dataclass outside its declared range or choices (a value set in code,
    not read through the parser); None means unset and passes."""
    for f in dataclasses.fields(section):
        spec = f.metadata.get("setting")
        value = getattr(section, f.name)
        if spec is None or value is None:
            continue
        if spec["within"] is not None:
            _check_range(spec["name"], value, spec["within"])
        choices = getattr(spec["parser"], "choices", None)
        if choices is not None:
            _check_choice(spec["name"], value, choices)


@dataclass(frozen=True)
class ModelSettings:
    model_id: str | None = setting("MODEL_ID", None, _parse_opt_str,
        "HF model id or local folder; empty = the embedded SmolLM2-135M-Instruct")
    revision: str | None = setting("MODEL_REVISION", None, _parse_opt_str,
        "branch, tag or commit of MODEL_ID")
    quantization: str = setting("QUANTIZATION", "nf4", _parse_choice(QUANTIZATION_MODES),
        "nf4 | fp4 | int8 (bitsandbytes) | none (plain weights in COMPUTE_DTYPE)")
    # None = on for nf4/fp4; True with int8/none is a contradiction
    double_quant: bool | None = setting("DOUBLE_QUANT", None, _parse_opt_bool,
        "nf4/fp4 only (empty = on): also quantize the quantization constants (~0.4 bit/weight saved)")
    # nf4/fp4 compute dtype, or the weights dtype when quantization == "none"
    compute_dtype: str = setting("COMPUTE_DTYPE", "auto", _parse_choice(DTYPES),
        "auto = bfloat16 where the device supports it, else float16 (float32 on CPU for none)")
    attn_implementation: str = setting("ATTN_IMPLEMENTATION", "sdpa", _parse_choice(ATTN_IMPLEMENTATIONS),
        "sdpa | eager | flash_attention_2 (falls back to sdpa with a notice when not installed)")
    device: str = setting("DEVICE", "auto", _parse_choice(DEVICES),
        "auto = cuda when available, else cpu")
    max_memory: str | None = setting("MAX_MEMORY", None, _parse_opt_str,
        "per-device caps, e.g. 0=6GiB,cpu=24GiB; enables CPU offload (slow: last resort)")
    trust_remote_code: bool = setting("TRUST_REMOTE_CODE", False, _parse_bool,
        "run Python code shipped with the model repo (off unless you trust it)")
    decode_path: str = setting("DECODE_PATH", "auto", _parse_choice(DECODE_PATHS),
        "auto = fast static-cache path where it can run (CUDA: compiled + CUDA graphs; CPU: int4/int8 "
        "weight-only + compiled, the cpu path), else plain generate; cpu = the CPU path or an error")
    # fast path: prompts up to this many tokens prefilled from CUDA graphs; 0 = off; None = auto
    # (llm_core.memory.plan.resolve_prefill_graph_tokens)
    prefill_graph_tokens: int | None = setting("PREFILL_GRAPH_TOKENS", None, _parse_auto_int,
        "fast path: prefill prompts up to this many tokens from CUDA graphs (padded to 64s; lower TTFT, "
        f"the graphs hold ~0.3 GB on a 7B model); 0 = off; auto (default) = {DEFAULT_PREFILL_GRAPH_TOKENS}, "
        f"or {SMALL_CARD_PREFILL_GRAPH_TOKENS} where memory bounds the KV cache (small cards; the batched "
        "path's paged pool then prefills without graphs)")
    # fast path on CUDA sm_90+: programmatic dependent launch of the decode kernels (llm_core.fast.kernels.pdl)
    launch_overlap: str = setting("LAUNCH_OVERLAP", "auto", _parse_choice(LAUNCH_OVERLAPS),
        "fast path: each decode kernel launched while the one before it finishes (programmatic dependent launch, "
        "CUDA sm_90+: H100/H200); auto = where the GPU, Triton and PyTorch can; early = auto, and each 4-bit matmul "
        "prefetches its first weight tile before it waits (timed slower than auto on an H100); off = one kernel "
        "after the other")
    # fast path on CUDA: the one-token NF4 kernel's activations in planes (llm_core.nf4_gemv XPLANAR)
    gemv_input: str = setting("GEMV_INPUT", "planar", _parse_choice(GEMV_INPUTS),
        "fast path: how the one-token NF4 kernel reads its activations; planar = permuted into planes by the kernel "
        "before it (inductor's norm and SwiGLU kernels; not the attention's output), so the kernel loads them "
        "without a layout conversion (7-12% less time per layer on an H100); plain = as the layer wrote them")
    # fast path on CUDA: the batched step's NF4 rows kernel over a copy of the codes in fragment order (nf4_frag)
    nf4_frag: str = setting("NF4_FRAG", "off", _parse_choice(NF4_FRAGS),
        "fast path: also keep each NF4 weight's codes in mma fragment order (+1 copy of the 4-bit codes and 2 bytes "
        "a 64-block: ~3.2 GiB on a 7B model) for a rows kernel of 1-32 rows (llm_core.nf4_frag), which the start-up "
        "pick then times against nf4_mm for the batched decode step (H100, 8 chats: 1.10-1.13x, two runs); auto = "
        "on where replies are decoded in batches and the copy takes at most 10% of the KV slots' tokens (none where "
        "they hold the whole context either way), off elsewhere; the model panel says which and why; off by default "
        "for now")
    # None = on where the CUDA fast path serves nf4/int8 weights (llm_core.loading.wants_int8_token_tables)
    int8_token_table: bool | None = setting("INT8_TOKEN_TABLE", None, _parse_opt_bool,
        "token table and lm_head in int8 with a scale per row (half their bytes: ~1 GB on Llama-3-8B); empty = on "
        "where the CUDA fast path serves nf4/int8 weights; false = as loaded (compute dtype)")
    cache_dir: str | None = setting("CACHE_DIR", None, _parse_opt_str,
        "where converted models live; empty = ~/.cache/llm_core")
    hf_token: str | None = setting("HF_TOKEN", None, _parse_opt_str,
        "token for gated/private models; never logged or shown", secret=True)

    @property
    def use_double_quant(self) -> bool:
        return self.quantization in ("nf4", "fp4") and self.double_quant is not False

    @property
    def display_name(self) -> str:
        return self.model_id or "SmolLM2-135M-Instruct (embedded)"


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = setting("MAX_NEW_TOKENS", 256, _parse_int,
        "default reply length cap in tokens", within=MAX_NEW_TOKENS_RANGE)
    do_sample: bool = setting("DO_SAMPLE", False, _parse_bool,
        "false = greedy decoding")
    temperature: float = setting("TEMPERATURE", 0.7, _parse_float,
        "sampling temperature (DO_SAMPLE only)", within=TEMPERATURE_RANGE)
    top_p: float = setting("TOP_P", 0.95, _parse_float,
        "nucleus sampling mass (DO_SAMPLE only)", within=TOP_P_RANGE)
    top_k: int = setting("TOP_K", 50, _parse_int,
        "top-k sampling, 0 = off (DO_SAMPLE only)", within=TOP_K_RANGE)
    repetition_penalty: float = setting("REPETITION_PENALTY", 1.05, _parse_float,
        "1.0 = off; 1.05 discourages loops", within=REPETITION_PENALTY_RANGE)
    seed: int | None = setting("SEED", None, _parse_opt_int,
        "random seed for sampling; empty = random")
    stream_timeout_s: float = setting("STREAM_TIMEOUT_S", 120.0, _parse_float,
        "fail a reply when no token arrives for this many seconds")
    kv_cache: str = setting("KV_CACHE", "auto", _parse_kv_cache,
        "auto (bf16 where the card holds the model's context up to 32k in bf16, else int8) | bf16 | int8 (1.9x the "
        "context per GiB) | int4 (3.2x, lower quality) | offload (KV in CPU RAM: last resort); dynamic and quantized "
        "are accepted as bf16 and int8")
    # EOS is not allowed before this many new tokens (0 = off). Not a user setting: benchmarks use it to make every
    # reply exactly max_new_tokens long, as bench.decode does. Honoured by the plain and fast paths, not batched.
    min_new_tokens: int = 0
    # One request's output control (llm_core.constraints.RowControl: grammar, penalties, logprobs); not a setting.
    control: Any = field(default=None, compare=False)

    def validate(self) -> GenerationSettings:
        check_declared(self)
        _check_range("min_new_tokens", self.min_new_tokens, (0, MAX_NEW_TOKENS_RANGE[1]))
        if self.do_sample and not self.temperature >= MIN_SAMPLING_TEMPERATURE:
            raise SettingsError(f"TEMPERATURE must be at least {MIN_SAMPLING_TEMPERATURE} when DO_SAMPLE is on (a "
                                "smaller one divides the logits past float range); use 0 or DO_SAMPLE=false for "
                                "greedy.")
        if self.stream_timeout_s <= 0:
            raise SettingsError("STREAM_TIMEOUT_S must be a positive number of seconds.")
        return self


@dataclass(frozen=True)
class ChatSettings:
    system_prompt: str = setting("SYSTEM_PROMPT", "You are a helpful assistant.", _parse_str,
        "system prompt of new conversations")
    history_turns: int = setting("HISTORY_TURNS", 8, _parse_int,
        "past exchanges kept in the prompt", within=HISTORY_TURNS_RANGE)
    history_trim_step: float = setting("HISTORY_TRIM_STEP", 0.25, _parse_float,
        "when old turns must go, drop them in steps of this share of the history limit and of the token budget, so "
        "the next replies reuse the cached prompt; 0 drops the fewest", within=HISTORY_TRIM_STEP_RANGE)
    # also the Compare prompt's limit
    max_message_chars: int = setting("MAX_MESSAGE_CHARS", 16_000, _parse_int,
        "longest accepted user message", within=MAX_MESSAGE_CHARS_RANGE)
    max_system_prompt_chars: int = setting("MAX_SYSTEM_PROMPT_CHARS", 8_000, _parse_int,
        "longest accepted system prompt (checked before anything is tokenized)", within=MAX_SYSTEM_PROMPT_CHARS_RANGE)
    max_history_messages: int = setting("MAX_HISTORY_MESSAGES", 256, _parse_int,
        "most messages accepted in a request's history (older turns are trimmed anyway)",
        within=MAX_HISTORY_MESSAGES_RANGE)
    max_history_chars: int = setting("MAX_HISTORY_CHARS", 256_000, _parse_int,
        "most characters of text accepted in a request's history", within=MAX_HISTORY_CHARS_RANGE)


@dataclass(frozen=True)
class ServerSettings:
    host: str = setting("HOST", "127.0.0.1", _parse_str,
        "address to bind; 127.0.0.1 keeps the demo local; unset: GRADIO_SERVER_NAME if set")
    port: int = setting("PORT", 7860, _parse_int,
        "port to serve on; unset: GRADIO_SERVER_PORT if set")
    share: bool = setting("SHARE", False, _parse_bool,
        "create a public gradio.live link")
    auth: str | None = setting("AUTH", None, _parse_opt_str,
        "user:password[,user2:password2] required to open the demo", secret=True)
    queue_size: int = setting("QUEUE_SIZE", 64, _parse_int,
        "requests waiting at most; more are refused")
    mcp_server: bool = setting("MCP_SERVER", False, _parse_bool,
        "serve the chat endpoint as an MCP tool at /gradio_api/mcp/ (needs gradio[mcp]); unset: "
        "GRADIO_MCP_SERVER if set")
    max_batch_size: int | None = setting("MAX_BATCH_SIZE", None, _parse_opt_int,
        "replies decoded together in one batch; empty = auto: 8 on CUDA (with KV_LAYOUT=slots only when shared: "
        "SHARE/AUTH/non-local HOST), 1 on CPU; 1 = one at a time", within=MAX_BATCH_SIZE_RANGE)
    session_max_waiting: int = setting("SESSION_MAX_WAITING", 1, _parse_int,
        "requests one person (a login, its API key, or an address without AUTH; all their tabs and clients "
        "together) may have waiting beside their running reply; more are refused, and a free slot goes "
        "to the person served least recently", within=SESSION_MAX_WAITING_RANGE)
    allow_open_host: bool = setting("ALLOW_OPEN_HOST", False, _parse_bool,
        "serve a non-loopback HOST or SHARE link without AUTH (refused at start unless true; logged)")
    login_max_failures: int = setting("LOGIN_MAX_FAILURES", 5, _parse_int,
        "failed logins or /v1 API keys one user name, and one client address, may have per LOGIN_WINDOW_S; "
        "then that user (from any address) or that address waits, even with the right password",
        within=LOGIN_MAX_FAILURES_RANGE)
    login_window_s: float = setting("LOGIN_WINDOW_S", 60.0, _parse_float,
        "seconds the login failure count spans")
    forwarded_allow_ips: tuple[str, ...] = setting("FORWARDED_ALLOW_IPS", (), _parse_list,
        "comma-separated addresses of reverse proxies whose X-Forwarded-For is believed (empty: none, so "
        "a client cannot pick its own address for the login throttle and fair share)")
    cors_origins: tuple[str, ...] = setting("CORS_ORIGINS", (), _parse_list,
        "comma-separated web origins (https://host[:port]) besides the demo's own whose browser requests "
        "are accepted, /v1 included; empty: every other site's requests are refused, as OLLAMA_ORIGINS")
    export_ttl_s: float = setting("EXPORT_TTL_S", 3600.0, _parse_float,
        "exported stats files are deleted after this many seconds, and when their session ends")
    ui_update_interval_s: float = setting("UI_UPDATE_INTERVAL_S", 0.05, _parse_float,
        "a streamed reply's page and /chat API updates come at most this often, in seconds (the first token's "
        "and the end's at once); an update per token cut each reply to about a third of its speed at 8 "
        "concurrent chats on an H100 (docs/sharing.md); 0 = an update per token",
        within=UI_UPDATE_INTERVAL_RANGE)
    ui_max_updates_per_s: int = setting("UI_MAX_UPDATES_PER_S", 128, _parse_int,
        "streamed updates a second for every reply together at most: with N replies streaming, each updates every "
        "max(UI_UPDATE_INTERVAL_S, N / this) s (32 chats: every 0.25 s); Gradio's work per update slows the "
        "decoder (32 chats on an H100: ~730 tokens/s in all at 0.05 s, 1,860 at 0.25 s); 0 = no cap",
        within=UI_MAX_UPDATES_RANGE)

    @property
    def is_shared(self) -> bool:
        """Reachable by others (public link, login, or bound beyond loopback): expect several users at once."""
        return self.share or self.auth is not None or self.host not in LOOPBACK_HOSTS

    @property
    def is_open(self) -> bool:
        """Reachable beyond this machine (a non-loopback HOST or a SHARE link) with no login in front."""
        return self.auth is None and (self.share or self.host not in LOOPBACK_HOSTS)


@dataclass(frozen=True)
class MemorySettings:
    # device bytes the process may use in total; None = free after load - margin
    budget_bytes: int | None = setting("VRAM_BUDGET", None, parse_bytes,
        "memory a reply may use in total, weights included, e.g. 7.5GiB; empty = free after load - margin")
    # kept free when the budget is derived; None = 512 MiB on CUDA, 1 GiB on CPU
    margin_bytes: int | None = setting("MEMORY_MARGIN", None, parse_bytes,
        "kept free when VRAM_BUDGET is derived; empty = 512MiB on CUDA, 1GiB on CPU")
    # long prompts are prefilled in chunks of this size (flat peak); 0 = off; None = auto
    # (llm_core.memory.plan.resolve_prefill_chunk_tokens)
    prefill_chunk_tokens: int | None = setting("PREFILL_CHUNK_TOKENS", None, _parse_auto_int,
        "prefill long prompts in chunks of this many tokens (flattens the peak); 0 = off; auto (default) = "
        f"{DEFAULT_PREFILL_CHUNK_TOKENS}, or {SMALL_CARD_PREFILL_CHUNK_TOKENS} where memory bounds the KV "
        "cache (small cards)")
    # a reply prefills only the prompt tokens after the longest prefix whose KV the last reply left in the cache
    prefix_cache: bool = setting("PREFIX_CACHE", True, _parse_bool,
        "keep the KV of the last reply's tokens and prefill only what a new prompt adds after the longest "
        "common prefix (next chat turn, Regenerate, a shared system prompt); off = prefill every prompt whole")
    # the batched fast path's KV: slots = one fixed slot per row; paged = one pool of 16-token blocks
    kv_layout: str = setting("KV_LAYOUT", "paged", _parse_choice(KV_LAYOUTS),
        "batched fast path: slots = each of MAX_BATCH_SIZE rows a fixed share of the KV memory; paged = one pool of "
        "blocks a row takes as it grows (a lone reply may use all of it; full blocks of finished replies stay "
        "cached for the next prompt with that prefix, with PREFIX_CACHE)")
    # a later prefill chunk on the paged pool: gather its prefix into a temporary (default) or read the pool in place
    prefix_attention: str = setting("PREFIX_ATTENTION", "gather", _parse_choice(PREFIX_ATTENTIONS),
        "KV_LAYOUT=paged, a prompt chunk after cached tokens: gather = copy the prefix out of the pool and "
        "flash-attend it; paged = a Triton kernel reads the pool in place (no copy; experimental: faster for bf16 "
        "rows, slower for int8 rows on an H100, docs/prefix_cache.md); split = gather, then attend the prefix's "
        "whole 4,096-key buckets unmasked (cuDNN where it runs) and the rest with the chunk causally, merged "
        "(experimental: 15% faster than gather at 24k tokens of history, slower at 6-9k, and its first use in a "
        "process stalls a few seconds; H100, docs/prefix_cache.md)")


@dataclass(frozen=True)
class CompareSettings:
    models: tuple[str, ...] = setting("COMPARE_MODELS", (), _parse_list,
        "comma-separated HF ids / folders the Compare view may load besides the served model")
    modes: tuple[str, ...] = setting("COMPARE_MODES", COMPARE_MODES, _parse_list,
        "quantization presets offered in the Compare view: " + ", ".join(COMPARE_MODES))
    allow_custom_models: bool = setting("ALLOW_CUSTOM_MODELS", False, _parse_bool,
        "let users type model folders (inside MODEL_DIRS) or Hub ids (with ALLOW_DOWNLOADS) in the Compare "
        "view (off: only the configured list)")
    # folders typed paths must lie in (resolved, symlinks followed)
    model_dirs: tuple[str, ...] = setting("MODEL_DIRS", (), _parse_list,
        "comma-separated folders a typed model path must lie in (ALLOW_CUSTOM_MODELS); empty = none")
    allow_downloads: bool = setting("ALLOW_DOWNLOADS", False, _parse_bool,
        "let a typed Hub id be downloaded (ALLOW_CUSTOM_MODELS; uses HF_TOKEN if set)")
    max_loaded: int = setting("COMPARE_MAX_LOADED", 3, _parse_int,
        "model configurations the Compare view keeps loaded at most (least recently used unloaded first)",
        within=COMPARE_MAX_LOADED_RANGE)


@dataclass(frozen=True)
class RemoteSettings:
    engine: str = setting("ENGINE", "local", _parse_choice(ENGINES),
        "local = load MODEL_ID here; openai = chat through the OpenAI-compatible server at OPENAI_BASE_URL")
    base_url: str | None = setting("OPENAI_BASE_URL", None, _parse_opt_str,
        "a running OpenAI-compatible server (vLLM, SGLang, llama.cpp, this demo), e.g. "
        "http://127.0.0.1:8000/v1; also offered in the Compare view when set")
    api_key: str | None = setting("OPENAI_API_KEY", None, _parse_opt_str,
        "API key for OPENAI_BASE_URL (empty = none); never logged or shown", secret=True)
    model: str | None = setting("OPENAI_MODEL", None, _parse_opt_str,
        "model id on OPENAI_BASE_URL; empty = the first model the server lists")


@dataclass(frozen=True)
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    chat: ChatSettings = field(default_factory=ChatSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    compare: CompareSettings = field(default_factory=CompareSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    remote: RemoteSettings = field(default_factory=RemoteSettings)

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        env_file: str | os.PathLike[str] | None = ".env",
        overrides: Mapping[str, Any] | None = None,
    ) -> Settings:
        """Build validated settings. `overrides` are keyed by setting name (e.g. "MODEL_ID") and win."""
        environ = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        if env_file is not None and Path(env_file).is_file():
            raw.update(read_env_file(env_file))
        raw.update({k: v for k, v in environ.items() if k in SPEC_BY_NAME})
        for key, value in (overrides or {}).items():
            if key not in SPEC_BY_NAME:
                raise SettingsError(f"Unknown setting {key!r}. Known settings: {', '.join(SPEC_BY_NAME)}.")
            if value is not None:
                raw[key] = value
        for ours, gradios in GRADIO_FALLBACKS:  # Gradio's (and Spaces') own variables, where ours are not set
            if ours not in raw and str(environ.get(gradios, "")).strip():
                raw[ours] = environ[gradios]
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Settings:
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in raw.items():
            spec = SPEC_BY_NAME.get(key)
            if spec is None:
                raise SettingsError(f"Unknown setting {key!r}. Known settings: {', '.join(SPEC_BY_NAME)}.")
            sections[spec.section][spec.attr] = spec.parse(key, value)
        settings = cls(**{name: _SECTIONS[name](**values) for name, values in sections.items()})
        settings.validate()
        return settings

    def validate(self) -> None:
        m = self.model
        for section in (m, self.memory, self.chat, self.server, self.compare, self.remote):
            check_declared(section)  # ranges and choices as declared; the rules between settings follow
        if m.double_quant and m.quantization not in ("nf4", "fp4"):
            raise SettingsError(
                f"DOUBLE_QUANT applies to 4-bit modes only, but QUANTIZATION={m.quantization}; "
                "remove DOUBLE_QUANT or choose QUANTIZATION=nf4/fp4."
            )
        if m.quantization == "int8" and m.compute_dtype not in ("auto", "float16"):
            raise SettingsError("QUANTIZATION=int8 computes in float16; set COMPUTE_DTYPE=auto or float16.")
        if m.max_memory is not None:
            parse_max_memory(m.max_memory)
        self.generation.validate()
        if not self.server.login_window_s > 0:
            raise SettingsError("LOGIN_WINDOW_S must be a positive number of seconds.")
        _check_addresses("FORWARDED_ALLOW_IPS", self.server.forwarded_allow_ips)
        _check_origins("CORS_ORIGINS", self.server.cors_origins)
        if not self.server.export_ttl_s > 0:
            raise SettingsError("EXPORT_TTL_S must be a positive number of seconds.")
        if not 0 < self.server.port < 65536:
            raise SettingsError(f"PORT must be between 1 and 65535, got {self.server.port}.")
        if self.server.auth is not None:
            parse_auth(self.server.auth)
        for mode in self.compare.modes:
            _check_choice("COMPARE_MODES", mode, COMPARE_MODES)
        if self.model.prefill_graph_tokens is not None and self.model.prefill_graph_tokens < 0:
            raise SettingsError("PREFILL_GRAPH_TOKENS must be 0 (off) or a positive number of tokens.")
        if self.memory.prefill_chunk_tokens is not None and self.memory.prefill_chunk_tokens < 0:
            raise SettingsError("PREFILL_CHUNK_TOKENS must be 0 (off) or a positive number of tokens.")
        url = self.remote.base_url
        if url is not None and not url.startswith(("http://", "https://")):
            raise SettingsError(f"OPENAI_BASE_URL must start with http:// or https://, got {url!r}; write e.g. "
                                "OPENAI_BASE_URL=http://127.0.0.1:8000/v1.")
        if self.remote.engine == "openai" and url is None:
            raise SettingsError("ENGINE=openai needs OPENAI_BASE_URL, the server's OpenAI API root, e.g. "
                                "OPENAI_BASE_URL=http://127.0.0.1:8000/v1.")

    def replace(self, **section_updates: Mapping[str, Any]) -> Settings:
        """Copy with updated fields, e.g. settings.replace(model={"quantization": "none"})."""
        kwargs = {name: dataclasses.replace(getattr(self, name), **upd) for name, upd in section_updates.items()}
        new = dataclasses.replace(self, **kwargs)
        new.validate()
        return new


@dataclass(frozen=True)
class SettingSpec:
    name: str  # environment variable / .env key; the CLI flag is --name-in-kebab-case
    section: str
    attr: str
    parser: Callable[[str, Any], Any]
    help: str
    secret: bool = False

    def parse(self, key: str, value: Any) -> Any:
        return self.parser(key, value)

    @property
    def flag(self) -> str:
        return "--" + self.name.lower().replace("_", "-")

    @property
    def is_switch(self) -> bool:
        """A true/false setting: its flag may stand alone (`--share` means `--share true`)."""
        return self.parser in (_parse_bool, _parse_opt_bool)

    def default(self) -> Any:
        default = next(f.default for f in dataclasses.fields(_SECTIONS[self.section]) if f.name == self.attr)
        return ",".join(default) if isinstance(default, tuple) else default


# Section order is the order settings appear in .env.example and the CLI's help.
_SECTIONS: dict[str, type] = {"model": ModelSettings, "generation": GenerationSettings, "memory": MemorySettings,
                              "chat": ChatSettings, "server": ServerSettings, "compare": CompareSettings,
                              "remote": RemoteSettings}
SPECS: tuple[SettingSpec, ...] = tuple(
    SettingSpec(f.metadata["setting"]["name"], section, f.name, f.metadata["setting"]["parser"],
                f.metadata["setting"]["help"], f.metadata["setting"]["secret"])
    for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls) if "setting" in f.metadata
)
SPEC_BY_NAME: dict[str, SettingSpec] = {s.name: s for s in SPECS}


def env_example() -> str:
    """The text of .env.example: every setting with its default and one line of meaning."""
    lines = ["# Every setting the demo reads (environment, .env, or --flag-name). Defaults shown.", ""]
    for spec in SPECS:
        default = spec.default()
        shown = "" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        lines.append(f"# {spec.help}")
        lines.append(f"{'# ' if spec.secret else ''}{spec.name}={'' if spec.secret else shown}")
    return "\n".join(lines) + "\n"
