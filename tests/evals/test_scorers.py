"""Deterministic scorers, suite validation, and the code sandbox (a malicious snippet can neither
write outside its working directory, reach the network, nor hang the worker)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kiln.errors import InvalidRequest
from kiln.evals import schemas as s
from kiln.evals.sandbox import landlock_abi, run_python
from kiln.evals.scorers import Scorers, validate_suite


def suite(scorer: dict, reference: str = "42", **extra) -> s.SuiteSpec:
    return s.SuiteSpec.model_validate({"name": "t", "examples": [
        {"messages": [{"role": "user", "content": "q"}], "reference": reference}], "scorers": [scorer], **extra})


def score(scorer: dict, completion: str, reference: str = "42", *, code: bool = False) -> bool:
    st = suite(scorer, reference)
    validate_suite(st, allow_code_execution=code)
    sc = Scorers(st, allow_code_execution=code, sandbox=run_python if code else None)
    return sc.score(0, st.scorers[0], completion, st.examples[0]).passed


def test_exact_normalisation_options():
    assert score({"type": "exact"}, "  Paris \n", "paris")
    assert not score({"type": "exact", "case_sensitive": True}, "paris", "Paris")
    assert not score({"type": "exact"}, "Paris.", "paris")
    assert score({"type": "exact", "strip_punctuation": True}, "Paris.", "paris")
    assert score({"type": "exact"}, "New   York", "new york")
    assert not score({"type": "exact", "collapse_whitespace": False}, "New   York", "new york")


def test_contains_regex_numeric():
    assert score({"type": "contains"}, "The answer is 42.", "42")
    assert score({"type": "regex", "pattern": r"^\d+$", "full_match": True}, "42")
    assert not score({"type": "regex", "pattern": r"\d+", "full_match": True}, "42 apples")
    assert score({"type": "regex", "pattern": r"answer: {reference}\b"}, "answer: 4.2", "4.2")
    assert not score({"type": "regex", "pattern": r"answer: {reference}\b"}, "answer: 4x2", "4.2")
    assert score({"type": "numeric"}, "it is 42", "42")
    assert score({"type": "numeric", "abs_tol": 0.5}, "about 42.4", "42")
    assert not score({"type": "numeric", "abs_tol": 0.1}, "about 42.4", "42")
    assert score({"type": "numeric", "rel_tol": 0.01}, "1,000.5", "1000")
    assert not score({"type": "numeric"}, "no number here", "42")


def test_regex_is_linear_time_and_bounded():
    # A classic catastrophic-backtracking pattern: RE2 answers at once.
    assert not score({"type": "regex", "pattern": r"(a+)+$"}, "a" * 5000 + "!")
    with pytest.raises(InvalidRequest) as err:
        validate_suite(suite({"type": "regex", "pattern": r"(a)\1"}), allow_code_execution=False)
    assert err.value.code == "invalid_regex"
    with pytest.raises(ValueError):
        suite({"type": "regex", "pattern": "a" * (s.MAX_PATTERN_CHARS + 1)})


def test_json_and_schema():
    assert score({"type": "json_valid"}, '{"a": 1}')
    assert not score({"type": "json_valid"}, "{a: 1}")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "$defs": {"x": {"type": "string"}}}
    assert score({"type": "json_schema", "json_schema": schema}, '{"a": 3}')
    assert not score({"type": "json_schema", "json_schema": schema}, '{"a": "3"}')
    local = {"$ref": "#/$defs/x", "$defs": {"x": {"type": "string"}}}
    assert score({"type": "json_schema", "json_schema": local}, '"ok"')
    for bad, code in (({"$ref": "https://example.com/s.json"}, "remote_ref"),
                      ({"type": "no-such-type"}, "invalid_json_schema")):
        with pytest.raises(InvalidRequest) as err:
            validate_suite(suite({"type": "json_schema", "json_schema": bad}), allow_code_execution=False)
        assert err.value.code == code


def test_multiple_choice():
    assert score({"type": "choice"}, "The answer is B.", "B")
    assert not score({"type": "choice"}, "I think C, not B", "B")
    assert not score({"type": "choice"}, "none of them", "B")
    with pytest.raises(InvalidRequest):
        validate_suite(suite({"type": "choice"}, "E"), allow_code_execution=False)


def test_code_scorer_needs_the_config_switch():
    with pytest.raises(InvalidRequest) as err:
        validate_suite(suite({"type": "code"}, "assert f() == 1"), allow_code_execution=False)
    assert err.value.code == "code_execution_disabled"


def test_suite_validation_before_running():
    with pytest.raises(ValueError):
        s.SuiteSpec.model_validate({"name": "../x", "examples": [{"messages": [{"role": "user", "content": "q"}]}],
                                    "scorers": [{"type": "exact"}]})
    with pytest.raises(ValueError):  # pass@k needs k >= 2 samples
        suite({"type": "exact"}, aggregation="pass@k")
    with pytest.raises(ValueError):  # several greedy samples would be identical
        suite({"type": "exact"}, generation={"samples": 3})
    with pytest.raises(ValueError):  # an assistant turn last is not a prompt
        s.SuiteSpec.model_validate({"name": "x", "examples": [{"messages": [{"role": "assistant", "content": "a"}]}],
                                    "scorers": [{"type": "exact"}]})


needs_landlock = pytest.mark.skipif(landlock_abi() < 1, reason="the code sandbox needs Linux Landlock")


@needs_landlock
def test_code_scorer_runs_tests():
    ref = "assert add(2, 3) == 5"
    assert score({"type": "code"}, "```python\ndef add(a, b):\n    return a + b\n```", ref, code=True)
    assert not score({"type": "code"}, "def add(a, b):\n    return a - b\n", ref, code=True)


@needs_landlock
def test_malicious_snippet_cannot_write_outside_its_dir(tmp_path):
    target = tmp_path / "escaped.txt"
    home_file = Path.home() / ".kiln-sandbox-escape"
    code = f"""
