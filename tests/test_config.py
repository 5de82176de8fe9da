"""Settings: one place, strict validation, messages that name the setting and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from app import parse_args
from llm_core.config import _SECTIONS, SPECS, Settings, env_example, parse_max_memory
from llm_core.errors import SettingsError

REPO = Path(__file__).resolve().parent.parent


def test_defaults_are_nf4_double_quant_sdpa_on_the_embedded_model() -> None:
    s = Settings.from_env(environ={}, env_file=None)
    assert s.model.model_id is None
    assert (s.model.quantization, s.model.use_double_quant, s.model.attn_implementation) == ("nf4", True, "sdpa")
    assert s.generation.do_sample is False and s.generation.repetition_penalty == 1.05
    assert s.server.host == "127.0.0.1"


def test_environment_overrides_env_file_and_flags_override_environment(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("MAX_NEW_TOKENS=100\nHISTORY_TURNS=3\n# comment\nQUANTIZATION='int8'\n")
    s = Settings.from_env(environ={"MAX_NEW_TOKENS": "200"}, env_file=env_file, overrides={"HISTORY_TURNS": 5})
    assert (s.generation.max_new_tokens, s.chat.history_turns, s.model.quantization) == (200, 5, "int8")


def test_unknown_env_file_key_fails_and_names_it(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("MAX_NEW_TOKEN=100\n")
    with pytest.raises(SettingsError, match="MAX_NEW_TOKEN"):
        Settings.from_env(environ={}, env_file=env_file)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"COMPUTE_DTYPE": "bf16"}, "COMPUTE_DTYPE"),
        ({"QUANTIZATION": "nf3"}, "QUANTIZATION"),
        ({"MAX_NEW_TOKENS": "-5"}, "MAX_NEW_TOKENS"),
        ({"MAX_NEW_TOKENS": "many"}, "MAX_NEW_TOKENS"),
        ({"HISTORY_TURNS": "-1"}, "HISTORY_TURNS"),
        ({"QUANTIZATION": "int8", "DOUBLE_QUANT": "true"}, "DOUBLE_QUANT"),
        ({"QUANTIZATION": "int8", "COMPUTE_DTYPE": "bfloat16"}, "int8"),
        ({"MAX_MEMORY": "gpu:6GiB"}, "MAX_MEMORY"),
        ({"DO_SAMPLE": "maybe"}, "DO_SAMPLE"),
        ({"DO_SAMPLE": "true", "TEMPERATURE": "0"}, "TEMPERATURE"),
        ({"PORT": "70000"}, "PORT"),
        ({"AUTH": "alice"}, "AUTH"),
        ({"PREFILL_GRAPH_TOKENS": "-64"}, "PREFILL_GRAPH_TOKENS"),
    ],
)
def test_bad_or_contradictory_values_fail_naming_the_setting(values: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        Settings.from_env(environ=values, env_file=None)


def test_unknown_override_fails() -> None:
    with pytest.raises(SettingsError, match="Unknown setting 'MODEL'"):
        Settings.from_env(environ={}, env_file=None, overrides={"MODEL": "x"})


def test_secrets_never_appear_in_repr_or_errors() -> None:
    s = Settings.from_env(environ={"HF_TOKEN": "hf_secret123", "AUTH": "alice:pw-secret"}, env_file=None)
    assert "hf_secret123" not in repr(s) and "pw-secret" not in repr(s)
    with pytest.raises(SettingsError) as err:
        Settings.from_env(environ={"AUTH": "alice:pw-secret,bob"}, env_file=None)
    assert "pw-secret" not in str(err.value)


def test_max_memory_parses_to_accelerate_format() -> None:
    assert parse_max_memory("0=6GiB, cpu=24GiB") == {0: "6GiB", "cpu": "24GiB"}


def test_env_example_lists_every_setting_with_its_default() -> None:
    text = (REPO / ".env.example").read_text()
    assert text == env_example()
    for spec in SPECS:
        assert f"{spec.name}=" in text


def test_every_setting_has_a_flag_and_flags_reach_settings() -> None:
    args = parse_args(["--quantization", "fp4", "--share", "--max-new-tokens", "64"])
    env_file = args.pop("env_file")
    s = Settings.from_env(environ={}, env_file=None, overrides=args)
    assert env_file == ".env"
    assert (s.model.quantization, s.server.share, s.generation.max_new_tokens) == ("fp4", True, 64)
    with pytest.raises(SystemExit):
        parse_args(["--no-such-flag", "1"])


def test_each_setting_is_declared_once_on_its_field() -> None:
    """SPECS is derived from the dataclass fields: one spec per field, names unique, defaults from the field."""
    import dataclasses

    from llm_core.config import _SECTIONS

    declared = [(section, f.name) for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)
                if "setting" in f.metadata]
    assert [(s.section, s.attr) for s in SPECS] == declared
    assert len({s.name for s in SPECS}) == len(SPECS)
    defaults = Settings()
    for spec in SPECS:
        value = getattr(getattr(defaults, spec.section), spec.attr)
        assert spec.default() == (",".join(value) if isinstance(value, tuple) else value)


@pytest.mark.parametrize(("section", "values", "named"), [
    ("chat", {"history_turns": 65}, "HISTORY_TURNS"),
    ("server", {"max_batch_size": 0}, "MAX_BATCH_SIZE"),
    ("compare", {"max_loaded": 17}, "COMPARE_MAX_LOADED"),
    ("generation", {"top_p": 1.5}, "TOP_P"),
    ("model", {"decode_path": "warp"}, "DECODE_PATH"),
    ("generation", {"kv_cache": "fp8"}, "KV_CACHE"),
])
def test_a_value_set_in_code_is_held_to_its_declared_range_and_choices(section: str, values: dict[str, Any],
                                                                       named: str) -> None:
    """Settings built in code (not parsed) are checked against the range or choices declared on the field, and the
    range is what .env.example says."""
    with pytest.raises(SettingsError, match=named):
        Settings().replace(**{section: values})
    spec = next(s for s in SPECS if s.name == named)
    field = {f.name: f for f in dataclasses.fields(_SECTIONS[section])}[spec.attr]
    within = field.metadata["setting"]["within"]
    if within is not None:
        assert spec.help.endswith(f"from {within[0]} to {within[1]}") and spec.help in env_example()


def test_kv_cache_has_one_tuple_of_modes_and_old_names_stay_accepted() -> None:
    """KV_CACHE takes the modes of config.KV_CACHE_MODES; dynamic and quantized (older .env files) parse to bf16 and
    int8, in any case; anything else is refused naming the modes."""
    from llm_core.config import KV_CACHE_ALIASES, KV_CACHE_MODES
    from llm_core.memory import model as memory_model

    for mode in KV_CACHE_MODES:
        assert Settings.from_env(environ={"KV_CACHE": mode}, env_file=None).generation.kv_cache == mode
    for old, new in (("dynamic", "bf16"), ("Quantized", "int8")):
        assert Settings.from_env(environ={"KV_CACHE": old}, env_file=None).generation.kv_cache == new
    assert set(KV_CACHE_ALIASES.values()) <= set(KV_CACHE_MODES)
    assert memory_model.KV_CACHE_MODES is KV_CACHE_MODES  # the memory model and kv_cache.py check against it
    with pytest.raises(SettingsError, match="KV_CACHE='fp8' is not supported; choose one of: " +
                       ", ".join(KV_CACHE_MODES)):
        Settings.from_env(environ={"KV_CACHE": "fp8"}, env_file=None)
