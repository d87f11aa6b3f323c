"""Issue item 3 (verify): a bounded schemathesis run against a live server finds no 5xx and no undocumented
status, media type or body.

Bounds: ``--max-examples 10`` per operation, positive and negative cases (``--mode all``, the
default), phases examples + coverage + fuzzing + stateful (about 3,500 cases, 1-2 min on two shared
cores). Skipped operations:

* ``POST /v1/train/sft``, ``/v1/train/grpo``, ``/v1/train/opd`` and ``/v1/train/kd``: a valid random body queues a real
  training job (minutes of CPU each); their responses are checked in ``test_schemas.py``.
* ``POST /v1/openenv/runs``: a valid random body starts a run (episodes on a loopback environment, then a
  GRPO job); its responses are checked in ``test_schemas.py`` and tests/openenv.

Adapter deletion runs: the server's store is empty, so it can only answer 404/400.

One worker, fixed seed: the generated cases are then the same on every run (2,216 requests here). With two
workers the thread interleaving changed the draws, and one run in several hit CPython 3.11.7's
"AST constructor recursion depth mismatch" inside hypothesis's lambda descriptions (a tool crash, not a
server error) and failed the test.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.security.fuzz_refusals import cannot_state, recorded_failures
from tests.security.openapi_check import fetch_checker

ST = Path(sys.executable).with_name("st")
MAX_EXAMPLES = 10
RUN_TIMEOUT_S = 240
EXCLUDE = r"^/v1/(train/(sft|grpo|opd|kd)$|openenv/runs$)"
# 5xx are judged below from the recorded exchanges instead of by schemathesis' not_a_server_error: two
# operations contact an upstream the request names (a teacher URL, an environment URL, both on loopback),
# and a fuzzed loopback port with nothing listening is rightly a documented 503 "unreachable", not a fault.
CHECKS = "status_code_conformance,content_type_conformance,response_schema_conformance,positive_data_acceptance"
UPSTREAM_UNAVAILABLE = {
    ("POST", "/v1/teachers"): {"teacher_unreachable"},
    ("POST", "/v1/openenv/preflight"): {"environment_unavailable"},
}


@pytest.fixture(scope="module")
def fuzz_server(builtin_model_dir, tmp_path_factory):
    from tests.security.conftest import SECURE_ENV
    from tests.serving.conftest import start_server, stop_server

    home = tmp_path_factory.mktemp("kiln-fuzz-home")
    srv = start_server(builtin_model_dir, home, extra_args=["--threads", "1"], env_extra=SECURE_ENV, config=None)
    yield srv
    stop_server(srv)


def test_schemathesis_finds_no_5xx_and_no_undocumented_status(fuzz_server, tmp_path):
    if not ST.exists():
        pytest.fail(f"schemathesis is not installed ({ST}); pip install -e '.[dev]'")
    har, events = tmp_path / "run.har", tmp_path / "events.ndjson"
    cmd = [str(ST), "run", f"{fuzz_server.base_url}/openapi.json", "--max-examples", str(MAX_EXAMPLES),
           "--seed", "1", "--no-shrink", "--generation-database", "none", "--workers", "1",
           "--request-timeout", "30", "--checks", CHECKS, "--exclude-path-regex", EXCLUDE,
           "--phases", "examples,coverage,fuzzing,stateful", "--no-color", "--continue-on-failure",
           "--report", "har,ndjson", "--report-har-path", str(har), "--report-ndjson-path", str(events)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in entries:
        path = urlsplit(e["request"]["url"]).path
        statuses[f"{e['request']['method']} {_template(path)}"][e["response"]["status"]] += 1
    summary = {op: dict(sorted(c.items())) for op, c in sorted(statuses.items()) if set(c) != {405}}
    probes = sum(sum(c.values()) for c in statuses.values() if set(c) == {405})
    print(f"schemathesis: {len(entries)} requests over {len(summary)} operations "
          f"(+{probes} other-method probes, all 405)")
    for op, counts in summary.items():
        print(f"  {op}: {counts}")
    failures = recorded_failures(events)
    refused = [f for f in failures if f.check == "positive_data_acceptance"]
    assert not [f for f in failures if f not in refused], proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode in (0, 1), proc.stdout[-6000:] + proc.stderr[-2000:]  # 1: failures, judged here
    unexplained = judge_refusals(refused, fuzz_server.base_url)
    assert not unexplained, unexplained[:5]
    faults = [e for e in entries if e["response"]["status"] >= 500 and not _upstream_unavailable(e)]
    assert not faults, [(e["request"]["method"], e["request"]["url"], e["response"]["status"],
                         e["response"]["content"].get("text", "")[:300]) for e in faults[:5]]
    assert len(summary) >= 15, summary
    generation = statuses["POST /v1/chat/completions"] + statuses["POST /v1/completions"]
    assert generation[200] >= 2, generation  # the fuzzer reached the engine, not only the validators


def judge_refusals(refused: list, base_url: str) -> list:
    """The schema-valid inputs refused that no entry of ``SCHEMA_CANNOT_STATE`` explains (printed by reason)."""
    checker = fetch_checker(base_url)
    reasons: collections.Counter = collections.Counter()
    unexplained = []
    for f in refused:
        reason = "not schema-valid after all" if not f.schema_valid(checker) else cannot_state(f)
        reasons[reason or "UNEXPLAINED"] += 1
        if reason is None:
            unexplained.append((f.operation, f.status, f.code, f.message[:300]))
    print(f"positive_data_acceptance: {len(refused)} refusals of generated positive cases, "
          f"{len(unexplained)} unexplained")
    for reason, n in reasons.most_common():
        print(f"  {n:4d} {reason}")
    return unexplained


def _upstream_unavailable(entry: dict) -> bool:
    """A 503 from an operation that contacted the upstream its request named, saying it is unreachable."""
    codes = UPSTREAM_UNAVAILABLE.get((entry["request"]["method"], urlsplit(entry["request"]["url"]).path))
    if codes is None or entry["response"]["status"] != 503:
        return False
    try:
        return json.loads(entry["response"]["content"].get("text", ""))["error"]["code"] in codes
    except (ValueError, KeyError, TypeError):
        return False


def _template(path: str) -> str:
    parts = path.split("/")
    if len(parts) > 3 and parts[2] in ("adapters",) and parts[3] != "merge":
        parts[3] = "{name}"
    if len(parts) > 4 and parts[2] == "train" and parts[3] in ("jobs", "queue"):
        parts[4] = "{job_id}"
    return "/".join(parts)
