"""How much memory this process may plan for: the CUDA device's, or RAM within a cgroup limit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_total_bytes(device: Any) -> int:
    """The CUDA device's memory for a CUDA ``device``, else physical RAM (lowered to a cgroup
    memory limit when one is set)."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[1])
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in CGROUP_LIMIT_FILES:
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total
