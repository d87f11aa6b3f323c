"""Merge math against hand computation, and merged adapters through the store and PEFT."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from kiln.adapters.errors import AdapterConflict, InvalidAdapter
from kiln.adapters.merge import merge_lora, publish_merge, ties_delta
from kiln.adapters.validate import read_adapter_config


def _scale(cfg: dict) -> float:
    return cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])


def _deltas(path) -> dict[str, torch.Tensor]:
    """Per module: the LoRA delta W = scale * B @ A, [out, in], in float64."""
    cfg = read_adapter_config(path / "adapter_config.json")
    t = load_file(str(path / "adapter_model.safetensors"))
    out = {}
    for key in t:
        if key.endswith(".lora_A.weight"):
            m = key[: -len(".lora_A.weight")]
            out[m] = _scale(cfg) * t[f"{m}.lora_B.weight"].double() @ t[key].double()
    return out


def test_linear_is_the_weighted_average_of_the_matrices(make_lora, tmp_path):
    p1, p2 = make_lora(seed=1), make_lora(seed=2)
    cfg = merge_lora([(p1, 3.0), (p2, 1.0)], tmp_path, method="linear", density=0.5, rank=None)
    merged, t1, t2 = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path, p1, p2))
    assert set(merged) == set(t1)
    for key in t1:
        torch.testing.assert_close(merged[key], (3.0 * t1[key] + 1.0 * t2[key]) / 4.0)
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8


def test_concatenation_gives_the_weighted_sum_of_deltas(make_lora, tmp_path):
    p1 = make_lora(seed=3, r=4, alpha=8)
    p2 = make_lora(seed=4, r=2, alpha=16, use_rslora=True)
    cfg = merge_lora([(p1, 0.7), (p2, -0.4)], tmp_path, method="cat", density=0.5, rank=None)
    assert cfg["r"] == 6 and cfg["lora_alpha"] == 6 and cfg["use_rslora"] is False
    d1, d2, dm = _deltas(p1), _deltas(p2), _deltas(tmp_path)
    assert set(dm) == set(d1)
    for m in d1:
        torch.testing.assert_close(dm[m], 0.7 * d1[m] - 0.4 * d2[m], rtol=1e-5, atol=1e-7)
        assert dm[m].abs().max() > 1e-4  # not trivially zero


def test_ties_on_hand_computed_values():
    d1 = torch.tensor([[1.0, -2.0], [3.0, 0.1]], dtype=torch.float64)
    d2 = torch.tensor([[2.0, 1.5], [-1.0, 0.2]], dtype=torch.float64)
    # density 1: elected signs [[+, -], [+, +]]; keep agreeing entries, weighted mean
    full = ties_delta([d1, d2], [1.0, 1.0], density=1.0)
    torch.testing.assert_close(full, torch.tensor([[1.5, -2.0], [3.0, 0.15]], dtype=torch.float64))
    # density 0.5 keeps d1 {3, -2} and d2 {2, 1.5}; weights 1 and 2
    trimmed = ties_delta([d1, d2], [1.0, 2.0], density=0.5)
    # (0,1): 1*-2 + 2*1.5 = +1 -> elected +, only d2 agrees -> 1.5; (1,0): only d1 -> 3; (1,1): nobody -> 0
    torch.testing.assert_close(trimmed, torch.tensor([[2.0, 1.5], [3.0, 0.0]], dtype=torch.float64))


def test_ties_of_one_adapter_at_full_density_reproduces_its_delta(make_lora, tmp_path):
    p = make_lora(seed=5, r=4, alpha=8)
    cfg = merge_lora([(p, 1.0)], tmp_path, method="ties", density=1.0, rank=4)
    assert cfg["r"] == 4
    d, dm = _deltas(p), _deltas(tmp_path)
    for m in d:
        torch.testing.assert_close(dm[m], d[m], rtol=1e-4, atol=1e-6)


def test_ties_merge_is_the_best_low_rank_fit_of_the_ties_delta(make_lora, tmp_path):
    p1, p2 = make_lora(seed=6), make_lora(seed=7)
    merge_lora([(p1, 1.0), (p2, 2.0)], tmp_path, method="ties", density=0.3, rank=6)
    d1, d2, dm = _deltas(p1), _deltas(p2), _deltas(tmp_path)
    for m in d1:
        target = ties_delta([d1[m], d2[m]], [1.0, 2.0], 0.3)
        u, s, vh = torch.linalg.svd(target, full_matrices=False)
        best = (u[:, :6] * s[:6]) @ vh[:6]
        torch.testing.assert_close(dm[m], best, rtol=1e-4, atol=1e-6)
        assert torch.linalg.matrix_rank(dm[m]).item() <= 6


def test_merge_rejects_incompatible_inputs(make_lora, tmp_path):
    with pytest.raises(InvalidAdapter, match="equal rank"):
        merge_lora([(make_lora(r=4), 1.0), (make_lora(r=2), 1.0)], tmp_path, method="linear", density=0.5, rank=None)
    with pytest.raises(InvalidAdapter, match="different modules"):
        merge_lora([(make_lora(targets=("q_proj",)), 1.0), (make_lora(), 1.0)], tmp_path, method="cat",
                   density=0.5, rank=None)
    with pytest.raises(InvalidAdapter, match="positive weights"):
        merge_lora([(make_lora(), -1.0)], tmp_path, method="ties", density=0.5, rank=None)
    with pytest.raises(InvalidAdapter, match="unknown merge method"):
        merge_lora([(make_lora(), 1.0)], tmp_path, method="magic", density=0.5, rank=None)


def test_published_merge_is_content_addressed_and_loads_in_peft(make_lora, publish_copy, store, base_info):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    a = publish_copy(make_lora(seed=8, scale=0.3), name="a")
    b = publish_copy(make_lora(seed=9, r=2, scale=0.3), name="b")
    merged = publish_merge(store, name="ab", sources=[("a", 0.5), ("b", 0.5)], method="cat", base_model=base_info)
    again = publish_merge(store, name="ab2", sources=[("a", 0.5), ("b", 0.5)], method="cat", base_model=base_info)
    assert merged.revision == again.revision
    m = merged.manifest
    assert m.kind == "merge"
    assert m.config["parents"] == [
        {"name": "a", "revision": a.revision, "weight": 0.5},
        {"name": "b", "revision": b.revision, "weight": 0.5},
    ]
    store.verify("ab")

    base = AutoModelForCausalLM.from_pretrained(base_info.path, dtype=torch.float32)
    ids = torch.tensor([[3, 14, 15, 92, 6]])
    with torch.no_grad():
        model = PeftModel.from_pretrained(base, merged.path)
        via_peft = model(ids).logits
        # the same model with the summed deltas merged into the base weights by hand
        model.unload()
        weights = dict(base.named_parameters())
        da, db = _deltas(a.path), _deltas(b.path)
        for mod in da:
            name = mod[len("base_model.model."):] + ".weight"
            weights[name].add_(0.5 * da[mod].float() + 0.5 * db[mod].float())
        by_hand = base(ids).logits
    torch.testing.assert_close(via_peft, by_hand, rtol=1e-4, atol=1e-4)


def test_merge_refuses_adapters_of_another_base(make_lora, publish_copy, store, base_info):
    publish_copy(make_lora(seed=10), name="a")

    class OtherBase:
        base_model_sha256 = "e" * 64

    with pytest.raises(AdapterConflict, match="belongs to base"):
        publish_merge(store, name="x", sources=[("a", 1.0)], method="linear", base_model=OtherBase())


@pytest.mark.parametrize(("r", "rank", "clamped_to"), [(40, None, 80), (70, None, 128), (40, 200, 128)])
def test_ties_rank_is_clamped_to_the_module_size_and_said(make_lora, publish_copy, store, base_info, r, rank, clamped_to):
    """q_proj is 128x128 and v_proj 64x128: the default rank (sum of parents) may exceed either."""
    publish_copy(make_lora(seed=50, r=r, scale=0.3), name="ta")
    publish_copy(make_lora(seed=51, r=r, scale=0.3), name="tb")
    merged = publish_merge(store, name="tab", sources=[("ta", 1.0), ("tb", 1.0)], method="ties",
                           base_model=base_info, density=1.0, rank=rank)
    cfg = read_adapter_config(merged.path / "adapter_config.json")
    assert cfg["r"] == merged.manifest.config["merged_rank"] == clamped_to
    notes = " ".join(merged.manifest.config["notes"])
    assert "v_proj" in notes and "zero-padded" in notes  # 64-wide modules: exact, padded to the rank
    if clamped_to < (rank or 2 * r):
        assert f"clamped to {clamped_to}" in notes and "largest adapted module" in notes
    # v_proj factors are exact at full size: the merged delta equals the TIES delta
    da, db, dm = _deltas(store.get("ta").path), _deltas(store.get("tb").path), _deltas(merged.path)
    for mod in dm:
        want = ties_delta([da[mod], db[mod]], [1.0, 1.0], 1.0)
        if "v_proj" in mod or clamped_to == 128:
            torch.testing.assert_close(dm[mod], want, rtol=1e-4, atol=1e-5)


def test_cat_over_the_rank_limit_says_why(make_lora, tmp_path, monkeypatch):
    import kiln.adapters.merge as merge

    monkeypatch.setattr(merge, "MAX_LORA_RANK", 6)
    with pytest.raises(InvalidAdapter, match="concatenation would give rank 8") as err:
        merge_lora([(make_lora(r=4), 1.0), (make_lora(r=4), 1.0)], tmp_path, method="cat", density=0.5, rank=None)
    assert "ties" in err.value.hint
