"""Comparisons: one prompt through several model configurations, one after another, each with its own numbers.

Configurations come from settings (COMPARE_MODELS x COMPARE_MODES); typed models only with ALLOW_CUSTOM_MODELS, and
then only folders inside MODEL_DIRS or (ALLOW_DOWNLOADS) Hub ids. A configuration is validated completely before
anything loads. An EnginePool keeps one engine per model + quantization + attention (a KV mode is a per-reply option,
never a second copy of the weights), at most COMPARE_MAX_LOADED of them, and unloads (truly frees) the least recently
used before loading another that would not fit or would exceed the count, saying so. Knows nothing about Gradio.

CLI: python -m llm_core.engine.compare --config nf4 --config none --prompt "Why is the sky blue?" --out compare.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..config import ATTN_IMPLEMENTATIONS, KV_CACHE_MODES, GenerationSettings, Settings, canonical_kv_cache
from ..errors import InputError, LLMCoreError, ModelLoadError, SettingsError
from ..history import clean_text
from ..loading import Progress, estimate_weights_bytes, resolve_device
from ..memory.device import free_memory
from ..memory.kv_cache import check_kv_cache
from ..metrics import ReplyStats, configuration_label, format_bytes
from .admission import ReplySlots
from .backend import ChatBackend
from .chat import ChatEngine, ReplyUpdate

# Quantization presets a comparison may use: name -> (quantization, double_quant).
MODE_PRESETS: dict[str, tuple[str, bool | None]] = {
    "nf4": ("nf4", True),
    "nf4-nodq": ("nf4", False),
    "fp4": ("fp4", True),
    "int8": ("int8", None),
    "none": ("none", None),
}

REMOTE_MODE = "remote"  # a side served by the OpenAI-compatible server at OPENAI_BASE_URL (llm_core.engine.remote)


@dataclass(frozen=True)
class CompareConfig:
    """One side of a comparison: model + quantization preset + attention + KV-cache mode."""

    model_id: str | None = None  # None = the embedded default model
    mode: str = "nf4"
    attn_implementation: str = "sdpa"
    kv_cache: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODE_PRESETS and self.mode != REMOTE_MODE:
            raise InputError(f"Unknown quantization mode {self.mode!r}; choose one of {', '.join(MODE_PRESETS)}.")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise InputError(f"Unknown attention {self.attn_implementation!r}; choose one of "
                             f"{', '.join(ATTN_IMPLEMENTATIONS)}.")
        try:
            kv = canonical_kv_cache(self.kv_cache, "KV cache")
        except SettingsError:
            raise InputError(f"Unknown KV cache mode {self.kv_cache!r}; choose one of {', '.join(KV_CACHE_MODES)}.") \
                from None
        object.__setattr__(self, "kv_cache", kv)  # an old alias (dynamic, quantized) named as its mode
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id.strip()):
            raise InputError("Choose a model for every side.")

    @property
    def engine_key(self) -> CompareConfig:
        """What a loaded engine is: model + quantization + attention. The KV mode is chosen per reply."""
        return replace(self, kv_cache="auto") if self.kv_cache != "auto" else self

    @property
    def is_remote(self) -> bool:
        return self.mode == REMOTE_MODE

    @property
    def label(self) -> str:
        if self.is_remote:
            return f"{self.model_id or 'remote model'} · remote"
        model = self.model_id or "embedded"
        parts = [model, self.mode, self.attn_implementation]
        if self.kv_cache != "auto":
            parts.append(f"{self.kv_cache} KV")
        return " · ".join(parts)

    def apply(self, base: Settings) -> Settings:
        quantization, double_quant = MODE_PRESETS[self.mode]
        compute_dtype = base.model.compute_dtype if quantization not in ("int8",) else "auto"
        model: dict[str, Any] = {"model_id": self.model_id, "quantization": quantization,
                                 "double_quant": double_quant, "compute_dtype": compute_dtype,
                                 "attn_implementation": self.attn_implementation}
        if self.model_id not in allowed_models(base):
            model["hf_token"] = None  # a model a user typed is never fetched with the operator's token
        return base.replace(model=model)

    @classmethod
    def of_settings(cls, settings: Settings) -> CompareConfig:
        if settings.remote.engine == "openai":
            return cls(settings.remote.model, REMOTE_MODE)
        m = settings.model
        mode = m.quantization if m.quantization in ("fp4", "int8", "none") else (
            "nf4" if m.use_double_quant else "nf4-nodq")
        return cls(m.model_id, mode, m.attn_implementation)


def allowed_models(settings: Settings) -> list[str | None]:
    """The served model first, then COMPARE_MODELS (None = the embedded default)."""
    models: list[str | None] = [settings.model.model_id]
    for item in settings.compare.models:
        if item not in models:
            models.append(item)
    return models


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")


def _custom_model_allowed(model_id: str, settings: Settings) -> bool:
    """A typed model: a folder with a config.json inside one of MODEL_DIRS (symlinks resolved first), or, when the
    operator allows downloads, a Hub id that is not also a path here."""
    compare = settings.compare
    if model_id.startswith(("/", ".", "~")) or "\\" in model_id or ".." in model_id:
        try:
            path = Path(model_id).expanduser().resolve()
        except (OSError, RuntimeError, ValueError):
            return False
        for root in compare.model_dirs:
            try:
                inside = path.is_relative_to(Path(root).expanduser().resolve())
            except (OSError, RuntimeError, ValueError):
                continue
            if inside and (path / "config.json").is_file():
                return True
        return False
    return compare.allow_downloads and _HUB_ID.fullmatch(model_id) is not None and not Path(model_id).exists()


def check_allowed(config: CompareConfig, settings: Settings) -> None:
    """Everything about a side that can be checked before loading: mode, model, and the KV mode on this device.
    A typed model that is missing and one that is not allowed get the same answer (no probing of the disk)."""
    if config.is_remote:
        if settings.remote.base_url is None:
            raise InputError("No remote engine is configured here (OPENAI_BASE_URL).")
        return
    if config.mode not in settings.compare.modes:
        raise InputError(f"Mode {config.mode!r} is not enabled here; allowed: {', '.join(settings.compare.modes)}.")
    model_id = config.model_id
    custom = settings.compare.allow_custom_models and model_id is not None
    if model_id not in allowed_models(settings) and not (custom and _custom_model_allowed(str(model_id), settings)):
        raise InputError(f"Model {model_id!r} is not in the configured list (COMPARE_MODELS) or in a model folder "
                         "this demo may load from; the operator can add it to COMPARE_MODELS or MODEL_DIRS.")
    try:
        if config.kv_cache != "auto":  # auto is the engine's choice, made when it loads
            check_kv_cache(config.kv_cache, resolve_device(config.apply(settings).model))
    except SettingsError as exc:
        raise InputError(f"{config.label}: {exc}") from None


def memory_in_use(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


def memory_available(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.virtual_memory().available)


class EnginePool:
    """Loaded ChatEngines by configuration. Loads on demand; unloads the least recently used before a load that
    would not fit (weights estimate + reserve vs available memory). The primary engine serves the chat tab."""

    def __init__(self, settings: Settings, primary: ChatBackend | None = None, *, progress: Progress | None = None,
                 reserve_bytes: int | None = None) -> None:
        self.settings = settings
        self.primary_config = CompareConfig.of_settings(settings)
        self._engines: OrderedDict[CompareConfig, ChatEngine] = OrderedDict()
        self._resident_bytes: dict[CompareConfig, int] = {}  # memory each engine holds (measured at its load)
        # The remote engine (OPENAI_BASE_URL) holds no memory here: kept apart from the loaded engines, connected on
        # first use unless it is the served one (ENGINE=openai).
        self._remote: ChatBackend | None = None
        if isinstance(primary, ChatEngine):
            self._engines[self.primary_config] = primary
        elif primary is not None:
            self._remote = primary
        self._lock = threading.RLock()  # serialises loads and unloads (held for a whole load)
        self._map_lock = threading.Lock()  # guards _engines only: never held across a load
        self._progress = progress or (lambda _m: None)
        device = resolve_device(settings.model)
        # Room kept free beyond the weights for activations and the KV cache of a reply.
        self.reserve_bytes = reserve_bytes if reserve_bytes is not None else (
            2 * 2**30 if device.type == "cuda" else 1 * 2**30)

    def resident(self) -> list[CompareConfig]:
        with self._map_lock:
            return list(self._engines)

    def engines(self) -> list[ChatBackend]:
        """The loaded engines right now, without waiting for a load in progress (e.g. to Stop a reply)."""
        with self._map_lock:
            return [*self._engines.values(), *([self._remote] if self._remote is not None else [])]

    def primary(self) -> ChatBackend:
        engine, _notes = self.get(self.primary_config)
        return engine

    def _remote_engine(self) -> ChatBackend:
        with self._lock:
            if self._remote is None:
                from .remote import RemoteEngine

                self._remote = RemoteEngine.connect(self.settings, progress=self._progress)
            return self._remote

    def get(self, config: CompareConfig, progress: Progress | None = None) -> tuple[ChatBackend, list[str]]:
        """The engine for `config` (model + quantization + attention: its KV mode is a per-reply option), loading
        it (and unloading others to make room, or to stay within COMPARE_MAX_LOADED) if needed; notes say what
        happened, for the user. A resident engine is returned at once, even while another configuration loads
        (a chat message does not wait for a comparison's model load)."""
        if config.is_remote:
            return self._remote_engine(), []
        config = config.engine_key
        resident = self._touch(config)
        if resident is not None:
            return resident, []
        with self._lock:
            resident = self._touch(config)  # loaded by another caller while this one waited
            if resident is not None:
                return resident, []
            settings = config.apply(self.settings)
            device = resolve_device(settings.model)
            need = estimate_weights_bytes(settings.model) + self.reserve_bytes
            notes: list[str] = []
            limit = self.settings.compare.max_loaded
            while len(self.resident()) >= limit:  # the served model goes last
                loaded = self.resident()
                victim = next((c for c in loaded if c != self.primary_config), loaded[0])
                freed = self.unload(victim)
                notes.append(f"Unloaded {victim.label} (freed {format_bytes(freed)}): at most {limit} "
                             "configurations stay loaded (COMPARE_MAX_LOADED).")
            while self.resident() and memory_available(device) < need:
                victim = self.resident()[0]
                freed = self.unload(victim)
                notes.append(f"Unloaded {victim.label} (freed {format_bytes(freed)}) to make room for "
                             f"{config.label}: the two do not fit together, so they run one after another.")
            if memory_available(device) < need:
                raise ModelLoadError(f"{config.label} needs about {format_bytes(need)} with its working room, but "
                                     f"only {format_bytes(memory_available(device))} is available.")
            say = progress or self._progress
            for note in notes:
                say(note)
            say(f"Loading {config.label}…")
            before = memory_in_use(device)
            engine = ChatEngine.load(settings, progress=say)
            with self._map_lock:
                self._engines[config] = engine
                self._resident_bytes[config] = max(0, memory_in_use(device) - before)
            return engine, notes

    def served(self) -> ChatBackend | None:
        """The engine serving chat now if it is loaded (None while a comparison has unloaded it); never loads."""
        if self.primary_config.is_remote:
            return self._remote
        with self._map_lock:
            return self._engines.get(self.primary_config)

    def fit(self, config: CompareConfig) -> Fit:
        """Whether `config` would fit before loading it: its weights estimated from the model's config (no download
        of weights) plus working room, against what is available now and what unloading the others would free."""
        if config.is_remote:
            return Fit(config, 0, 0, 0, resident=True)
        if self._touch(config) is not None:
            return Fit(config, 0, 0, 0, resident=True)
        settings = config.apply(self.settings)
        with self._lock:  # the estimate builds the model on the meta device (accelerate patches nn.Module
            weights = estimate_weights_bytes(settings.model)  # process-wide): never while a load runs
        device = resolve_device(settings.model)
        with self._map_lock:
            freeable = sum(self._resident_bytes.get(c, e.report.weights_bytes or 0) for c, e in self._engines.items())
        return Fit(config, weights + self.reserve_bytes, memory_available(device), freeable)

    def switch_primary(self, config: CompareConfig, progress: Progress | None = None) -> tuple[ChatBackend, list[str]]:
        """Serve chat from `config` from now on, without a restart: load it (unloading others if it would not fit
        beside them), then unload the previously served engine and release its memory. Notes say what happened."""
        check_allowed(config, self.settings)
        say = progress or self._progress
        with self._lock:
            fit = self.fit(config)
            if not fit.fits:  # refused before anything is unloaded: the current model keeps serving
                raise ModelLoadError(fit.describe())
            old = self.primary_config
            engine, notes = self.get(config, progress=say)
            self.primary_config = config
            if old != config and old in self.resident():
                freed = self.unload(old)
                note = f"Unloaded {old.label}, the model served before (freed {format_bytes(freed)})."
                say(note)
                notes.append(note)
            say(f"Now serving {config.label}.")
            return engine, notes

    def _touch(self, config: CompareConfig) -> ChatEngine | None:
        """The resident engine for `config`, marked most recently used; None if it is not loaded."""
        with self._map_lock:
            engine = self._engines.get(config)
            if engine is not None:
                self._engines.move_to_end(config)
            return engine

    def others_resident_bytes(self, config: CompareConfig) -> int:
        """Memory held by the loaded engines other than `config`'s: measured when the pool loaded them, the
        weights' footprint for one it was given (the served engine)."""
        config = config.engine_key
        with self._map_lock:
            return sum(self._resident_bytes.get(c, e.report.weights_bytes or 0)
                       for c, e in self._engines.items() if c != config)

    def unload(self, config: CompareConfig) -> int:
        """Drop an engine and release its memory; returns the bytes freed (measured, not estimated)."""
        config = config.engine_key
        with self._lock:
            with self._map_lock:
                engine = self._engines.pop(config, None)
                self._resident_bytes.pop(config, None)
            if engine is None:
                return 0
            device = engine.loaded.device
            with engine.exclusive():  # wait for a reply in progress on it to finish
                before = memory_in_use(device)
                engine.close()  # a batch loop's thread would keep its weights, KV and graphs alive
                engine.loaded.model = None
                engine.loaded.extra.clear()
            del engine
            free_memory(device)
            return max(0, before - memory_in_use(device))


@dataclass(frozen=True)
class Fit:
    """The fit prediction shown before a load: bytes needed (weights + working room), available now, and what the
    other loaded engines hold (unloaded first if the new one would not fit beside them)."""

    config: CompareConfig
    need_bytes: int
    available_bytes: int
    freeable_bytes: int
    resident: bool = False  # already loaded (or remote): nothing to load

    @property
    def fits_beside(self) -> bool:
        return self.resident or self.need_bytes <= self.available_bytes

    @property
    def fits(self) -> bool:
        return self.fits_beside or self.need_bytes <= self.available_bytes + self.freeable_bytes

    def describe(self) -> str:
        if self.resident:
            return f"{self.config.label} is already loaded: switching is immediate."
        numbers = (f"needs about {format_bytes(self.need_bytes)} (weights and working room); "
                   f"{format_bytes(self.available_bytes)} available now")
        if self.fits_beside:
            return f"{self.config.label} {numbers}: fits."
        if self.fits:
            return (f"{self.config.label} {numbers}: fits once the loaded models are unloaded "
                    f"({format_bytes(self.freeable_bytes)}); they will be.")
        return f"{self.config.label} {numbers}, {format_bytes(self.freeable_bytes)} more after unloading: does not fit."


@dataclass(frozen=True)
class SideResult:
    config: CompareConfig
    text: str
    stats: ReplyStats
    load_s: float | None  # None when the engine was already resident
    notes: tuple[str, ...] = ()

    @property
    def others_resident_bytes(self) -> int:
        return self.stats.others_resident_bytes

    @property
    def own_peak_bytes(self) -> int | None:
        return self.stats.own_peak_bytes

    def summary_row(self) -> dict[str, Any]:
        s = self.stats
        return {
            "configuration": configuration_label(s),
            "ttft_ms": None if s.ttft_s is None else round(s.ttft_s * 1000, 1),
            "decode_tokens_per_s": None if s.decode_tokens_per_s is None else round(s.decode_tokens_per_s, 2),
            "new_tokens": s.new_tokens,
            "peak_memory_mib": None if self.own_peak_bytes is None else round(self.own_peak_bytes / 2**20, 1),
            "weights_mib": None if s.weights_bytes is None else round(s.weights_bytes / 2**20, 1),
            "load_s": None if self.load_s is None else round(self.load_s, 2),
        }


@dataclass(frozen=True)
class CompareUpdate:
    """Progress of a comparison: side `index` is streaming (update) or finished (result)."""

    index: int
    config: CompareConfig
    update: ReplyUpdate | None
    notes: tuple[str, ...] = ()
    results: tuple[SideResult, ...] = ()  # every finished side so far
    done: bool = False
    difference: str = ""


def first_difference(texts: Sequence[str]) -> str:
    """Where the outputs first differ, in words, for the summary line."""
    if len(texts) < 2:
        return ""
    if all(t == texts[0] for t in texts):
        return f"All {len(texts)} outputs are identical ({len(texts[0]):,} characters)."
    n = min(len(t) for t in texts)
    index = next((i for i in range(n) if any(t[i] != texts[0][i] for t in texts)), n)
    word = len(texts[0][:index].split())
    context = texts[0][max(0, index - 30):index]
    tails = " | ".join(repr(t[index:index + 20]) for t in texts)
    return f"Outputs first differ at character {index:,} (word {word + 1}), after …{context!r}: {tails}"


@dataclass
class Comparison:
    """Runs configurations on the same prompt, generation settings and seed, one after another."""

    pool: EnginePool
    settings: Settings
    progress: Progress | None = None
    # The Compare view and the CLI ask for two or more sides; bench/compare_bench.py measures one side at a time
    # through this same path (min_sides=1).
    min_sides: int = 2
    # One comparison at a time, in fair turns per person: one running or waiting each, more refused at once.
    _lock: ReplySlots = field(default_factory=lambda: ReplySlots(1, session_max_waiting=0))

    def run(self, configs: Sequence[CompareConfig], message: str, gen: GenerationSettings,
            system_prompt: str | None = "", request_id: str | None = None, person: str | None = None
            ) -> Iterator[CompareUpdate]:
        """Run each side in turn. Stop names `request_id`; `person` (llm_core.security.person_of) is whom the turns
        between comparisons and each side's admission in its engine count it for, beside that person's chats."""
        need = max(1, self.min_sides)
        if len(configs) < need:
            raise InputError("Choose at least two configurations to compare." if need == 2 else
                             f"Choose at least {need} configuration(s).")
        if len(set(configs)) != len(configs):
            raise InputError("Two sides have the same configuration; change one of them.")
        for config in configs:  # every side checked before anything loads
            check_allowed(config, self.settings)
        chat = self.settings.chat
        message = clean_text(message, field="prompt", max_chars=chat.max_message_chars)
        if system_prompt is not None:
            system_prompt = clean_text(system_prompt, field="system prompt", max_chars=chat.max_system_prompt_chars,
                                       allow_empty=True)
        if gen.do_sample and gen.seed is None:
            gen = replace(gen, seed=random.randrange(2**31))  # the same seed for every side
        results: list[SideResult] = []
        with self._lock.ticket(person or request_id or uuid.uuid4().hex) as turn:  # refused if one is in already
            turn.wait()  # one comparison at a time: the numbers of each side are measured alone
            for index, config in enumerate(configs):
                t0 = time.perf_counter()
                resident = config.engine_key in self.pool.resident()
                engine, notes = self.pool.get(config)
                load_s = None if resident else time.perf_counter() - t0
                yield CompareUpdate(index, config, None, tuple(notes), tuple(results))
                last: ReplyUpdate | None = None
                side_gen = replace(gen, kv_cache=config.kv_cache)
                try:
                    for last in engine.stream_chat(message, [], gen=side_gen, history_turns=0,
                                                   system_prompt=system_prompt, request_id=request_id,
                                                   person=person):
                        if last.done:  # the final numbers, as the result keeps them: no view shows another peak
                            last = replace(last, stats=replace(
                                last.stats, others_resident_bytes=self.pool.others_resident_bytes(config),
                                notes=[*last.stats.notes, *notes]))
                        yield CompareUpdate(index, config, last, tuple(notes), tuple(results))
                except LLMCoreError:
                    del engine
                    if not resident and config.engine_key != self.pool.primary_config:
                        self.pool.unload(config)  # a refused side does not leave its model loaded
                    raise
                assert last is not None and last.done
                results.append(SideResult(config, last.text, last.stats, load_s, tuple(notes)))
        yield CompareUpdate(len(configs) - 1, configs[-1], None, (), tuple(results), done=True,
                            difference=first_difference([r.text for r in results]))


def parse_config(text: str, default_model: str | None = None) -> CompareConfig:
    """CLI form: MODE, or MODEL@MODE, optionally :ATTN — e.g. "nf4", "int8:eager", "/models/x@none"."""
    model: str | None = default_model
    if "@" in text:
        model_text, text = text.rsplit("@", 1)
        model = model_text or None
    mode, _, attn = text.partition(":")
    return CompareConfig(model, mode, attn or "sdpa")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare model configurations on the same prompts; JSON out.")
    parser.add_argument("--config", action="append", required=True,
                        help="MODE | MODEL@MODE | MODE:ATTN (repeat; modes: " + ", ".join(MODE_PRESETS) + ")")
    prompt_source = parser.add_mutually_exclusive_group(required=True)
    prompt_source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    prompt_source.add_argument("--prompt-file", help="a text file, one prompt per line")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="-", help="JSON file (default: stdout)")
    args = parser.parse_args(argv)
    try:
        overrides: dict[str, Any] = {"MAX_NEW_TOKENS": args.max_new_tokens, "SEED": args.seed}
        settings = Settings.from_env(overrides=overrides)
        settings = settings.replace(compare={"allow_custom_models": True})  # the CLI user chooses freely
        configs = [parse_config(c, settings.model.model_id) for c in args.config]
        prompts = args.prompt or [line.strip() for line in open(args.prompt_file, encoding="utf-8") if line.strip()]
        comparison = Comparison(EnginePool(settings, progress=_log), settings)
        records = []
        for prompt in prompts:
            final = collections.deque(comparison.run(configs, prompt, settings.generation), maxlen=1)[0]
            for result in final.results:
                records.append({"prompt": prompt, "configuration": result.config.label, "text": result.text,
                                "load_s": result.load_s, **result.stats.as_dict()})
            records.append({"prompt": prompt, "difference": final.difference})
    except LLMCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps({"command": " ".join(["python -m llm_core.engine.compare", *(argv or sys.argv[1:])]),
                       "records": records}, indent=2, ensure_ascii=False)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

if __name__ == "__main__":
    sys.exit(main())
