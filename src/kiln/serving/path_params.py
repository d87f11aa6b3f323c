"""The path parameters of Kiln's routes, each with the pattern and length its route really accepts.

The pattern is published in ``/openapi.json`` (``json_schema_extra``: FastAPI does not enforce it, so a
value outside it still gets the route's own typed error, e.g. 404 ``judgment_not_found``), so clients and
fuzzers generate only values the validators accept. :func:`kiln.serving.errors.allowed_methods` reads the
same patterns: a route whose parameter can never be a path's segment does not serve that path
(``/v1/judgments/compare`` is not a judgment ID), so its methods are not in that path's ``Allow``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Path

from kiln.adapter_names import MAX_ADAPTER_NAME_CHARS, NAME_RE
from kiln.evals.schemas import RUN_ID_RE as EVAL_RUN_ID_RE
from kiln.evals.schemas import SUITE_NAME_RE
from kiln.judgments.schemas import JUDGMENT_ID_RE
from kiln.openenv.schemas import RUN_ID_RE as OPENENV_RUN_ID_RE
from kiln.teachers.registry import ALIAS_RE
from kiln.training.schemas import JOB_ID_RE


def _anchored(pattern: re.Pattern[str] | str) -> str:
    text = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
    return "^" + text.removeprefix("^").removesuffix("$") + "$"


def _param(pattern: re.Pattern[str] | str, max_length: int, description: str) -> Any:
    return Path(description=description, json_schema_extra={"pattern": _anchored(pattern), "maxLength": max_length})


AdapterName = Annotated[str, _param(NAME_RE, MAX_ADAPTER_NAME_CHARS, "a stored adapter's name")]
JudgmentId = Annotated[str, _param(JUDGMENT_ID_RE, 20, "a judgment ID")]
SuiteName = Annotated[str, _param(SUITE_NAME_RE, 64, "an eval suite's name")]
EvalRunId = Annotated[str, _param(EVAL_RUN_ID_RE, 21, "an eval run ID")]
OpenEnvRunId = Annotated[str, _param(OPENENV_RUN_ID_RE, 22, "an OpenEnv run ID")]
TeacherAlias = Annotated[str, _param(ALIAS_RE, 128, "a registered teacher's alias")]
JobId = Annotated[str, _param(JOB_ID_RE, 20, "a training job ID")]


def path_param_patterns(route: Any) -> dict[str, re.Pattern[str]]:
    """``{parameter: compiled pattern}`` of the route's path parameters that publish one."""
    out: dict[str, re.Pattern[str]] = {}
    for param in getattr(getattr(route, "dependant", None), "path_params", ()):
        extra = getattr(param.field_info, "json_schema_extra", None)
        if isinstance(extra, dict) and isinstance(extra.get("pattern"), str):
            out[param.name] = re.compile(extra["pattern"])
    return out
