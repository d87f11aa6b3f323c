"""HTTP routes for /v1/train/* (owned by the training work)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
