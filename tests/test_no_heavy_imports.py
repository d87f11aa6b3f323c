"""Pure contract modules and the CLI entry point import no heavy ML runtime.

Each module is imported in a fresh interpreter; the test fails if torch,
transformers, peft, vllm, mlx or numpy ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "peft", "vllm", "mlx", "numpy", "safetensors")

PURE_MODULES = [
    "kiln.canonical",
    "kiln.wire_rules",
    "kiln.errors",
    "kiln.config",
    "kiln.config_reference",
    "kiln.adapters.served",
    "kiln.adapters.activation",
    "kiln.serving.default_adapter",
    "kiln.runtime.serving_engine",
    "kiln.cli",
    "kiln.client",
    "kiln.runtime.loader",
    "kiln.runtime.linear_kernels",
    "kiln.runtime.builtin",
    "kiln.runtime.ownership",
    "kiln.distill.contract",
    "kiln.distill.contract_types",
    "kiln.distill.probability",
    "kiln.distill.estimate",
    "kiln.distill.states",
    "kiln.distill.ledger",
    "kiln.distill.shards",
    "kiln.distill.examples",
    "kiln.distill.shard_verify",
    "kiln.distill.dataset",
    "kiln.distill.paths",
    "kiln.distill.cli",
    "kiln.system.ranks",
    "kiln.cluster.acquire",
    "kiln.cluster.acquire_record",
    "kiln.cluster.cli",
    "kiln.serving.protocol",
    "kiln.serving.openai_responses",
    "kiln.serving.fast_path",
    "kiln.serving.errors",
    "kiln.serving.body_limit",
    "kiln.serving.metrics",
    "kiln.serving.cli",
    "kiln.adapters.errors",
    "kiln.adapters.manifest",
    "kiln.adapters.validate",
    "kiln.adapters.store",
    "kiln.adapters.staging",
    "kiln.adapters.archive",
    "kiln.adapters.merge",
    "kiln.adapters.cli",
    "kiln.training.schemas",
    "kiln.training.core.plan",
    "kiln.training.core.errors",
    "kiln.training.opd.schemas",
    "kiln.training.kd.schemas",
    "kiln.adapters.footprint",
    "kiln.adapters.receipt",
    "kiln.training.queue.jobs",
    "kiln.training.cli",
    "kiln.demo",
    "kiln.teachers.identity",
    "kiln.teachers.options",
    "kiln.system.snapshot",
    "kiln.system.private_dirs",
    "kiln.system.private_sqlite",
    "kiln.system.provenance_io",
    "kiln.teachers.runtime_hash",
    "kiln.system.supervise",
    "kiln.teachers.model_facts",
    "kiln.teachers.launcher",
]

_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
heavy = sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[2].split(',')))
print(json.dumps(heavy))
"""


@pytest.mark.parametrize("module", PURE_MODULES)
def test_module_imports_no_heavy_runtime(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, module, ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], f"{module} pulled in heavy modules"
