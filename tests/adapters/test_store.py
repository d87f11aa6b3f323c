"""Adapter store: publication, manifests, lookup, verification, deletion, cleanup."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from kiln.adapters.errors import AdapterIntegrityError, AdapterNotFound, InvalidAdapter
from kiln.adapters.manifest import MANIFEST_FILE, MANIFEST_SCHEMA, Manifest
from kiln.adapters.store import KEEP_PREVIOUS_REVISIONS, STAGING_DIR, AdapterStore
from kiln.canonical import sha256_file

from tests.adapters.conftest import lora_with_config, stage_copy


def _store_entries(store: AdapterStore) -> list[str]:
    return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.name != ".lock")


def test_publish_writes_standard_files_and_a_complete_manifest(store, make_lora, publish_copy, base_info):
    src = make_lora(seed=1)
    record = publish_copy(src, name="greeter", parent_revision="b" * 64)

    assert record.name == "greeter"
    assert record.path == store.root / "greeter" / "revisions" / record.revision
    assert sorted(p.name for p in record.path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        MANIFEST_FILE,
    ]
    raw = json.loads((record.path / MANIFEST_FILE).read_text())
    assert raw["schema"] == MANIFEST_SCHEMA
    assert raw["name"] == "greeter"
    assert raw["revision"] == record.revision
    assert raw["base_model_sha256"] == base_info.base_model_sha256
    assert raw["kind"] == "sft"
    assert raw["config"] == {"lr": 1e-3, "epochs": 1}
    assert raw["inputs_sha256"] == "a" * 64
    assert raw["parent_revision"] == "b" * 64
    for entry in raw["files"]:
        digest, size = sha256_file(record.path / entry["path"])
        assert (entry["sha256"], entry["size"]) == (digest, size)
    assert (record.path / "adapter_model.safetensors").read_bytes() == (src / "adapter_model.safetensors").read_bytes()
    stored_cfg = json.loads((record.path / "adapter_config.json").read_text())
    source_cfg = json.loads((src / "adapter_config.json").read_text())
    assert stored_cfg == {**source_cfg, "base_model_name_or_path": base_info.path.name}  # the path is not kept
    assert {e["path"] for e in raw["files"]} == {"adapter_config.json", "adapter_model.safetensors"}
    assert raw["created"].endswith("Z")
    assert record.size == sum(e["size"] for e in raw["files"])
    # nothing left in staging
    assert list((store.root / STAGING_DIR).iterdir()) == []
    assert store.get("greeter") == record
    assert [r.name for r in store.list()] == ["greeter"]
    assert store.verify("greeter") == record


def test_revision_is_content_addressed(make_lora, publish_copy, store):
    src = make_lora(seed=2)
    a = publish_copy(src, name="a")
    b = publish_copy(src, name="b")  # same content, other name, later time
    assert a.revision == b.revision
    assert a.manifest.created != b.manifest.created or a.manifest.name != b.manifest.name
    c = publish_copy(src, name="c", config={"lr": 2e-3, "epochs": 1})
    d = publish_copy(src, name="d", parent_revision=a.revision)
    e = publish_copy(src, name="e", kind="grpo")
    f = publish_copy(make_lora(seed=3), name="f")
    assert len({a.revision, c.revision, d.revision, e.revision, f.revision}) == 5


def test_republishing_identical_content_keeps_one_revision(make_lora, publish_copy, store):
    src = make_lora(seed=4)
    first = publish_copy(src, name="same")
    again = publish_copy(src, name="same")
    assert again.revision == first.revision
    assert again.manifest.created == first.manifest.created  # the stored revision was reused
    assert [p.name for p in (store.root / "same" / "revisions").iterdir()] == [first.revision]


def test_history_keeps_head_plus_previous_revisions(make_lora, publish_copy, store):
    revisions = [publish_copy(make_lora(seed=10 + i), name="hist").revision for i in range(KEEP_PREVIOUS_REVISIONS + 2)]
    kept = sorted(p.name for p in (store.root / "hist" / "revisions").iterdir())
    assert kept == sorted(revisions[-(KEEP_PREVIOUS_REVISIONS + 1):])
    assert store.get("hist").revision == revisions[-1]
    assert store.get("hist", revisions[-2]).revision == revisions[-2]
    with pytest.raises(AdapterNotFound):
        store.get("hist", revisions[0])


def test_peft_subdirectory_output_is_flattened_and_model_card_dropped(make_lora, store, base_info):
    src = make_lora(seed=5)
    staging = store.new_staging()
    sub = staging / "my-adapter"
    sub.mkdir()
    for f in src.iterdir():
        (sub / f.name).write_bytes(f.read_bytes())
    (sub / "README.md").write_text("model card")
    record = store.publish(
        staging, name="flat", base_model_sha256=base_info.base_model_sha256, kind="sft", config={},
        base_model_dir=base_info.path,
    )
    assert sorted(p.name for p in record.path.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", MANIFEST_FILE,
    ]
    assert not staging.path.exists()


def _set_first_float(path: Path, value_bits: bytes) -> None:
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n: 8 + n + 4] = value_bits
    path.write_bytes(bytes(data))


def _corrupt(kind: str, d: Path) -> None:
    cfg_path = d / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    if kind == "nan":
        _set_first_float(d / "adapter_model.safetensors", struct.pack("<f", float("nan")))
    elif kind == "inf":
        _set_first_float(d / "adapter_model.safetensors", struct.pack("<f", float("inf")))
    elif kind == "rank":
        cfg["r"] = 8
    elif kind == "untargeted":
        cfg["target_modules"] = ["k_proj"]
    elif kind == "dora":
        cfg["use_dora"] = True
    elif kind == "not_lora":
        cfg["peft_type"] = "IA3"
    elif kind == "extra_file":
        (d / "adapter_model.bin").write_bytes(b"pickle")
    elif kind == "symlink":
        os.rename(d / "adapter_config.json", d.parent / f"{d.name}-cfg.json")
        os.symlink(d.parent / f"{d.name}-cfg.json", d / "adapter_config.json")
    elif kind == "missing_weights":
        (d / "adapter_model.safetensors").unlink()
    elif kind == "truncated":
        data = (d / "adapter_model.safetensors").read_bytes()
        (d / "adapter_model.safetensors").write_bytes(data[:-4])
    elif kind == "bad_json":
        cfg_path.write_text('{"r": 4, "r": 5}')
        return
    cfg_path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("nan", "non-finite"),
        ("inf", "non-finite"),
        ("rank", "config says r=8"),
        ("untargeted", "not covered by target_modules"),
        ("dora", "DoRA"),
        ("not_lora", "LoRA adapters only"),
        ("extra_file", "unexpected entry 'adapter_model.bin'"),
        ("symlink", "not a regular file"),
        ("missing_weights", "adapter_model.safetensors is missing"),
        ("truncated", "past the end of the file"),
        ("bad_json", "duplicate object key"),
    ],
)
def test_invalid_adapters_are_rejected_and_leave_the_store_unchanged(
    kind, message, make_lora, publish_copy, store, base_info, tmp_path
):
    good = publish_copy(make_lora(seed=6), name="keep")
    before = _store_entries(store)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in make_lora(seed=7).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    _corrupt(kind, bad)
    staging = store.new_staging()
    for f in bad.iterdir():
        target = staging / f.name
        if f.is_symlink():
            os.symlink(os.readlink(f), target)
        else:
            target.write_bytes(f.read_bytes())
    with pytest.raises(InvalidAdapter, match=message):
        store.publish(
            staging, name="keep", base_model_sha256=good.manifest.base_model_sha256, kind="sft", config={},
            base_model_dir=base_info,
        )
    assert not staging.path.exists()
    assert _store_entries(store) == before
    assert store.get("keep").revision == good.revision


def test_shape_mismatch_with_the_base_model_is_rejected(make_lora, store, base_info, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = make_lora(seed=8)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
    staging = stage_copy(store, src)
    save_file(tensors, str(staging / "adapter_model.safetensors"))
    with pytest.raises(InvalidAdapter, match="base weight"):
        store.publish(staging, name="x", base_model_sha256=base_info.base_model_sha256, kind="sft", config={},
                      base_model_dir=base_info)
    assert store.list() == []


def test_base_identity_must_match(make_lora, store, base_info):
    staging = stage_copy(store, make_lora(seed=9))
    with pytest.raises(InvalidAdapter, match="does not match the base model"):
        store.publish(staging, name="x", base_model_sha256="c" * 64, kind="sft", config={}, base_model_dir=base_info)
    staging = stage_copy(store, make_lora(seed=9))
    with pytest.raises(InvalidAdapter, match="kind"):
        store.publish(staging, name="x", base_model_sha256=base_info.base_model_sha256, kind="magic", config={},
                      base_model_dir=base_info)
    staging = stage_copy(store, make_lora(seed=9))
    with pytest.raises(InvalidAdapter, match="name"):
        store.publish(staging, name="../evil", base_model_sha256=base_info.base_model_sha256, kind="sft",
                      config={}, base_model_dir=base_info)
    assert store.list() == []
    assert list((store.root / STAGING_DIR).iterdir()) == []


def test_verify_detects_tampering(make_lora, publish_copy, store):
    record = publish_copy(make_lora(seed=11), name="t")
    weights = record.path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterIntegrityError, match="adapter_model.safetensors sha256"):
        store.verify("t")
    (record.path / "extra.txt").write_text("x")
    with pytest.raises(AdapterIntegrityError, match="unexpected file extra.txt"):
        store.verify("t")


def test_manifest_tampering_is_detected_on_read(make_lora, publish_copy, store):
    record = publish_copy(make_lora(seed=12), name="m")
    raw = json.loads((record.path / MANIFEST_FILE).read_text())
    raw["config"]["lr"] = 1.0
    (record.path / MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(AdapterIntegrityError, match="does not match its content"):
        store.get("m")


def test_manifest_roundtrip_and_revision_ignores_name_and_time(make_lora, publish_copy):
    m = publish_copy(make_lora(seed=13), name="rt").manifest
    assert Manifest.from_bytes(m.to_bytes()) == m
    other = Manifest.build(
        name="other", files=m.files, base_model_sha256=m.base_model_sha256, kind=m.kind, config=m.config,
        inputs_sha256=m.inputs_sha256, parent_revision=m.parent_revision, created="2000-01-01T00:00:00Z",
    )
    assert other.revision == m.revision


def test_delete_removes_every_revision(make_lora, publish_copy, store):
    publish_copy(make_lora(seed=14), name="gone")
    publish_copy(make_lora(seed=15), name="gone")
    deleted = store.delete("gone")
    assert deleted.name == "gone"
    with pytest.raises(AdapterNotFound):
        store.get("gone")
    assert not (store.root / "gone").exists()
    with pytest.raises(AdapterNotFound):
        store.delete("gone")


def test_cleanup_keeps_live_staging_and_removes_dead_leftovers(make_lora, publish_copy, store):
    live = store.new_staging()
    (live / "adapter_config.json").write_text("{}")
    # leftovers an interrupted run could leave: staging without an owner, a half-made name, a HEAD temp file
    orphan = store.root / STAGING_DIR / "deadbeef"
    orphan.mkdir()
    (store.root / STAGING_DIR / "cafe.lock").write_text("")
    (store.root / STAGING_DIR / "cafe").mkdir()
    (store.root / "halfmade" / "revisions" / ("d" * 64)).mkdir(parents=True)
    record = publish_copy(make_lora(seed=16), name="ok")
    (record.path.parents[1] / ".HEAD.abc.tmp").write_text("{")
    report = store.cleanup()
    assert report.temp_files_removed == 1
    assert live.path.is_dir()
    assert sorted(p.name for p in (store.root / STAGING_DIR).iterdir()) == sorted([live.path.name, f"{live.path.name}.lock"])
    assert not (store.root / "halfmade").exists()
    assert store.get("ok").revision == record.revision
    live.discard()
    assert list((store.root / STAGING_DIR).iterdir()) == []


def test_staging_context_manager_discards_unpublished_work(store):
    with store.new_staging() as staging:
        (staging / "x").write_text("x")
        path = staging.path
    assert not path.exists()


def test_published_adapter_loads_with_plain_peft(make_lora, publish_copy, base_info):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    record = publish_copy(make_lora(seed=17, scale=0.3), name="peft-load")
    base = AutoModelForCausalLM.from_pretrained(base_info.path, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        plain = base(ids).logits.clone()
        model = PeftModel.from_pretrained(base, record.path)
        tuned = model(ids).logits
    assert not torch.allclose(plain, tuned, atol=1e-5)  # the LoRA really changed the model
    sd = model.state_dict()
    for key in ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",):
        from safetensors.torch import load_file

        saved = load_file(str(record.path / "adapter_model.safetensors"))
        assert torch.equal(sd[key], saved[key.replace(".default", "")])


def test_publish_accepts_the_staging_path(make_lora, store, base_info):
    staging = store.new_staging()
    as_path = Path(staging)
    for f in make_lora(seed=18).iterdir():
        (as_path / f.name).write_bytes(f.read_bytes())
    record = store.publish(as_path, name="bypath", base_model_sha256=base_info.base_model_sha256, kind="sft",
                           config={}, base_model_dir=base_info)
    assert store.verify("bypath") == record
    assert not staging.active and list((store.root / STAGING_DIR).iterdir()) == []
    with pytest.raises(InvalidAdapter, match="not a live staging"):
        store.publish(store.root / STAGING_DIR / "nope", name="x", base_model_sha256=base_info.base_model_sha256,
                      kind="sft", config={}, base_model_dir=base_info)


# ---- uploaded patterns never meet a backtracking engine; paths never enter identity ------------------------------

@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_modules": "([a-z_.0-9]+)+X"}, "not covered by target_modules"),  # catastrophic for Python's re
        ({"target_modules": "(a+)+b"}, "not covered by target_modules"),
        ({"target_modules": "("}, "not a valid pattern"),
        ({"target_modules": "(q)\\1"}, "not a valid pattern"),  # backreference: not RE2
        ({"target_modules": "x" * 5000}, "1-1024 characters"),
        ({"target_modules": ["proj"]}, "not covered"),  # PEFT: exact name or suffix after '.', not a substring
        ({"exclude_modules": "(", "target_modules": ["q_proj", "v_proj"]}, "exclude_modules"),
        ({"exclude_modules": ".*q_proj"}, "not covered"),
        ({"rank_pattern": {"(": 8}}, "rank_pattern"),
    ],
)
def test_hostile_or_malformed_patterns_are_refused_fast(changes, message, make_lora, publish_copy, tmp_path):
    import time

    src = lora_with_config(make_lora(seed=40), tmp_path, **changes)
    started = time.monotonic()
    with pytest.raises(InvalidAdapter, match=message) as err:
        publish_copy(src, name="pat")
    assert time.monotonic() - started < 2.0
    assert len(str(err.value)) < 400


def test_patterns_follow_peft_and_are_stored_as_exact_names(make_lora, publish_copy, tmp_path):
    src = make_lora(seed=41, targets=("q_proj", "v_proj"))
    modules = sorted(
        k[len("base_model.model."): -len(".lora_A.weight")]
        for k in json.loads((src / "adapter_model.safetensors").read_bytes()[8:8 + struct.unpack(
            "<Q", (src / "adapter_model.safetensors").read_bytes()[:8])[0]]) if k.endswith("lora_A.weight")
    )
    suffix = publish_copy(lora_with_config(src, tmp_path, target_modules=["self_attn.q_proj", "v_proj"]), name="sfx")
    assert json.loads((suffix.path / "adapter_config.json").read_text())["target_modules"] == [
        "self_attn.q_proj", "v_proj"]  # lists are kept as they are
    regex = publish_copy(lora_with_config(src, tmp_path, target_modules=r".*\.(q_proj|v_proj)",
                                      rank_pattern={"q_proj": 4}), name="rgx")
    stored = json.loads((regex.path / "adapter_config.json").read_text())
    assert stored["target_modules"] == modules  # PEFT at load time only sees exact names
    assert stored["rank_pattern"] == {}

    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    for cfg in (LoraConfig(target_modules=stored["target_modules"]),
                LoraConfig(target_modules=r".*\.(q_proj|v_proj)")):
        assert all(check_target_module_exists(cfg, m) for m in modules)
        assert not check_target_module_exists(cfg, "model.layers.0.self_attn.k_proj")


def test_same_weights_under_two_homes_get_one_revision(make_lora, base_info, tmp_path):
    """base_model_name_or_path carries the trainer's home; the stored config and the revision must not."""
    src = make_lora(seed=42)
    revisions, configs = [], []
    for home in ("home-alice", "home-bob"):
        store = AdapterStore(tmp_path / home / "adapters")
        lora = lora_with_config(src, tmp_path, base_model_name_or_path=str(tmp_path / home / "models" / base_info.path.name))
        record = store.publish(
            stage_copy(store, lora), name="same", base_model_sha256=base_info.base_model_sha256, kind="sft",
            config={}, base_model_dir=base_info,
        )
        revisions.append(record.revision)
        configs.append((record.path / "adapter_config.json").read_bytes())
    assert revisions[0] == revisions[1]
    assert configs[0] == configs[1] and b"home-" not in configs[0] and str(tmp_path).encode() not in configs[0]
    assert json.loads(configs[0])["base_model_name_or_path"] == base_info.path.name
    # Hub-style IDs are not paths and are kept
    store = AdapterStore(tmp_path / "hub" / "adapters")
    record = store.publish(stage_copy(store, lora_with_config(src, tmp_path, base_model_name_or_path="Qwen/Qwen3-0.6B")),
                           name="hub", base_model_sha256=base_info.base_model_sha256, kind="sft", config={},
                           base_model_dir=base_info)
    assert json.loads((record.path / "adapter_config.json").read_text())["base_model_name_or_path"] == "Qwen/Qwen3-0.6B"


