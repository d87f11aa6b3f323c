"""Wrapping a model with PEFT, in one place: ``get_peft_model`` without the warning its version skew prints.

PEFT reads ``model.is_gradient_checkpointing`` when it wraps a model; transformers 5 deprecated that
property, so every wrap printed a ``FutureWarning`` naming transformers' internals to the operator at
start-up and at each distillation run. Nothing Kiln does depends on it: only that one message is filtered.
"""

from __future__ import annotations

import warnings
from typing import Any

SKEW_WARNING = r"`is_gradient_checkpointing` is deprecated"


def get_peft_model(model: Any, config: Any, **kwargs: Any) -> Any:
    """``peft.get_peft_model(model, config, **kwargs)`` with PEFT/transformers' version-skew warning filtered."""
    from peft import get_peft_model as wrap

    warnings.filterwarnings("ignore", message=SKEW_WARNING, category=FutureWarning)
    return wrap(model, config, **kwargs)
