"""Training receipts in the real adapter store, and `kiln adapters verify` as a real subprocess.

A receipt is published with its revision (one rename), binds to it by the manifest's SHA-256 and the
``receipt_sha256`` the manifest commits to, rides along in downloads, and any edit of a file or of the
receipt makes ``kiln adapters verify`` exit non-zero with the reason. The receipt of a job trained through
a real ``kiln serve`` is checked in tests/training/test_http.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kiln.adapters.archive import pack, unpack
from kiln.adapters.manifest import MANIFEST_FILE
from kiln.adapters.receipt import (
    RECEIPT_FILE,
    RECEIPT_SCHEMA,
    check_receipt,
    claims_sha256,
    training_claims,
)

INPUTS = "b" * 64
PLAN = "c" * 64


def _claims(job_id: str = "job-00000000000000aa", teacher=None) -> dict:
    return training_claims(job_id=job_id, plan_sha256=PLAN, inputs={"inputs_sha256": INPUTS,
                                                                    "dataset_sha256": "d" * 64}, teacher=teacher)


@pytest.fixture
def trained(make_lora, publish_copy):
    """A revision published the way a training job publishes it: a job ID and a receipt."""

    def run(name: str = "tuned", seed: int = 0, job_id: str = "job-00000000000000aa", **kw):
        return publish_copy(make_lora(seed=seed), name=name, inputs_sha256=INPUTS,
                            config={"epochs": 1, "job_id": job_id}, receipt=_claims(job_id), **kw)

    return run


def _verify(home: Path, target: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", "adapters", "verify", target, *extra],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KILN_HOME": str(home), "COLUMNS": "200"})


def test_the_receipt_is_published_with_the_revision_and_binds_to_it(trained, store, base_info):
    record = trained()
    manifest_bytes = (record.path / MANIFEST_FILE).read_bytes()
    receipt = json.loads((record.path / RECEIPT_FILE).read_text())
    assert receipt["schema"] == RECEIPT_SCHEMA and receipt["job_id"] == "job-00000000000000aa"
    assert receipt["adapter"]["revision"] == record.revision and receipt["adapter"]["name"] == "tuned"
    assert receipt["adapter"]["base_model_sha256"] == base_info.base_model_sha256
    assert receipt["plan_sha256"] == PLAN and receipt["inputs"]["inputs_sha256"] == INPUTS
    assert receipt["code"]["kiln_version"] and receipt["gate"] is None
    # the manifest commits to the claims, so the revision ID covers them
    assert record.manifest.config["receipt_sha256"] == claims_sha256(_claims())
    assert check_receipt(receipt, record.manifest, manifest_bytes) == []
    assert store.verify("tuned").revision == record.revision  # the receipt is an expected file
    # nothing of it is left in staging
    assert not [p for p in (store.root / ".staging").iterdir()]


def test_check_receipt_finds_each_kind_of_mismatch(trained):
    a, b = trained("a", seed=1, job_id="job-000000000000000a"), trained("b", seed=2, job_id="job-000000000000000b")
    body = json.loads((a.path / RECEIPT_FILE).read_text())
    a_bytes = (a.path / MANIFEST_FILE).read_bytes()
    b_bytes = (b.path / MANIFEST_FILE).read_bytes()
    edited = {**body, "plan_sha256": "e" * 64}
    assert any("claims hash" in p for p in check_receipt(edited, a.manifest, a_bytes))
    moved = check_receipt(body, b.manifest, b_bytes)  # a's receipt beside b's manifest
    assert any("adapter.revision" in p for p in moved) and any("job_id" in p for p in moved)
    rebased = {**body, "adapter": {**body["adapter"], "base_model_sha256": "f" * 64}}
    assert any("base_model_sha256" in p for p in check_receipt(rebased, a.manifest, a_bytes))
    assert check_receipt({"schema": "other"}, a.manifest, a_bytes)[0].startswith("not a")


def test_the_gate_verdict_is_recorded_atomically_and_still_verifies(trained, store):
    record = trained()
    verdict = {"verdict": "promoted", "gate_run": "evalrun-0000000000000001", "pairs": 12}
    store.record_gate("tuned", record.revision, verdict)
    receipt = json.loads((record.path / RECEIPT_FILE).read_text())
    assert receipt["gate"] == verdict
    assert check_receipt(receipt, record.manifest, (record.path / MANIFEST_FILE).read_bytes()) == []


def test_a_locality_claim_binds_and_receipts_without_one_still_verify(make_lora, publish_copy, store, trained):
    """Jobs that measured locality add it to their claims (so the revision ID covers it and an edit is found);
    receipts written before that, without the key, verify as before and list no locality."""
    locality = {"probes": 11, "unchanged": 4, "unchanged_fraction": 0.3636, "kl_mean": 0.5, "degenerate": 0,
                "base_degenerate": 0, "guard": {"admitted": False, "code": "locality_below_threshold",
                                                "override": False, "reason": "x", "enabled": True}}
    claims = training_claims(job_id="job-00000000000000bb", plan_sha256=PLAN, inputs={"inputs_sha256": INPUTS},
                             teacher=None, locality=locality)
    record = publish_copy(make_lora(seed=7), name="measured", inputs_sha256=INPUTS,
                          config={"epochs": 1, "job_id": "job-00000000000000bb"}, receipt=claims)
    body = json.loads((record.path / RECEIPT_FILE).read_text())
    manifest_bytes = (record.path / MANIFEST_FILE).read_bytes()
    assert body["locality"] == locality and check_receipt(body, record.manifest, manifest_bytes) == []
    summary = store.receipt_summary(record)
    assert summary["verified"] is True and summary["locality"]["unchanged"] == 4
    assert summary["locality"]["guard"] == {"admitted": False, "code": "locality_below_threshold", "override": False}
    edited = {**body, "locality": {**locality, "unchanged": 11, "unchanged_fraction": 1.0}}
    assert any("claims hash" in p for p in check_receipt(edited, record.manifest, manifest_bytes))
    assert check_receipt({**body, "extra": 1}, record.manifest, manifest_bytes)[0].startswith("not a")
    out = _verify(store.root.parent, "measured")  # `kiln adapters verify` shows it
    assert out.returncode == 0 and "locality: 4 of 11 probe answers unchanged" in out.stdout, out.stdout + out.stderr
    old = trained()  # a receipt without the key
    assert "locality" not in json.loads((old.path / RECEIPT_FILE).read_text())
    assert store.receipt_summary(old)["verified"] is True and store.receipt_summary(old)["locality"] is None


def test_kiln_adapters_verify_passes_then_fails_on_any_tampering(trained, make_lora, publish_copy, store, tmp_path):
    home = store.root.parent  # the store fixture lives at <tmp>/adapters: the default layout under KILN_HOME
    first = trained(seed=3, job_id="job-0000000000000003")
    second = trained(seed=4, job_id="job-0000000000000004")
    ok = _verify(home, "tuned")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert second.revision in ok.stdout and "receipt" in ok.stdout
    pinned = _verify(home, f"tuned@{first.revision}")
    assert pinned.returncode == 0 and first.revision in pinned.stdout, pinned.stdout + pinned.stderr

    receipt_path = second.path / RECEIPT_FILE
    original = receipt_path.read_bytes()
    body = json.loads(original)
    receipt_path.write_text(json.dumps({**body, "plan_sha256": "0" * 64}))  # an edited claim
    bad = _verify(home, "tuned")
    assert bad.returncode != 0 and "receipt" in bad.stderr, bad.stdout + bad.stderr
    receipt_path.write_bytes((first.path / RECEIPT_FILE).read_bytes())  # another revision's receipt
    bad = _verify(home, "tuned")
    assert bad.returncode != 0 and "adapter.revision" in bad.stderr, bad.stderr
    receipt_path.unlink()
    bad = _verify(home, "tuned")
    assert bad.returncode != 0 and RECEIPT_FILE in bad.stderr, bad.stderr
    receipt_path.write_bytes(original)
    assert _verify(home, "tuned").returncode == 0

    weights = second.path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    bad = _verify(home, "tuned")
    assert bad.returncode != 0 and "adapter_model.safetensors" in bad.stderr, bad.stderr

    # an uploaded adapter has no receipt: its files verify and the output says so
    publish_copy(make_lora(seed=5), name="uploaded", kind="upload", config={})
    up = _verify(home, "uploaded")
    assert up.returncode == 0 and "no training receipt" in up.stdout, up.stdout + up.stderr
    missing = _verify(home, "nothing-here")
    assert missing.returncode != 0 and "nothing-here" in missing.stderr


def test_verify_checks_the_base_model_when_given(trained, store, base_info, builtin_model_dir, tmp_path):
    trained()
    home = store.root.parent
    ok = _verify(home, "tuned", "--base-model", str(builtin_model_dir))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    other = _verify(home, "tuned", "--base-model-sha256", "a" * 64)
    assert other.returncode != 0 and base_info.base_model_sha256 in other.stderr, other.stderr


def test_a_download_archive_carries_the_receipt_and_uploads_again(trained, tmp_path):
    record = trained()
    archive = tmp_path / "tuned.tar.gz"
    pack(record.path, archive, folder="tuned")
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
        receipt = json.loads(tar.extractfile(f"tuned/{RECEIPT_FILE}").read())
    assert names == sorted(f"tuned/{n}" for n in ("adapter_config.json", "adapter_model.safetensors",
                                                   MANIFEST_FILE, RECEIPT_FILE))
    assert receipt["adapter"]["revision"] == record.revision
    dest = tmp_path / "dest"
    dest.mkdir()
    unpack(archive, dest, max_weights=10**9)  # re-uploading a download: the receipt is skipped, not kept
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
