"""The connector's settings, read by kvx-offload's serde struct: errors name the key, and the
table in kvx-python/README.md is that struct's keys and defaults. No vLLM needed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvx import offload_config, parse_config

from cases import BAD_EXTRA

README = Path(__file__).resolve().parents[2] / "README.md"
FROM_VLLM = {"block_tokens", "load_failure"}


def readme_table() -> dict[str, str]:
    """Key -> default column of the settings table."""
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `([a-z_.]+)` \| (.+?) \| ", line)
        if m:
            rows[m[1]] = m[2].strip("`")
    assert rows, f"no settings table in {README}"
    return rows


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value; an object is listed too, as the string "object"."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[prefix + k] = "object"
            out.update(flatten(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def put(d: dict[str, Any], key: str, value: Any) -> None:
    *path, last = key.split(".")
    for p in path:
        d = d.setdefault(p, {})
    d[last] = value


@pytest.mark.parametrize("extra, words", BAD_EXTRA)
def test_bad_extra_config_names_the_key(extra: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        parse_config(json.dumps(extra), 16)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_not_an_object_is_refused() -> None:
    for bad in ("[]", "3", "{"):
        with pytest.raises(ValueError) as e:
            parse_config(bad, 16)
        assert "kv_connector_extra_config" in str(e.value)


def test_readme_table_is_the_config_struct(tmp_path: Path) -> None:
    rows = readme_table()
    required = {"file.roots": [str(tmp_path)], "file.blocks": 7}
    extra: dict[str, Any] = {}
    for key, default in rows.items():
        if key in required:
            put(extra, key, required[key])
        elif default != "null":
            put(extra, key, json.loads(default))
    # Every key of the table through the serde struct (an unknown key would be refused) ...
    out = flatten(json.loads(offload_config(json.dumps(extra))))
    # ... and every setting of the struct in the table (objects only where they may be null).
    settings = {k for k, v in out.items() if v != "object"} - FROM_VLLM
    leaves = {k for k in rows if not any(r.startswith(k + ".") for r in rows)}
    assert settings == leaves, f"table and OffloadConfig differ: {settings ^ leaves}"
    for key, default in rows.items():
        if key in leaves:
            want = required.get(key, json.loads(default) if default != "required" else None)
            assert out[key] == want, f"{key}: table says {default}, OffloadConfig has {out[key]!r}"
        else:
            assert default == "null" and out[key] == "object", f"{key}: an object row is one that may be null"


def test_defaults_are_documented_values() -> None:
    rows = readme_table()
    cfg = flatten(json.loads(parse_config("{}", 32)))
    assert (cfg["block_tokens"], cfg["load_failure"]) == (32, "fail")
    for key, value in cfg.items():
        if key not in FROM_VLLM and value != "object":
            assert json.loads(rows[key]) == value, f"{key}: README {rows[key]}, connector {value!r}"
