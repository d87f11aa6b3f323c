"""Rewards for GRPO with rollouts: an eval scorer, a sandboxed Python file, or an HTTP endpoint on loopback.

:func:`build_reward` validates a request's ``reward`` against its prompts before the job is queued
(every refusal is a 400 :class:`~kiln.errors.InvalidRequest`) and returns a :class:`RewardFn` the
rollout loop calls once per iteration with every ``(prompt index, completion text)`` of that iteration (with a
reasoning parser in force, the completion is the answer after the reasoning span: a reward reads the reasoning
only when it asks for it, as the ``http`` reward does in its items' ``reasoning``).

* ``scorer``: an eval scorer (:mod:`kiln.evals.scorers`) against the prompt's ``reference``;
  reward 1.0 when it passes, else 0.0. The ``judge`` scorer asks a model served by this engine (the
  base model, or a loaded adapter pinned at its current revision) with the scorer's rubric, greedy,
  exactly as evals do (:func:`kiln.evals.scorers.judge_prompt` / ``judge_verdict``); it runs between
  the job's optimizer steps, while the engine serves.
* ``python``: a file under the data dir (opened like ``dataset_path``: no ``..``, no symlinks)
  defining ``reward(messages, completion, reference) -> float``; it runs in the evals sandbox
  (:mod:`kiln.evals.sandbox`: Landlock, no network, rlimits, wall-clock kill), one process per
  scoring batch, and only when ``eval.allow_code_execution = true``. The file's SHA-256 is bound into
  the plan digest.
* ``http``: ``POST {"items": [{"prompt_index", "messages", "completion", "reasoning", "reference"}]}`` to a URL
  whose host is a loopback IP literal; the answer must be ``{"rewards": [float, ...]}`` (one per item).
  No redirects, no proxy settings from the environment, a timeout and a response byte cap.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import InvalidRequest
from kiln.training.schemas import (
    MAX_ABS_REWARD,
    HTTPReward,
    PythonReward,
    RolloutPrompt,
    ScorerReward,
)

MAX_REWARD_FILE_BYTES = 1024 * 1024
JUDGE_TIMEOUT_S = 120.0  # one judge verdict
JUDGE_CONCURRENCY = 16  # judge rows in flight at once (the engine batches them)
PYTHON_BATCH = 512  # items per sandbox process (its stdout is capped at 64 KiB)
_MARKER = "KILN_REWARDS "
# Scorers that compare against the reference (regex only when its pattern uses {reference}).
_NEEDS_REFERENCE = frozenset({"exact", "contains", "numeric", "choice", "code"})

_HARNESS = '''

def _kiln_main():
    import json as _json
    items = _json.loads({payload!r})
    out = []
    for messages, completion, reference in items:
        value = float(reward(messages, completion, reference))
        out.append(value)
    print("\\n{marker}" + _json.dumps(out))

_kiln_main()
'''


class RewardError(RuntimeError):
    """The reward could not be computed (the job fails with this message)."""


def _refuse(message: str, code: str, hint: str = "") -> InvalidRequest:
    return InvalidRequest(message, code=code, hint=hint, param="reward")


@dataclass
class RewardFn:
    """Scores one iteration's completions; ``describe`` is recorded in the job's plan and result."""

    kind: str
    score_batch: Callable[[Sequence[tuple[int, str]]], list[float]]
    describe: dict[str, Any] = field(default_factory=dict)
    reads_reasoning: bool = False  # score_batch also takes each completion's reasoning (the http reward)

    def __call__(self, items: Sequence[tuple[int, str]], reasoning: Sequence[str | None] | None = None) -> list[float]:
        """Rewards for ``(prompt index, answer)`` items; ``reasoning`` (one per item) goes to a reward that
        reads it, never into the answer."""
        if self.reads_reasoning:
            out = self.score_batch(items, reasoning or [None] * len(items))  # type: ignore[call-arg]
        else:
            out = self.score_batch(items)
        if len(out) != len(items):
            raise RewardError(f"the {self.kind} reward returned {len(out)} values for {len(items)} completions")
        for v in out:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                    or abs(v) > MAX_ABS_REWARD:
                raise RewardError(f"the {self.kind} reward returned {v!r}; rewards are finite numbers within "
                                  f"+-{MAX_ABS_REWARD:g}")
        return [float(v) for v in out]


def build_reward(spec: ScorerReward | PythonReward | HTTPReward, prompts: Sequence[RolloutPrompt], *,
                 data_dir: Any, allow_code_execution: bool, engine: Any = None, judge_contract: Any = None
                 ) -> RewardFn:
    """``judge_contract`` (:class:`~kiln.runtime.chat_generation.ChatGeneration`, the server's defaults): how a
    judge's prompt is rendered and its verdict read (after its reasoning)."""
    if isinstance(spec, ScorerReward):
        from kiln.evals.schemas import JudgeScorer

        if isinstance(spec.scorer, JudgeScorer):
            return _judge_reward(spec.scorer, prompts, engine, judge_contract)
        return _scorer_reward(spec, prompts, allow_code_execution=allow_code_execution)
    if isinstance(spec, PythonReward):
        return _python_reward(spec, prompts, data_dir=data_dir, allow_code_execution=allow_code_execution)
    return _http_reward(spec, prompts)


# ------------------------------------------------------------------------------------ scorer


def _scorer_reward(spec: ScorerReward, prompts: Sequence[RolloutPrompt], *, allow_code_execution: bool) -> RewardFn:
    from kiln.evals import schemas as es
    from kiln.evals.sandbox import run_python
    from kiln.evals.scorers import Scorers, validate_suite

    scorer = spec.scorer
    needs = scorer.type in _NEEDS_REFERENCE or (isinstance(scorer, es.RegexScorer) and "{reference}" in scorer.pattern)
    if needs:
        missing = [i for i, p in enumerate(prompts) if p.reference is None]
        if missing:
            raise _refuse(f"the {scorer.type} scorer needs a reference; prompt(s) {missing[:10]} have none",
                          "missing_reference", "give every prompt a `reference`")
    examples = [es.EvalExample(messages=[es.ChatMessage(role=m.role, content=m.content) for m in p.messages],
                               reference=p.reference or "") for p in prompts]
    suite = es.SuiteSpec(name="grpo-reward", examples=examples, scorers=[scorer])
    validate_suite(suite, allow_code_execution=allow_code_execution)  # regexes compile, schemas valid...
    scorers = Scorers(suite, allow_code_execution=allow_code_execution, sandbox=run_python)

    def score(items: Sequence[tuple[int, str]]) -> list[float]:
        return [1.0 if scorers.score(0, scorer, text, examples[i]).passed else 0.0 for i, text in items]

    return RewardFn("scorer", score, {"type": "scorer", "scorer": scorer.type})


# ------------------------------------------------------------------------------------ judge


def _judge_reward(spec: Any, prompts: Sequence[RolloutPrompt], engine: Any, contract: Any = None) -> RewardFn:
    from concurrent.futures import ThreadPoolExecutor

    from kiln.evals.scorers import judge_prompt, judge_verdict
    from kiln.runtime.sampling import SamplingParams

    if engine is None:
        raise _refuse("the judge reward needs the serving engine", "unsupported_reward_scorer")
    from kiln.evals.judge_preference import served_judge_revision

    adapter = None if spec.judge is None else spec.judge.adapter
    revision = served_judge_revision(engine, adapter, param="reward.scorer.judge")
    if spec.judge is not None and spec.judge.revision is not None and spec.judge.revision != revision:
        raise InvalidRequest(f"judge adapter {adapter!r} is loaded at revision {revision[:12]}, not "
                             f"{spec.judge.revision[:12]}", code="judge_revision_mismatch",
                             param="reward.scorer.judge.revision")
    if spec.mode == "preference":
        return _preference_reward(prompts, engine, adapter, revision)
    if "{reference}" in spec.rubric:
        missing = [i for i, p in enumerate(prompts) if p.reference is None]
        if missing:
            raise _refuse(f"the judge's rubric uses {{reference}}; prompt(s) {missing[:10]} have none",
                          "missing_reference", "give every prompt a `reference` or a rubric without {reference}")
    questions = [next((m.content for m in reversed(p.messages) if m.role == "user"), "") for p in prompts]
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0)

    def one(item: tuple[int, str]) -> float:
        i, text = item
        msgs = [{"role": "user", "content": judge_prompt(spec, questions[i], prompts[i].reference or "", text)}]
        ids = contract.prompt_ids(msgs) if contract is not None else engine.encode_chat(msgs)
        try:
            out = engine.generate(ids, contract.constrain([params], ids) if contract is not None else params,
                                  adapter=adapter, timeout=JUDGE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001  (engine stopped, timeout, adapter unloaded: the job fails)
            raise RewardError(f"the judge failed: {type(exc).__name__}: {exc}") from None
        verdict = contract.split(out[0].text, ids).content if contract is not None else out[0].text
        return 1.0 if judge_verdict(verdict).passed else 0.0  # a thinking judge's verdict is in its answer

    def score(items: Sequence[tuple[int, str]]) -> list[float]:
        if adapter is not None and engine.active_adapters().get(adapter) != revision:
            raise RewardError(f"judge adapter {adapter!r} changed or was unloaded during the job")
        with ThreadPoolExecutor(JUDGE_CONCURRENCY) as pool:  # concurrent rows: the engine batches them
            return list(pool.map(one, items))

    return RewardFn("scorer", score, {"type": "scorer", "scorer": "judge", "judge": adapter,
                                      "judge_revision": revision, "max_tokens": spec.max_tokens,
                                      "rubric_sha256": hashlib.sha256(spec.rubric.encode()).hexdigest()})


def _preference_reward(prompts: Sequence[RolloutPrompt], engine: Any, adapter: str | None,
                       revision: str | None) -> RewardFn:
    """Reward = P(completion better than the prompt's reference) from a judge adapter's A/B logprobs
    (:mod:`kiln.evals.judge_preference`, both orders averaged): a value in [0, 1], no sampling."""
    from kiln.evals.judge_format import PREFERENCE_FORMAT
    from kiln.adapters.scope import last_user_text
    from kiln.evals.judge_preference import preferences

    missing = [i for i, p in enumerate(prompts) if not (p.reference or "").strip()]
    if missing:
        raise _refuse(f"a preference judge compares each completion with the prompt's reference; prompt(s) "
                      f"{missing[:10]} have none", "missing_reference", "give every prompt a `reference`")
    questions = [last_user_text(p.messages) for p in prompts]

    def score(items: Sequence[tuple[int, str]]) -> list[float]:
        if adapter is not None and engine.active_adapters().get(adapter) != revision:
            raise RewardError(f"judge adapter {adapter!r} changed or was unloaded during the job")
        try:
            prefs = preferences(engine, adapter, [(questions[i], text, prompts[i].reference or "")
                                                  for i, text in items], timeout=JUDGE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001  (engine stopped, timeout, adapter unloaded: the job fails)
            raise RewardError(f"the judge failed: {type(exc).__name__}: {exc}") from None
        return [p.p_first for p in prefs]

    return RewardFn("scorer", score, {"type": "scorer", "scorer": "judge", "mode": "preference", "judge": adapter,
                                      "judge_revision": revision, "format": PREFERENCE_FORMAT})


# ------------------------------------------------------------------------------------ python file


def _python_reward(spec: PythonReward, prompts: Sequence[RolloutPrompt], *, data_dir: Any,
                   allow_code_execution: bool) -> RewardFn:
    from kiln.evals.sandbox import landlock_abi, run_python
    from kiln.training.core.data import open_dataset

    if not allow_code_execution:
        raise _refuse("Python reward files are disabled on this server", "code_execution_disabled",
                      "set eval.allow_code_execution = true (KILN_EVAL_ALLOW_CODE_EXECUTION=1); the file runs "
                      "in the evals sandbox")
    try:
        fd = open_dataset(data_dir, spec.path)  # confined to the data dir, no symlinks, regular file
    except InvalidRequest as exc:
        raise type(exc)(str(exc.message).replace("dataset_path", "reward.path"), code=exc.code,
                        hint=exc.hint, param="reward.path") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_REWARD_FILE_BYTES + 1)
    if len(raw) > MAX_REWARD_FILE_BYTES:
        raise _refuse(f"reward file is larger than {MAX_REWARD_FILE_BYTES} bytes", "reward_file_too_large")
    try:
        source = raw.decode("utf-8")
        code = compile(source, spec.path, "exec")
    except (UnicodeDecodeError, SyntaxError, ValueError) as exc:
        raise _refuse(f"reward file {spec.path!r} is not valid Python: {exc}", "invalid_reward_file") from None
    if "reward" not in code.co_names:
        raise _refuse(f"reward file {spec.path!r} defines no `reward` function", "invalid_reward_file",
                      "define reward(messages, completion, reference) -> float")
    if landlock_abi() < 1:
        raise _refuse("the code sandbox is unavailable on this host (no Landlock)", "sandbox_unavailable")
    sha = hashlib.sha256(raw).hexdigest()
    msgs = [[m.model_dump() for m in p.messages] for p in prompts]
    refs = [p.reference for p in prompts]

    def score(items: Sequence[tuple[int, str]]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(items), PYTHON_BATCH):
            chunk = [[msgs[i], text, refs[i]] for i, text in items[start:start + PYTHON_BATCH]]
            harness = _HARNESS.format(payload=json.dumps(chunk), marker=_MARKER)
            res = run_python(source + "\n" + harness, timeout_s=spec.timeout_s, memory_mb=spec.memory_mb)
            if not res.passed:
                raise RewardError(f"reward file {spec.path!r} failed in the sandbox: {res.detail}")
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith(_MARKER)]
            if not lines:
                raise RewardError(f"reward file {spec.path!r} printed no rewards (its output is capped at 64 KiB)")
            try:
                values = json.loads(lines[-1][len(_MARKER):])
            except ValueError:
                raise RewardError(f"reward file {spec.path!r}: unreadable rewards line") from None
            out.extend(values)
        return out

    return RewardFn("python", score, {"type": "python", "path": spec.path, "sha256": sha})


