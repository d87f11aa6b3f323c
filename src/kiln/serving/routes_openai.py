"""OpenAI-compatible endpoints: the router that gathers them, ``/v1/models``, ``/tokenize``, ``/detokenize``.

The generation routes live in their own modules: ``/v1/chat/completions`` in
:mod:`kiln.serving.routes_chat`, ``/v1/completions`` (and prompt scoring) in
:mod:`kiln.serving.routes_completions`; both prepare a request with :mod:`kiln.serving.prepare`
(rendering in :mod:`kiln.serving.render`), submit and collect it with :mod:`kiln.serving.generation`
and stream it with :mod:`kiln.serving.sse`.
:data:`FAST_ROUTES` is the table :class:`kiln.serving.fast_path.FastRoutes` serves ahead of FastAPI.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from kiln.serving import routes_chat, routes_completions
from kiln.serving.fast_path import FastRoute
from kiln.serving.openai_responses import DetokenizeResponse, ModelCard, ModelList, ModelPermission, TokenizeResponse
from kiln.serving.prepare import resolve_model
from kiln.serving.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from kiln.serving.render import chat_text
from kiln.serving.request_params import check_token_ids
from kiln.serving.state import get_state

router = APIRouter()

# The generation routes, served by kiln.serving.fast_path ahead of FastAPI's routing (their FastAPI
# routes stay for the OpenAPI schema and for requests the fast path hands on).
FAST_ROUTES: dict[str, FastRoute] = {**routes_chat.routes.table, **routes_completions.routes.table}
# The OpenAI-compatible surface, in the order the OpenAPI document lists it (each router's routes are
# added to the app directly: the request metrics match each route's own template).
ROUTERS = (router, routes_chat.router, routes_completions.router)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    created = int(state.started_at)
    limit = state.engine.config.max_model_len
    def perm(model_id: str) -> list[ModelPermission]:
        return [ModelPermission(id=f"modelperm-{model_id}", created=created)]

    family = getattr(state.model, "family", None)
    cards = [ModelCard(id=state.model_id, created=created, root=state.model_id, max_model_len=limit,
                       base_model_sha256=state.model.base_model_sha256, permission=perm(state.model_id),
                       model_family=family.as_dict() if family is not None else None)]
    for name, rev in state.engine.active_adapters().items():
        cards.append(ModelCard(id=name, created=created, root=name, parent=state.model_id, max_model_len=limit,
                               base_model_sha256=state.model.base_model_sha256, revision=rev, permission=perm(name)))
    return ModelList(data=cards)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> TokenizeResponse:
    """vLLM's ``/tokenize``: a prompt's (or rendered chat's) token IDs, as generation would see them."""
    state = get_state(request)
    if body.model is not None:
        resolve_model(state, body.model)
    tok = state.engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        text = await chat_text(state, body.messages, body.add_generation_prompt,
                                       [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                                       body.chat_template_kwargs)
    else:
        text = body.prompt
    ids = await asyncio.to_thread(lambda: list(tok(text, add_special_tokens=body.add_special_tokens)["input_ids"]))
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.config.max_model_len, tokens=ids,
                            token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """vLLM's ``/detokenize``: token IDs back to text."""
    state = get_state(request)
    if body.model is not None:
        resolve_model(state, body.model)
    check_token_ids(state, body.tokens, "tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(state.engine.decode, list(body.tokens)))