import os
wrote = []
for p in [{str(target)!r}, {str(home_file)!r}, "/tmp/kiln-sandbox-escape"]:
    try:
        with open(p, "w") as f:
            f.write("pwned")
        wrote.append(p)
    except OSError:
        pass
try:
    os.rename("candidate.py", {str(tmp_path / "moved.py")!r})
    wrote.append("rename")
except OSError:
    pass
open("inside.txt", "w").write("fine")  # inside the working directory is allowed
assert not wrote, wrote
"""
    res = run_python(code, timeout_s=10, memory_mb=256)
    assert res.passed, res
    assert not target.exists() and not home_file.exists() and not Path("/tmp/kiln-sandbox-escape").exists()
    assert not (tmp_path / "moved.py").exists()


@needs_landlock
def test_malicious_snippet_cannot_hang_the_worker():
    results = {}

    def worker():
        for name, code in (("busy", "while True: pass"), ("sleep", "import time\ntime.sleep(3600)"),
                           ("children", "import os, time\nos.fork() if hasattr(os, 'fork') else None\ntime.sleep(3600)")):
            results[name] = run_python(code, timeout_s=1.0, memory_mb=128)

    t = threading.Thread(target=worker)
    t.start()
    t.join(120)  # generous bound on a shared machine; the point is that the call returns
    assert not t.is_alive()
    assert all(r.timed_out and not r.passed for r in results.values()), results


@needs_landlock
def test_no_network_and_bounded_memory():
    net = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=3)", timeout_s=10,
                     memory_mb=256)
    assert not net.passed and not net.timed_out
    mem = run_python("x = bytearray(2 * 1024 ** 3)", timeout_s=10, memory_mb=128)
    assert not mem.passed and "MemoryError" in mem.stderr
