"""What serving an adapter revision reserves in the memory budget (:mod:`kiln.runtime.memory_budget`).

Read from the revision's files alone (no torch): the activation path, the served-set recorder and the eval
loads reserve it; a training job's own estimate is :mod:`kiln.training.core.memory_estimate`.
"""

from __future__ import annotations

from typing import Any


def adapter_parts(adapter_dir: Any) -> dict[str, int]:
    """What serving an adapter revision reserves (:mod:`kiln.runtime.memory_budget`): its tensor bytes."""
    return {"adapter_weights": adapter_bytes(adapter_dir)}


def adapter_bytes(adapter_dir: Any) -> int:
    """Tensor bytes of a PEFT adapter directory, from its safetensors header (the file's size less the
    header when a tensor's offsets are unreadable; ``adapter_model.bin`` by its size)."""
    import json
    import struct
    from pathlib import Path

    d = Path(adapter_dir)
    st = d / "adapter_model.safetensors"
    if st.is_file():
        with open(st, "rb") as f:
            head = f.read(8)
            if len(head) == 8:
                n = struct.unpack("<Q", head)[0]
                try:
                    header = json.loads(f.read(n))
                    return sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0])
                               for k, v in header.items() if k != "__metadata__")
                except (ValueError, KeyError, TypeError):
                    return max(0, st.stat().st_size - 8 - n)
    binf = d / "adapter_model.bin"
    return binf.stat().st_size if binf.is_file() else 0
