"""HTTP routes for /v1/adapters/* (owned by the adapter work)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
