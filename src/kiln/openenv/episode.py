"""One OpenEnv episode over the ``/ws`` session socket, strictly lock-step.

OpenEnv has no correlation IDs, so the client sends one message and reads exactly one
answer before it sends the next. An exchange that times out, an unreadable frame or an
answer of the wrong type poisons the session: no safe resynchronisation exists, so the
socket is closed and never used again. Ping control frames are answered by the
``websockets`` connection's own I/O thread while the policy is generating.

A ``CAPACITY_REACHED`` answer to the first reset ends that socket, not the episode:
:func:`open_episode` backs off and opens a fresh socket (health check first) until the
capacity deadline. Generated actions are validated against the compiled action schema
before anything is written: an invalid one ends the episode as ``invalid_model_action``
and is never sent.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.canonical import canonical_json, strict_json_loads
from kiln.errors import KilnError, PayloadTooLarge
from kiln.openenv.discovery import (
    EnvironmentProtocolError,
    EnvironmentUnavailable,
    action_errors,
    check_health,
    ws_url,
)
from kiln.runtime.chat_generation import Answer

DONE = "done"
MAX_STEPS = "max_steps"
INVALID_ACTION = "invalid_model_action"
PROTOCOL_ERROR = "protocol_error"
TERMINATIONS = (DONE, MAX_STEPS, INVALID_ACTION, PROTOCOL_ERROR)

CAPACITY_BACKOFF_S = (0.05, 2.0)  # first wait, cap (doubling)
CLOSE_TIMEOUT_S = 2.0


class SessionPoisoned(EnvironmentProtocolError):
    code = "session_poisoned"


class FrameTooLarge(PayloadTooLarge):
    code = "environment_frame_too_large"
    default_hint = "the environment sent a WebSocket frame over [openenv] max_frame_bytes; raise it if the environment is trusted"


class RolloutBudgetExceeded(PayloadTooLarge):
    code = "rollout_budget_exceeded"
    default_hint = "the run retained more than [openenv] max_rollout_bytes; use fewer groups, candidates or steps"


class CapacityTimeout(EnvironmentUnavailable):
    code = "environment_capacity_timeout"
    default_hint = "the environment stayed at CAPACITY_REACHED past [openenv] capacity_wait_s; raise its max_concurrent_envs"


class Cancelled(KilnError):
    status = 409
    code = "cancelled"


class _Capacity(Exception):
    pass


class Budget:
    """One aggregate byte budget for everything a run retains (resets, actions, observations)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def charge(self, n: int) -> None:
        with self._lock:
            if self.used + n > self.limit:
                raise RolloutBudgetExceeded(f"retaining {n} more bytes would exceed the {self.limit}-byte rollout budget")
            self.used += n


