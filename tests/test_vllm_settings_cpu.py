"""The vLLM integration's environment settings (arfuse/vllm/settings.py, no vLLM needed): the
programmatic-dependent-launch switch, off unless asked for, and a malformed value named."""

from __future__ import annotations

import pytest

from arfuse.vllm import settings


def test_pdl_off_by_default(monkeypatch):
    monkeypatch.delenv(settings.PDL_ENV, raising=False)
    assert settings.from_env().pdl is False


@pytest.mark.parametrize("raw,want", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_pdl_flag(monkeypatch, raw, want):
    monkeypatch.setenv(settings.PDL_ENV, raw)
    assert settings.from_env().pdl is want


def test_pdl_malformed_is_named(monkeypatch):
    monkeypatch.setenv(settings.PDL_ENV, "maybe")
    with pytest.raises(ValueError, match=r"ARFUSE_VLLM_PDL='maybe': want 1 or 0"):
        settings.from_env()
