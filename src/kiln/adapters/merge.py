"""Merging stored LoRA adapters into a new content-addressed adapter.

Notation, per adapted module: A_i [r_i, in], B_i [out, r_i], scale s_i
(lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA) and delta
W_i = s_i * B_i @ A_i [out, in]; w_i is the caller's weight for parent i.

* ``linear``: weighted average of the matrices themselves,
  A = sum(w_i A_i) / sum(w_i), same for B. Needs equal ranks and scales; it is
  what mixing adapters of one training lineage usually wants, but it is not the
  average of the deltas (cross terms).
* ``cat``: rank concatenation, A = [w_1 s_1 A_1; ...; w_n s_n A_n] and
  B = [B_1 ... B_n] with scale 1, so the merged delta is exactly sum(w_i W_i).
* ``ties``: TIES-merging on the full deltas (trim each to its top ``density``
  fraction by magnitude, elect a per-entry sign from the weighted sum, average the
  entries that agree with it), then a truncated SVD back to rank ``rank``
  (default: the sum of the parents' ranks). The rank is clamped to the largest
  adapted module's size (a delta's rank cannot exceed it); modules smaller than
  the rank are factored exactly and zero-padded. Each clamp is reported in the
  returned notes, which :func:`publish_merge` records in the manifest config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.adapters.errors import AdapterConflict, InvalidAdapter
from kiln.adapters.store import AdapterRecord, AdapterStore
from kiln.adapters.manifest import MAX_LORA_RANK
from kiln.adapters.validate import CONFIG_FILE, WEIGHTS_FILE, read_adapter_config

MERGE_METHODS = ("linear", "ties", "cat")
MAX_MERGE_PARENTS = 8
DEFAULT_TIES_DENSITY = 0.5


@dataclass(frozen=True)
class _Parent:
    config: dict[str, Any]
    tensors: dict[str, Any]  # torch tensors keyed as in the safetensors file
    weight: float

    def scale(self) -> float:
        r, alpha = self.config["r"], self.config["lora_alpha"]
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r


def _load_parent(path: Path, weight: float) -> _Parent:
    from safetensors.torch import load_file

    cfg = read_adapter_config(path / CONFIG_FILE)
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise InvalidAdapter(f"{path}: adapters with rank_pattern/alpha_pattern cannot be merged yet")
    return _Parent(cfg, load_file(str(path / WEIGHTS_FILE)), weight)


def _modules(p: _Parent) -> list[str]:
    return sorted(k[: -len(".lora_A.weight")] for k in p.tensors if k.endswith(".lora_A.weight"))


def _trim(delta: Any, density: float) -> Any:
    """Keep the ``density`` fraction of entries with the largest magnitude; zero the rest."""
    import torch

    k = max(1, math.ceil(density * delta.numel()))
    if k >= delta.numel():
        return delta
    threshold = torch.topk(delta.abs().flatten(), k).values[-1]
    return torch.where(delta.abs() >= threshold, delta, torch.zeros_like(delta))


def ties_delta(deltas: list[Any], weights: list[float], density: float) -> Any:
    """TIES merge of full deltas, each [out, in] -> [out, in]."""
    import torch

    trimmed = torch.stack([_trim(d, density) for d in deltas])  # [n, out, in]
    w = torch.tensor(weights, dtype=trimmed.dtype).view(-1, 1, 1)
    elected = torch.sign((w * trimmed).sum(0))  # [out, in]
    agree = (torch.sign(trimmed) == elected) & (trimmed != 0)
    num = (w * trimmed * agree).sum(0)
    den = (w * agree).sum(0)
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))


def _ties_rank(loaded: list[_Parent], modules: list[str], rank: int | None, notes: list[str]) -> int:
    """The merged TIES rank: requested (or the parents' sum), clamped to the largest module's size."""
    requested = rank or sum(p.config["r"] for p in loaded)
    sizes = {m: min(loaded[0].tensors[f"{m}.lora_B.weight"].shape[0], loaded[0].tensors[f"{m}.lora_A.weight"].shape[1])
             for m in modules}
    largest = max(sizes.values())
    chosen = min(requested, largest, MAX_LORA_RANK)
    if chosen < requested:
        what = f"requested rank {requested}" if rank else f"default rank {requested} (the sum of the parents' ranks)"
        notes.append(f"{what} exceeds the largest adapted module's size ({largest}); clamped to {chosen}")
    small = sorted(m for m, size in sizes.items() if size < chosen)
    if small:
        notes.append(f"{len(small)} module(s) are smaller than rank {chosen} (e.g. {small[0]}, size "
                     f"{sizes[small[0]]}): factored exactly at their size and zero-padded to rank {chosen}")
    return chosen


def merge_lora(parents: list[tuple[Path, float]], out_dir: Path, *, method: str, density: float, rank: int | None,
               notes: list[str] | None = None) -> dict[str, Any]:
    """Write the merged adapter_config.json + adapter_model.safetensors into ``out_dir``; return the config.

    Adjustments made on the way (a clamped TIES rank) are appended to ``notes``.
    """
    notes = [] if notes is None else notes
    import torch
    from safetensors.torch import save_file

    if method not in MERGE_METHODS:
        raise InvalidAdapter(f"unknown merge method {method!r}; use one of {', '.join(MERGE_METHODS)}")
    if not 1 <= len(parents) <= MAX_MERGE_PARENTS:
        raise InvalidAdapter(f"merge needs 1-{MAX_MERGE_PARENTS} adapters")
    if not all(isinstance(w, (int, float)) and math.isfinite(w) for _p, w in parents):
        raise InvalidAdapter("merge weights must be finite numbers")
    if method in ("linear", "ties") and not all(w > 0 for _p, w in parents):
        raise InvalidAdapter(f"{method} merging needs positive weights")
    if method == "ties" and not 0 < density <= 1:
        raise InvalidAdapter("density must be in (0, 1]")
    loaded = [_load_parent(p, w) for p, w in parents]
    modules = _modules(loaded[0])
    for p in loaded[1:]:
        if _modules(p) != modules:
            raise InvalidAdapter("the adapters adapt different modules; merge adapters with the same target modules")
    cfg = dict(loaded[0].config)
    out: dict[str, Any] = {}
    if method == "linear":
        if len({(p.config["r"], p.scale()) for p in loaded}) != 1:
            raise InvalidAdapter("linear merging needs equal rank and scale; use method 'cat' or 'ties'")
        total = sum(p.weight for p in loaded)
        for key in loaded[0].tensors:
            out[key] = sum(p.weight * p.tensors[key].float() for p in loaded) / total
    else:
        if method == "cat":
            merged_rank = sum(p.config["r"] for p in loaded)
            if merged_rank > MAX_LORA_RANK:
                raise InvalidAdapter(
                    f"concatenation would give rank {merged_rank}, above the limit of {MAX_LORA_RANK}",
                    hint=f"cat adds the parents' ranks; merge fewer adapters, or use method 'ties' with rank <= "
                    f"{MAX_LORA_RANK}.",
                )
        else:
            merged_rank = _ties_rank(loaded, modules, rank, notes)
        for m in modules:
            a_key, b_key = f"{m}.lora_A.weight", f"{m}.lora_B.weight"
            if method == "cat":
                out[a_key] = torch.cat([p.weight * p.scale() * p.tensors[a_key].float() for p in loaded], 0)
                out[b_key] = torch.cat([p.tensors[b_key].float() for p in loaded], 1)
            else:
                deltas = [p.scale() * p.tensors[b_key].double() @ p.tensors[a_key].double() for p in loaded]
                merged = ties_delta(deltas, [p.weight for p in loaded], density)
                k = min(merged_rank, *merged.shape)
                u, s, vh = torch.linalg.svd(merged, full_matrices=False)
                root = s[:k].sqrt()
                b = torch.zeros(merged.shape[0], merged_rank, dtype=torch.float32)
                a = torch.zeros(merged_rank, merged.shape[1], dtype=torch.float32)
                b[:, :k] = u[:, :k] * root
                a[:k] = root[:, None] * vh[:k]
                out[b_key], out[a_key] = b, a
        cfg.update(r=merged_rank, lora_alpha=merged_rank, use_rslora=False)
    cfg.update(rank_pattern={}, alpha_pattern={})
    dtype = next(iter(loaded[0].tensors.values())).dtype
    save_file({k: v.to(dtype).contiguous() for k, v in sorted(out.items())}, str(out_dir / WEIGHTS_FILE))
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return cfg


def publish_merge(
    store: AdapterStore,
    *,
    name: str,
    sources: list[tuple[str, float]],
    method: str,
    base_model: Any,
    density: float = DEFAULT_TIES_DENSITY,
    rank: int | None = None,
) -> AdapterRecord:
    """Merge the HEAD revisions of ``sources`` ([(adapter name, weight)]) and publish as ``name`` (kind "merge").

    ``base_model`` is the served base (:class:`kiln.runtime.loader.ModelDirInfo`);
    every source must have been trained on it.
    """
    records = [store.verify(src) for src, _w in sources]
    for rec in records:
        if rec.manifest.base_model_sha256 != base_model.base_model_sha256:
            raise AdapterConflict(
                f"adapter {rec.name!r} belongs to base {rec.manifest.base_model_sha256}, not the served "
                f"base {base_model.base_model_sha256}",
                hint="Merge only adapters trained on the base model this server runs.",
            )
    if rank is not None and not 1 <= rank <= MAX_LORA_RANK:
        raise InvalidAdapter(f"rank must be in 1..{MAX_LORA_RANK}")
    with store.new_staging() as staging:
        notes: list[str] = []
        merged_cfg = merge_lora([(r.path, w) for r, (_n, w) in zip(records, sources)], staging.path, method=method,
                                density=density, rank=rank, notes=notes)
        config = {
            "method": method,
            "density": density if method == "ties" else None,
            "rank": rank if method == "ties" else None,
            "merged_rank": merged_cfg["r"],
            "notes": notes,
            "parents": [{"name": r.name, "revision": r.revision, "weight": w} for r, (_n, w) in zip(records, sources)],
        }
        return store.publish(
            staging, name=name, base_model_sha256=base_model.base_model_sha256, kind="merge", config=config,
            inputs_sha256=None, parent_revision=None, base_model_dir=base_model,
        )