def test_one_rule_each_for_names_ranks_and_the_revision_header():
    import re as std_re

    import kiln
    from kiln.adapters import manifest
    from kiln.runtime import adapter_slots
    from kiln.serving import generation
    from kiln.training import schemas

    assert adapter_slots.MAX_ADAPTER_NAME_CHARS is manifest.MAX_ADAPTER_NAME_CHARS == 64
    assert adapter_slots.is_valid_name is manifest.is_valid_name
    assert schemas.MAX_LORA_RANK is manifest.MAX_LORA_RANK
    assert generation.ADAPTER_HEADER is manifest.ADAPTER_REVISION_HEADER
    assert manifest.is_valid_name("a" * 64) and not manifest.is_valid_name("a" * 65)
    src = Path(kiln.__file__).parent
    for pattern, home in ((r"^\s*MAX_LORA_RANK\s*=", "adapters/manifest.py"),
                          (r"^\s*MAX_ADAPTER_NAME_CHARS\s*=", "adapter_names.py"),
                          (r"x-kiln-adapter-revision\"", "adapters/manifest.py")):
        defining = [p.relative_to(src).as_posix() for p in src.rglob("*.py")
                    if std_re.search(pattern, p.read_text(encoding="utf-8"), std_re.M)]
        assert defining == [home], (pattern, defining)


def test_head_and_manifest_are_private(make_lora, publish_copy, store):
    """Everything under $KILN_HOME is 0600/0700 (docs); HEAD and the manifest were created 0644."""
    import stat

    rec = publish_copy(make_lora(seed=5), name="private")
    for path in (store.root / "private" / "HEAD", rec.path / "kiln-manifest.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((store.root / "private" / "revisions").stat().st_mode) == 0o700
