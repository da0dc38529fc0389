"""docs/settings.md is the settings reference generated from streams/config.py: it names every setting with its
environment variable, type, default and description, shows no secret, and is regenerated when a setting changes."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from streams import cli
from streams.config import ENV_PREFIX, SETTINGS_REFERENCE_PATH, Settings, settings_reference

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_has_a_one_line_description() -> None:
    missing = [name for name, info in Settings.model_fields.items() if not (info.description or "").strip()]
    assert missing == []
    assert [n for n, info in Settings.model_fields.items() if "\n" in (info.description or "")] == []


def test_docs_settings_md_is_the_generated_reference() -> None:
    path = ROOT / SETTINGS_REFERENCE_PATH
    assert path.is_file(), f"{SETTINGS_REFERENCE_PATH} is missing: streams config reference > {SETTINGS_REFERENCE_PATH}"
    text = path.read_text(encoding="utf-8")
    for name, info in Settings.model_fields.items():
        row = f"| `{name}` | `{ENV_PREFIX}{name.upper()}` |"
        assert row in text, f"{SETTINGS_REFERENCE_PATH} does not name {name}: regenerate it (streams config reference)"
        assert str(info.description) in text
    assert text == settings_reference(), f"{SETTINGS_REFERENCE_PATH} is stale: streams config reference > it"


def test_the_reference_shows_no_secret_and_the_command_prints_it() -> None:
    text = settings_reference()
    defaults = Settings()
    for name in Settings.SECRET_FIELDS:
        secret = getattr(defaults, name).get_secret_value()
        assert not secret or secret not in text  # an empty default (no password set) shows nothing either way
        assert f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | secret | (secret) |" in text
    assert "| `partitions` | `STREAMS_PARTITIONS` | int | `8` |" in text
    assert "| `http_transport` | `STREAMS_HTTP_TRANSPORT` | one of `aiohttp`, `httpx` | `aiohttp` |" in text
    assert "| `lookup_enabled` | `STREAMS_LOOKUP_ENABLED` | bool | `false` |" in text
    result = CliRunner().invoke(cli.main, ["config", "reference"])
    assert result.exit_code == 0 and result.output == text