class Session:
    """One ``/ws`` connection: ``exchange`` sends one message and returns its one answer."""

    def __init__(self, base_url: str, *, max_frame_bytes: int, timeout_s: float, http: Any, discovery_cap: int):
        from websockets.sync.client import connect

        check_health(http, base_url, discovery_cap)  # readiness, repeated before every upgrade
        try:
            self._ws = connect(ws_url(base_url), max_size=max_frame_bytes, compression=None, proxy=None,
                               open_timeout=timeout_s, close_timeout=CLOSE_TIMEOUT_S,
                               ping_interval=None).__enter__()
        except Exception as exc:
            raise EnvironmentUnavailable(f"cannot open {ws_url(base_url)}: {exc}") from None
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.poisoned: str | None = None
        self.closed = False

    def exchange(self, message: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Send ``message``; return the parsed answer (``type`` observation or error) and its size in bytes."""
        from websockets.exceptions import ConnectionClosed

        if self.poisoned is not None:
            raise SessionPoisoned(f"the session is poisoned ({self.poisoned}); it cannot be used again")
        unsent = False
        try:
            try:
                self._ws.send(json.dumps(message, separators=(",", ":")))
            except ConnectionClosed:
                unsent = True  # the server may have answered and closed first (CAPACITY_REACHED): read it
            raw = self._ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            self._poison(f"no answer within {self.timeout_s} s")
        except ConnectionClosed as exc:
            codes = {getattr(exc.sent, "code", None), getattr(exc.rcvd, "code", None)}
            if 1009 in codes:
                self.poisoned, self.closed = "frame too large", True
                raise FrameTooLarge(f"the environment sent a frame over {self.max_frame_bytes} bytes") from None
            self._poison(f"connection closed: {exc}", close=False)
        if not isinstance(raw, str):
            self._poison("binary frame (OpenEnv answers with text frames)")
        try:
            answer = strict_json_loads(raw)
        except ValueError as exc:
            self._poison(f"unreadable frame: {exc}")
        if not isinstance(answer, dict) or answer.get("type") not in ("observation", "error") \
                or not isinstance(answer.get("data"), dict):
            self._poison(f"unexpected answer type {answer.get('type') if isinstance(answer, dict) else type(answer).__name__!r}")
        if unsent and answer["type"] != "error":
            self._poison("an observation arrived for a message the closed socket never sent")
        return answer, len(raw.encode("utf-8"))

    def _poison(self, why: str, *, close: bool = True) -> Any:
        self.poisoned = why
        if close:
            self.close(polite=False)
        self.closed = True
        raise SessionPoisoned(f"OpenEnv session poisoned: {why}")

    def close(self, *, polite: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if polite and self.poisoned is None:
                self._ws.send(json.dumps({"type": "close"}))
            self._ws.close()
        except Exception:
            pass


def as_completion(episode: Episode) -> dict[str, Any]:
    """The episode as one GRPO completion: the first action as ``text``, every later action with the
    observation before it as a ``turn``, the episode return as the reward (every action is trained). An action's
    text is its whole generation, reasoning included (the advantage covers the whole completion)."""
    texts = episode.completions or episode.actions
    out: dict[str, Any] = {"text": texts[0] if texts else "", "reward": episode.episode_return}
    if len(texts) > 1:
        out["turns"] = [{"observation": o, "text": a} for o, a in zip(episode.observations, texts[1:])]
    return out


@dataclass
class Episode:
    seed: int
    reset_observation: dict[str, Any]
    termination: str = ""
    episode_return: float = 0.0
    steps: int = 0
    actions: list[str] = field(default_factory=list)  # the actions' texts (the answers after any reasoning), in order
    reasoning: list[str | None] = field(default_factory=list)  # per action: the reasoning before it (None: none)
    completions: list[str] = field(default_factory=list)  # per action: the whole generated text, reasoning included
    policies: list[dict[str, Any]] = field(default_factory=list)  # per action: {"adapter", "revision"} that produced it
    observations: list[str] = field(default_factory=list)  # the user turn after each action that did not end it
    exchanges: list[dict[str, Any]] = field(default_factory=list)  # {"action", "result"} per step sent
    error: dict[str, Any] | None = None


def _reward(data: dict[str, Any]) -> float:
    r = data.get("reward")
    if r is None:
        return 0.0
    if isinstance(r, bool):
        return float(r)
    if not isinstance(r, (int, float)) or not math.isfinite(r):
        raise SessionPoisoned(f"the environment's reward {r!r} is not a finite number")
    return float(r)


def open_episode(open_session: Callable[[], Session], reset: dict[str, Any], *, capacity_wait_s: float,
                 cancelled: Callable[[], bool], budget: Budget) -> tuple[Session, dict[str, Any]]:
    """A fresh session and its reset answer's data; CAPACITY_REACHED backs off until the deadline."""
    deadline = time.monotonic() + capacity_wait_s
    wait = CAPACITY_BACKOFF_S[0]
    while True:
        if cancelled():
            raise Cancelled("the run was cancelled")
        session = open_session()
        try:
            answer, size = session.exchange({"type": "reset", "data": reset})
        except BaseException:
            session.close(polite=False)
            raise
        if answer["type"] == "observation":
            budget.charge(size)
            return session, answer["data"]
        session.close(polite=False)
        if answer["data"].get("code") != "CAPACITY_REACHED":
            raise EnvironmentProtocolError(f"reset failed: {str(answer['data'].get('message'))[:300]}",
                                           code="environment_reset_failed")
        if time.monotonic() + wait > deadline:
            raise CapacityTimeout(f"the environment stayed at capacity for {capacity_wait_s} s")
        time.sleep(wait)
        wait = min(wait * 2, CAPACITY_BACKOFF_S[1])


def extract_action(text: str) -> Any:
    """The JSON value the completion holds (whole text, else the first ``{...}`` object in it)."""
    stripped = text.strip()
    try:
        return strict_json_loads(stripped)
    except ValueError:
        pass
    start = stripped.find("{")
    if start < 0:
        raise ValueError("no JSON object in the completion")
    value, _ = json.JSONDecoder().raw_decode(stripped[start:])
    return value


def play(session: Session, episode: Episode, policy: Callable[[list[dict[str, str]]], Any],
         messages: list[dict[str, str]], *, validator: Any, max_steps: int, protocol_error_reward: float,
         budget: Budget, render: Callable[[dict[str, Any]], str],
         cancelled: Callable[[], bool] = lambda: False) -> Episode:
    """Run ``episode`` to termination on ``session`` (already reset); the session is closed at the end.
    ``policy(messages)`` answers with a :class:`~kiln.runtime.chat_generation.Answer` (the action is its content) or
    with the action's text.
    ``cancelled`` is checked before every action (raises :class:`Cancelled`)."""
    try:
        obs = episode.reset_observation
        if obs.get("done"):
            episode.termination = DONE
            return episode
        while True:
            if episode.steps >= max_steps:
                episode.termination = MAX_STEPS
                return episode
            if cancelled():
                raise Cancelled("the run was cancelled")
            answer = policy(messages)
            if isinstance(answer, str):  # a policy without reasoning may answer with the action's text alone
                answer = Answer(answer, None, answer)
            text = answer.content
            budget.charge(len(answer.text.encode("utf-8")))
            episode.actions.append(text)
            episode.reasoning.append(answer.reasoning)
            episode.completions.append(answer.text)
            try:
                action = extract_action(text)
            except ValueError as exc:
                return _end(episode, INVALID_ACTION, protocol_error_reward, {"reason": "not_json", "message": str(exc)[:200]})
            errors = action_errors(validator, action)
            if errors:
                return _end(episode, INVALID_ACTION, protocol_error_reward, {"reason": "schema", "errors": errors})
            try:
                answer, size = session.exchange({"type": "step", "data": action})
                budget.charge(size)
                if answer["type"] == "error":
                    data = answer["data"]
                    return _end(episode, PROTOCOL_ERROR, protocol_error_reward,
                                {"code": str(data.get("code"))[:64], "message": str(data.get("message"))[:300]})
                obs = answer["data"]
                episode.exchanges.append({"action": action, "result": obs})
                episode.episode_return += _reward(obs)
            except SessionPoisoned as exc:
                return _end(episode, PROTOCOL_ERROR, protocol_error_reward, {"code": exc.code, "message": exc.message[:300]})
            episode.steps += 1
            if obs.get("done") is True:
                episode.termination = DONE
                return episode
            episode.observations.append(render(obs))
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": episode.observations[-1]}]
    finally:
        session.close()


def _end(episode: Episode, kind: str, reward: float, error: dict[str, Any]) -> Episode:
    episode.termination = kind
    episode.episode_return += reward
    episode.error = error
    return episode


def render_observation(data: dict[str, Any]) -> str:
    """The observation as the policy reads it: canonical JSON of its ``observation`` object."""
    obs = data.get("observation", data)
    return canonical_json(obs)
