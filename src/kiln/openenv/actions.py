"""The policy's actions in an OpenEnv run: messages in, the model's answer (the action) out.

:class:`ActionGenerator` generates with the served engine (the run's ``policy_adapter`` or the base) under
the in-process generation contract (:mod:`kiln.runtime.chat_generation`); with ``constrained`` runs the
answer is decoded under a grammar compiled from the environment's action schema (less OpenEnv's optional
``metadata``, :func:`generation_schema`). The run service (:mod:`kiln.openenv.service`) plays episodes with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from kiln.errors import InvalidRequest, Unavailable
from kiln.openenv import episode as ep
from kiln.openenv.discovery import Discovery
from kiln.openenv.schemas import OpenEnvRunRequest
from kiln.runtime.chat_generation import Answer, ChatGeneration

if TYPE_CHECKING:
    from kiln.runtime.serving_engine import ServingEngine

ACTION_PROMPT = "\n\nReply with exactly one JSON object (the action) that matches this JSON schema:\n"


class ActionGenerator:
    """The engine, the server's serving settings and the OpenEnv limits; the grammar compiler, built once."""

    def __init__(self, engine: ServingEngine, serving: Any, cfg: Any):
        self.engine, self.serving, self.cfg = engine, serving, cfg
        self._compiler: Any = None

    def for_run(self, req: OpenEnvRunRequest,
                disc: Discovery) -> Callable[[list[dict[str, str]]], tuple[Answer, str | None]]:
        """The policy's generator: messages -> (its answer, the adapter revision that produced it).

        Actions follow the in-process generation contract (:mod:`kiln.runtime.chat_generation`): the run's
        ``chat_template_kwargs`` and ``thinking_token_budget``, the server's reasoning parser. Where the model may
        think, the answer reasons first: under the action grammar the span is opened after the prompt, so the
        grammar starts once the reasoning ends (or the budget closes it). The action is the answer after the
        span; the reasoning is kept beside it."""
        from kiln.runtime.sampling import SamplingParams

        grammar = self._grammar(generation_schema(disc.action_schema)) if req.constrained else None
        contract = ChatGeneration.for_engine(self.engine, self.serving, req.chat_template_kwargs,
                                             req.budget())
        counter = [0]

        def act(messages: list[dict[str, str]]) -> tuple[Answer, str | None]:
            counter[0] += 1
            base = contract.prompt_ids(messages)
            ids = contract.opening(base) if grammar is not None else base
            room = max(1, self.engine.config.max_model_len - len(ids))
            params = contract.constrain([SamplingParams(
                max_tokens=min(req.max_action_tokens, room), temperature=req.temperature,
                seed=(req.seed * 1_000_003 + counter[0]) % (2**63),
                constraint=None if grammar is None else self._compiler.matcher(grammar))], ids)
            try:
                out = self.engine.generate(ids, params, adapter=req.policy_adapter,
                                           timeout=self.cfg.generation_timeout_s)
            except TimeoutError as exc:
                raise Unavailable(str(exc), code="policy_timeout") from None
            answer = contract.split(out[0].text, ids)
            opened = self.engine.decode(ids[len(base):]) if len(ids) > len(base) else ""  # the span start appended
            return Answer(answer.content, answer.reasoning, opened + answer.text), out[0].adapter_revision

        return act

    def _grammar(self, schema: dict[str, Any]) -> str:
        from kiln.runtime.constrained import GrammarCompiler

        if self._compiler is None:
            tokens = self.engine.tokens
            config = getattr(getattr(self.engine, "loaded", None), "model", None)
            vocab = max(int(getattr(getattr(config, "config", None), "vocab_size", 0) or 0), tokens.vocab_size)
            self._compiler = GrammarCompiler(tokens.tokenizer, vocab, tokens.eos_ids)
        try:
            return self._compiler.json_schema(schema, "action_schema")
        except InvalidRequest as exc:
            raise ep.EnvironmentProtocolError(f"the action schema cannot be compiled for constrained decoding: "
                                              f"{exc.message}", code="action_schema_unsupported",
                                              hint="run with constrained=false") from None


def generation_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema actions are decoded under: the action schema without OpenEnv's optional ``metadata``.

    Every OpenEnv ``Action`` inherits a free-form ``metadata`` object; it is bookkeeping, not the
    policy's decision, and under a grammar a row could spend all its tokens inside it. The
    complete schema still validates every action before it is sent.
    """
    props = schema.get("properties")
    if isinstance(props, dict) and "metadata" in props and "metadata" not in (schema.get("required") or []):
        return {**schema, "properties": {k: v for k, v in props.items() if k != "metadata"}}
    return schema
