"""Shared test helpers. Paths are resolved from this file, so tests run from any directory."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
REAL_TRACES = ROOT.parent / "shared" / "traces" / "real"


@pytest.fixture
def tiny_cfg():
    from k3sched.config import load_config

    return load_config(CONFIGS / "tiny-cpu.yaml")
