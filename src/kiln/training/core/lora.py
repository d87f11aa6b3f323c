"""The job's private LoRA adapter on the served ``PeftModel``: add, activate, freeze, read, save.

Call these under exclusive ownership (:meth:`kiln.training.core.loop.TrainLoop.step_ownership`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from kiln.adapters.validate import CONFIG_FILE, WEIGHTS_FILE
from kiln.training.core.errors import TrainingFailed


def lora_config(rank: int, alpha: float, target_modules: Sequence[str]) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM",
    )


def add_private_adapter(
    peft_model: Any, name: str, config: Any, *, seed: int, init_state: dict[str, torch.Tensor] | None = None
) -> list[torch.nn.Parameter]:
    """Add adapter ``name`` (seeded init, or ``init_state`` weights) and return its parameters.

    Call under exclusive ownership. The global RNG is left as it was.
    """
    from peft import set_peft_model_state_dict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model.add_adapter(name, config)
    if init_state is not None:
        result = set_peft_model_state_dict(peft_model, init_state, adapter_name=name)
        missing = [k for k in result.missing_keys if f".{name}." in k]
        if missing or result.unexpected_keys:
            raise TrainingFailed(
                f"the base adapter's weights do not match its LoRA config ({len(missing)} missing, "
                f"{len(result.unexpected_keys)} unexpected keys)"
            )
    return private_parameters(peft_model, name)


def private_parameters(peft_model: Any, name: str) -> list[torch.nn.Parameter]:
    params = [p for n, p in peft_model.named_parameters() if f".{name}." in n]
    if not params:
        raise TrainingFailed(f"adapter {name!r} has no parameters; do its target modules exist in the model?")
    return params


def adapter_state(peft_model: Any, name: str) -> dict[str, torch.Tensor]:
    """The adapter's weights keyed as in ``adapter_model.safetensors``."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, adapter_name=name)


def make_trainable(peft_model: Any, name: str, params: Sequence[torch.nn.Parameter]) -> None:
    """Make ``name`` the active adapter with trainable weights; a no-op when it already is.

    Called under exclusive ownership before every step, so an adapter change made
    between two steps (serving loads or deletes adapters) cannot make a step train
    the wrong weights. Serving always names its adapters per row, so leaving the
    private adapter active between steps changes nothing it computes.
    """
    if peft_model.active_adapter != name or not params[0].requires_grad:
        peft_model.base_model.set_adapter(name)


def release_private(peft_model: Any, name: str, previous: str) -> None:
    """Undo :func:`make_trainable`: reactivate ``previous`` and freeze the private weights."""
    if previous in peft_model.peft_config and previous != name:
        peft_model.base_model.set_adapter(previous, inference_mode=True)
    for p in private_parameters(peft_model, name):
        p.requires_grad_(False)


def save_adapter_files(peft_model: Any, name: str, out_dir: Path, *, base_model_dir: str) -> None:
    """Write standard PEFT files (``adapter_config.json`` + ``adapter_model.safetensors``) into ``out_dir``."""
    import json

    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous().clone() for k, v in adapter_state(peft_model, name).items()}
    for key, tensor in state.items():
        if not torch.isfinite(tensor).all():
            raise TrainingFailed(f"trained weight {key} is not finite; lower the learning rate")
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    cfg = peft_model.peft_config[name].to_dict()
    cfg["base_model_name_or_path"] = base_model_dir
    cfg["inference_mode"] = True
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