# ------------------------------------------------------------------------------------ HTTP


def check_loopback_url(url: str) -> str:
    """``url`` if it is ``http(s)://<loopback IP literal>[:port]/path`` with no credentials; else a 400."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise _refuse(f"reward URL {url!r} does not parse", "invalid_reward_url") from None
    if parsed.scheme not in ("http", "https"):
        raise _refuse(f"reward URL scheme {parsed.scheme!r} is not http(s)", "invalid_reward_url")
    if parsed.userinfo:
        raise _refuse("reward URLs carry no credentials", "invalid_reward_url")
    host = parsed.host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None or not ip.is_loopback:
        raise _refuse(f"reward URL host {parsed.host!r} is not a loopback IP address", "reward_url_not_loopback",
                      "run the reward service on this machine and use http://127.0.0.1:PORT/... (a name such as "
                      "localhost is refused: it is resolved outside Kiln's control)")
    return url


def _http_reward(spec: HTTPReward, prompts: Sequence[RolloutPrompt]) -> RewardFn:
    url = check_loopback_url(spec.url)
    msgs = [[m.model_dump() for m in p.messages] for p in prompts]

    def score(items: Sequence[tuple[int, str]], reasoning: Sequence[str | None]) -> list[float]:
        import httpx

        body = {"items": [{"prompt_index": i, "messages": msgs[i], "completion": text, "reasoning": r,
                           "reference": prompts[i].reference} for (i, text), r in zip(items, reasoning)]}
        try:
            with httpx.Client(trust_env=False, follow_redirects=False, timeout=spec.timeout_s) as client, \
                    client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    raise RewardError(f"reward endpoint answered HTTP {r.status_code} (redirects are not "
                                      "followed)")
                buf = bytearray()
                deadline = time.monotonic() + spec.timeout_s  # httpx's timeout is per read, not in total
                for chunk in r.iter_bytes():
                    if time.monotonic() > deadline:
                        raise RewardError(f"reward endpoint did not answer within {spec.timeout_s:g} s")
                    buf.extend(chunk)
                    if len(buf) > spec.max_response_bytes:
                        raise RewardError(f"reward endpoint answered more than {spec.max_response_bytes} bytes")
        except httpx.HTTPError as exc:
            raise RewardError(f"reward endpoint {url}: {type(exc).__name__}: {exc}") from None
        try:
            data = json.loads(bytes(buf))
        except ValueError:
            raise RewardError("reward endpoint answered something other than JSON") from None
        values = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(values, list):
            raise RewardError('reward endpoint must answer {"rewards": [number, ...]}')
        return values

    return RewardFn("http", score, {"type": "http", "url": url}, reads_reasoning=True)
