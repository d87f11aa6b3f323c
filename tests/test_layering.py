"""The layers point one way: each module imports only its own layer and the layers below it.

The intended order, lowest first (docs/architecture.md, "Layers"):

    contracts   kiln (the package), kiln.errors, kiln.canonical, kiln.adapter_names
    system      kiln.system: processes, snapshots, private directories, file provenance, ranks, secrets
    settings    kiln.config (validates [vllm] options and teacher credentials with the system's tools)
    runtime     kiln.runtime: the engines, the ServingEngine seam, tokenization, sampling
    domain      kiln.adapters, kiln.teachers, kiln.distill, kiln.cluster
    jobs        kiln.training, kiln.evals, kiln.openenv, kiln.judgments (and kiln.distill.train, where distillation meets training)
    serving     kiln.serving, kiln.ui
    cli         kiln.cli, kiln.client, kiln.demo, kiln.config_reference, every package's ``cli``/``*_cli`` module

Reads every module's source (imports at any depth, lazy ones inside functions included) instead
of importing it, so a lazy upward import cannot hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kiln

PACKAGE_ROOT = Path(kiln.__file__).parent
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("contracts", frozenset({"kiln", "kiln.__version__", "kiln.errors", "kiln.canonical", "kiln.adapter_names"})),
    ("system", frozenset({"kiln.system"})),
    ("settings", frozenset({"kiln.config"})),
    ("runtime", frozenset({"kiln.runtime"})),
    ("domain", frozenset({"kiln.adapters", "kiln.teachers", "kiln.distill", "kiln.cluster"})),
    ("jobs", frozenset({"kiln.training", "kiln.evals", "kiln.openenv", "kiln.judgments", "kiln.distill.train"})),
    ("serving", frozenset({"kiln.serving", "kiln.ui"})),
    ("cli", frozenset({"kiln.cli", "kiln.client", "kiln.demo", "kiln.config_reference"})),
)
CLI = len(LAYERS) - 1


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (its longest listed prefix), ``None`` outside kiln; command-line
    modules (``...cli``, ``..._cli``) of any package are the top layer."""
    if not (module == "kiln" or module.startswith("kiln.")):
        return None
    last = module.rsplit(".", 1)[-1]
    if module != "kiln.client" and (last == "cli" or last.endswith("_cli")):
        return CLI
    parts = module.split(".")
    for n in range(len(parts), 0 if module == "kiln" else 1, -1):  # "kiln" alone is no prefix of the rest
        prefix = ".".join(parts[:n])
        for index, (_, names) in enumerate(LAYERS):
            if prefix in names:
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> list[Path]:
    return sorted(PACKAGE_ROOT.rglob("*.py"))


def upward_imports(module: str, imported: set[str]) -> list[str]:
    """The modules of ``imported`` in a layer above ``module``'s, each with its layer's name."""
    mine = layer_of(module)
    assert mine is not None
    return sorted(f"{m} ({LAYERS[theirs][0]})" for m in imported
                  if (theirs := layer_of(m)) is not None and theirs > mine)


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_every_layer_imports_only_itself_and_below(layer):
    files = [p for p in _all_modules() if LAYERS[layer_of(_module_name(p))][0] == layer]
    assert files, f"layer {layer} has no modules"
    offenders = {str(p.relative_to(PACKAGE_ROOT)): up for p in files
                 if (up := upward_imports(_module_name(p), _imported_modules(p)))}
    assert offenders == {}


def test_every_module_has_a_layer():
    for path in _all_modules():
        assert layer_of(_module_name(path)) is not None, path


def test_the_scanner_sees_lazy_imports(tmp_path):
    """The check itself can fail: an import inside a function is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kiln.serving.errors import error_body\n    import kiln.serving.app\n")
    assert {"kiln.serving.errors", "kiln.serving.app"} <= _imported_modules(probe)


def test_the_order_refuses_an_upward_import():
    """The check itself can fail: the imports this layering once had are refused."""
    assert upward_imports("kiln.runtime.vllm_process", {"kiln.teachers.supervise", "kiln.cluster.ranks"}) == [
        "kiln.cluster.ranks (domain)", "kiln.teachers.supervise (domain)"]
    assert upward_imports("kiln.config", {"kiln.runtime.vllm_process"}) == ["kiln.runtime.vllm_process (runtime)"]
    assert upward_imports("kiln.training.queue.service", {"kiln.serving.app"}) == ["kiln.serving.app (serving)"]
    assert upward_imports("kiln.serving.app", {"kiln.training.queue.service", "kiln.system.supervise", "json"}) == []
    assert layer_of("kiln.distill.cli") == layer_of("kiln.teachers.registry_cli") == CLI
    assert layer_of("kiln.distill.train") > layer_of("kiln.distill.shards")
