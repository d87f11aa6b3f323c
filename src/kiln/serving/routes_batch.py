"""``POST /v1/completions/batch``: a bounded set of prompts, one aggregated response.

The batch runs as one ordinary text completion of all its prompts (``completion_response`` in
:mod:`kiln.serving.routes_completions`), so its rows go through the same admission, scheduler, adapter
resolution (one adapter revision for the whole batch, in ``x-kiln-adapter-revision``), memory accounting,
timeout and cancellation (a client that disconnects cancels every row of the batch) as any generation
request. Only the shape differs: results grouped per prompt, each with its own ``n`` choices, indexed
from 0 within the prompt. ``limits.max_batch_prompts`` bounds the prompts; streaming is refused.
"""

from __future__ import annotations

import json
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from kiln.errors import InvalidRequest
from kiln.serving.openai_responses import BatchCompletionResponse
from kiln.serving.protocol import BatchCompletionRequest, CompletionRequest
from kiln.serving.routes_completions import completion_response
from kiln.serving.state import get_state

router = APIRouter()


@router.post("/v1/completions/batch", response_model=BatchCompletionResponse)
async def completions_batch(body: BatchCompletionRequest, request: Request) -> Response:
    """Complete every prompt (``n`` choices each) and answer once with all results, grouped per prompt."""
    state = get_state(request)
    limit = state.settings.limits.max_batch_prompts
    if len(body.prompts) > limit:
        raise InvalidRequest(f"{len(body.prompts)} prompts exceed limits.max_batch_prompts={limit}",
                             code="limit_exceeded", param="prompts", hint="split the batch")
    if body.stream:
        raise InvalidRequest("stream is not supported on /v1/completions/batch", code="invalid_request",
                             param="stream", hint="send stream=false, or stream each prompt on /v1/completions")
    fields = {k: getattr(body, k) for k in body.model_fields_set if k != "prompts"}  # models stay models
    # validated already; the prompt list may mix strings and token-ID lists, which completion_response reads alike
    single = CompletionRequest.model_construct(**fields, prompt=cast(Any, list(body.prompts)))
    answer = await completion_response(state, single, request.receive)
    done = json.loads(cast(bytes, answer.body))  # a JSONResponse's body: bytes
    n = body.n
    results = [{"index": p, "choices": [
        {"index": c["index"] - p * n, "text": c["text"], "logprobs": c["logprobs"], "finish_reason": c["finish_reason"]}
        for c in done["choices"][p * n:(p + 1) * n]]} for p in range(len(body.prompts))]
    headers = {k: v for k, v in answer.headers.items() if k.startswith("x-")}
    return JSONResponse({  # BatchCompletionResponse
        "id": done["id"].replace("cmpl-", "cmplb-", 1), "object": "text_completion.batch", "created": done["created"],
        "model": done["model"], "system_fingerprint": done["system_fingerprint"], "results": results,
        "usage": done["usage"]}, headers=headers)
