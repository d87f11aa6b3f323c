"""Fixtures for adapter tests: the built-in base model and synthetic PEFT LoRA files for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

from kiln.adapters.store import AdapterStore
from kiln.adapters.validate import base_weight_shapes
from kiln.runtime.loader import ModelDirInfo, inspect_model_dir

MakeLora = Callable[..., Path]


@pytest.fixture(scope="session")
def base_info(builtin_model_dir: Path) -> ModelDirInfo:
    return inspect_model_dir(builtin_model_dir)


@pytest.fixture(scope="session")
def make_lora(base_info: ModelDirInfo, tmp_path_factory: pytest.TempPathFactory) -> MakeLora:
    """Write a PEFT-format LoRA (adapter_config.json + adapter_model.safetensors) with random A and B.

    Files are laid out exactly as ``PeftModel.save_pretrained`` writes them for the
    default adapter, so PEFT loads them unchanged.
    """
    import torch
    from safetensors.torch import save_file

    shapes = base_weight_shapes(base_info.path)
    root = tmp_path_factory.mktemp("loras")
    counter = [0]

    def make(
        *,
        r: int = 4,
        alpha: float = 8,
        seed: int = 0,
        targets: tuple[str, ...] = ("q_proj", "v_proj"),
        scale: float = 0.05,
        use_rslora: bool = False,
    ) -> Path:
        counter[0] += 1
        out = root / f"lora{counter[0]}"
        out.mkdir()
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for key, shape in sorted(shapes.items()):
            module = key[: -len(".weight")]
            if not key.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
                continue
            fan_out, fan_in = shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * scale
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * scale
        save_file(tensors, str(out / "adapter_model.safetensors"))
        cfg = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(base_info.path),
            "r": r,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted(targets),
            "bias": "none",
            "use_rslora": use_rslora,
        }
        (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
        return out

    return make


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return AdapterStore(tmp_path / "adapters")


def upload_adapter(base_url: str, name: str, src: Path, tmp_path: Path) -> str:
    """Pack ``src`` and upload it as adapter ``name`` over HTTP (201 expected); its revision."""
    import httpx

    from kiln.adapters.archive import pack

    out = tmp_path / f"{name}-{src.name}.tar.gz"
    pack(src, out, folder=name)
    r = httpx.post(f"{base_url}/v1/adapters/{name}/upload", content=out.read_bytes(), timeout=60,
                   headers={"content-type": "application/gzip"})
    assert r.status_code == 201, r.text
    return r.json()["revision"]


def lora_with_config(src: Path, root: Path, **changes) -> Path:
    """A copy of the LoRA at ``src`` (in a new folder under ``root``) with ``adapter_config.json`` fields changed."""
    out = root / f"cfg{len(list(root.iterdir()))}"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def stage_copy(store: AdapterStore, src: Path):
    staging = store.new_staging()
    for f in src.iterdir():
        shutil.copy2(f, staging.path / f.name)
    return staging


@pytest.fixture
def publish_copy(store: AdapterStore, base_info: ModelDirInfo):
    """Publish a copy of a LoRA directory into ``store``; keyword arguments override the defaults."""

    def run(src: Path, name: str = "demo", **kw):
        args = dict(
            name=name,
            base_model_sha256=base_info.base_model_sha256,
            kind="sft",
            config={"lr": 1e-3, "epochs": 1},
            inputs_sha256="a" * 64,
            parent_revision=None,
            base_model_dir=base_info,
        )
        args.update(kw)
        return store.publish(stage_copy(store, src), **args)

    return run
