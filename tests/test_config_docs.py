"""config.toml, ingest/config.py and docs/configuration.md name the same keys with the same defaults."""

import re
import tomllib
from pathlib import Path

from ingest.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def builtin_defaults() -> dict[str, dict]:
    """Each section's keys and their defaults in ingest/config.py (paths as the text they are written as)."""
    out = {}
    for section, field in Settings.model_fields.items():
        if field.exclude:  # where the settings came from, not a key of the file
            continue
        out[section] = {k: str(f.default) if isinstance(f.default, Path) else f.default
                        for k, f in field.annotation.model_fields.items()}
    return out


def toml_keys(text: str) -> dict[str, dict]:
    """config.toml's keys per section: those set, and those shown commented out (``# key = value``) as None."""
    out: dict[str, dict] = {}
    for section, body in re.findall(r"^\[(\w+)\]\n(.*?)(?=^\[|\Z)", text, flags=re.M | re.S):
        out[section] = dict.fromkeys(re.findall(r"^# (\w+) = ", body, flags=re.M))
        out[section].update(tomllib.loads(body))
    return out


def commented_values(text: str) -> dict[tuple[str, str], object]:
    """(section, key) -> the value config.toml shows for a key it leaves commented out (``# key = value``)."""
    out = {}
    for section, body in re.findall(r"^\[(\w+)\]\n(.*?)(?=^\[|\Z)", text, flags=re.M | re.S):
        for key, value in re.findall(r"^# (\w+) = (\S+)", body, flags=re.M):
            out[(section, key)] = tomllib.loads(f"v = {value}")["v"]
    return out


def _value(cell: str):
    return None if cell == "none" else tomllib.loads(f"v = {cell}")["v"]


def doc_tables(text: str) -> dict[str, dict]:
    """docs/configuration.md's table per ``## `[section]` ``: key -> (default as config.toml sets it, built-in); a key
    marked ``(*model*)`` is commented out in config.toml."""
    out = {}
    for section, body in re.findall(r"^## `\[(\w+)\]`\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S):
        rows = {}
        for key, cell in re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", body, flags=re.M):
            m = re.fullmatch(r"(?:`(.+?)`|(none))(?: \(built-in: `(.+)`\))?( \(\*model\*\))?", cell)
            assert m, (section, key, cell)
            shown = _value(m[1] or m[2])
            # *model*: the model's calibration decides; config.toml shows the key commented out (None), and the
            # value shown is ingest/config.py's default
            rows[key] = (None if m[4] else shown, _value(m[3]) if m[3] else shown)
        out[section] = rows
    return out


def test_config_toml_config_py_and_the_docs_agree():
    builtin = builtin_defaults()
    shipped = toml_keys((ROOT / "config.toml").read_text(encoding="utf-8"))
    docs = doc_tables((ROOT / "docs" / "configuration.md").read_text(encoding="utf-8"))
    assert list(docs) == list(shipped) == list(builtin)  # the same sections, in the same order
    for section, keys in builtin.items():
        assert set(docs[section]) == set(shipped[section]) == set(keys), section
        for key, default in keys.items():
            shown, documented_builtin = docs[section][key]
            assert documented_builtin == default, (section, key, "docs vs ingest/config.py")
            assert shown == shipped[section][key], (section, key, "docs vs config.toml")
    # a key config.toml shows commented out shows ingest/config.py's default (an example only where the default is
    # none, e.g. max_tokens_per_page)
    for (section, key), value in commented_values((ROOT / "config.toml").read_text(encoding="utf-8")).items():
        if builtin[section][key] is not None:
            assert value == builtin[section][key], (section, key, "config.toml's commented value vs ingest/config.py")
