"""The chat page's "JSON schema" field: replies valid for the schema, the mask's time in the stats, bad schemas
refused with what is wrong (CPU, embedded model, through the app's own /chat endpoint)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from tests import test_app as served
from tests.test_app import SYSTEM

app_url, client = served.app_url, served.client  # the served app's fixtures (module-scoped here too)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"enum": ["FR", "DE", "IT"]}},
          "required": ["city", "country"], "additionalProperties": False}


def _chat(client: Any, schema: str, message: str = "Name a city in Europe.") -> list[Any]:
    return list(client.submit(message, [], SYSTEM, 40, 8, False, 0.7, 0.95, 50, 1.05, "bf16", schema,
                              api_name="/chat"))


def test_a_json_schema_makes_the_reply_valid_json_and_the_stats_say_the_mask_time(client: Any) -> None:
    _, history, stats_md, stats = _chat(client, json.dumps(SCHEMA))[-1]
    reply = history[-1]["content"]
    jsonschema.validate(json.loads(reply if isinstance(reply, str) else reply[0]["text"]), SCHEMA)
    assert stats["grammar_mask_ms_per_token"] > 0 and "JSON schema mask" in stats_md and "ms/token" in stats_md
    _, _, plain_md, plain = _chat(client, "  ")[-1]  # blank: off
    assert plain["grammar_mask_ms_per_token"] is None and "JSON schema mask" not in plain_md


@pytest.mark.parametrize(("schema", "says"), [("{not json", "The JSON schema is not valid JSON"),
                                              ("[1, 2]", "The JSON schema must be a JSON object"),
                                              ('{"type": 5}', "cannot be used for structured output")])
def test_a_bad_json_schema_is_refused_with_what_is_wrong(client: Any, schema: str, says: str) -> None:
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=re.escape(says)):
        client.predict("Name a city.", [], SYSTEM, 16, 8, False, 0.7, 0.95, 50, 1.05, "bf16", schema,
                       api_name="/chat")
    assert _chat(client, "", "Still there?")[-1][3]["new_tokens"] > 0
