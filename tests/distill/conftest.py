"""Shared helpers for the autodistill v1 tests: fixture paths and loaders."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from kiln.distill.contract import CaptureTokenRow, Plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "autodistill" / "v1"


def load_make_fixtures():
    """Import the fixture generator module (it lives outside any package)."""
    spec = importlib.util.spec_from_file_location("autodistill_make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_rows(name: str) -> list[CaptureTokenRow]:
    return [CaptureTokenRow.parse(line) for line in (FIXTURES / name).read_bytes().split(b"\n")[:-1]]


@pytest.fixture(scope="session")
def expert_plan() -> Plan:
    return Plan.parse((FIXTURES / "plan.json").read_bytes())


@pytest.fixture(scope="session")
def rollout_plan() -> Plan:
    return Plan.parse((FIXTURES / "plan-student-rollout.json").read_bytes())


@pytest.fixture(scope="session")
def expert_rows() -> list[CaptureTokenRow]:
    return read_rows("rows-teacher-expert.jsonl")


@pytest.fixture(scope="session")
def rollout_rows() -> list[CaptureTokenRow]:
    return read_rows("rows-student-rollout.jsonl")


@pytest.fixture
def shard_copy(tmp_path: Path) -> Path:
    """A writable copy of the committed teacher-expert shard."""
    dest = tmp_path / "shard"
    shutil.copytree(FIXTURES / "shard-teacher-expert", dest)
    return dest
