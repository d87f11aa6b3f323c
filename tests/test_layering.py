"""The layers point one way: each module imports only its own layer and the layers below it.

The intended order, lowest first (docs/architecture.md, "Layers"):

    contracts   kiln (the package), kiln.errors, kiln.canonical, kiln.adapter_names, kiln.wire_rules, kiln.wire_numbers
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
    ("contracts", frozenset({"kiln", "kiln.__version__", "kiln.errors", "kiln.canonical", "kiln.adapter_names",
                                "kiln.wire_rules", "kiln.wire_numbers"})),
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


# ---------------------------------------------------------------------------------- package cycles

# No package cycle inside a layer (issue 46, item 6): inside ``jobs`` the packages import one way,
# evals <- training <- judgments, and kiln.distill.train above training (it uses training's KD batches and
# losses). What two of them share lives in the lower one: the judge's preference format and scoring in
# kiln.evals (judge_format, judge_preference), a capture run's examples in kiln.distill.examples (domain),
# a KD batch's tensors and loss step in kiln.training.losses.kd_batch.


def package_of(module: str) -> str:
    """The package a module belongs to: its longest prefix named in LAYERS (``kiln.distill.train`` is its own)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        prefix = ".".join(parts[:n])
        if any(prefix in names for _, names in LAYERS):
            return prefix
    return module


def training_unit(module: str) -> str:
    """Inside ``kiln.training``: its sub-package (``core``, ``losses``, ``sft``, ..., ``queue``) or top module."""
    return ".".join(module.split(".")[:3])


def cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one node of a directed graph."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {node: reach(node) for node in edges}
    return {frozenset({node} | {o for o in r if node in reached.get(o, ())}) for node, r in reached.items()
            if any(node in reached.get(o, ()) for o in r if o != node)}


def _sources() -> list[tuple[str, set[str]]]:
    return [(_module_name(path), _imported_modules(path)) for path in _all_modules()]


def _edges(unit_of, keep, sources=None) -> dict[str, set[str]]:
    """unit -> units it imports inside its own layer, from ``sources`` ((module, its imports); default: kiln's)."""
    edges: dict[str, set[str]] = {}
    for name, imports in _sources() if sources is None else sources:
        if not keep(name):
            continue
        for imported in imports:
            if layer_of(imported) is not None and keep(imported) and layer_of(imported) == layer_of(name) \
                    and unit_of(imported) != unit_of(name):
                edges.setdefault(unit_of(name), set()).add(unit_of(imported))
    return edges


def _not_cli(module: str) -> bool:
    return layer_of(module) != CLI


def test_no_package_cycle_inside_a_layer():
    """Packages of one layer import each other one way only, lazy and type-checking imports included."""
    assert cycles(_edges(package_of, _not_cli)) == set()


def test_a_lazy_import_that_closes_a_cycle_fails(tmp_path):
    """The check itself can fail: one function-level import from evals up to training makes a cycle."""
    probe = tmp_path / "probe.py"
    probe.write_text("def gate():\n    from kiln.training.queue.service import TrainingService\n")
    sources = _sources() + [("kiln.evals.probe", _imported_modules(probe))]
    found = cycles(_edges(package_of, _not_cli, sources))
    assert any({"kiln.evals", "kiln.training"} <= group for group in found), found


def test_training_sub_packages_form_no_cycle():
    """losses <- core <- each job kind <- queue: no cycle among training's sub-packages."""
    assert cycles(_edges(training_unit, lambda m: m.startswith("kiln.training.") and _not_cli(m))) == set()


def test_the_cycle_finder_finds_a_cycle():
    """The check itself can fail."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset({"a", "b", "c"})}
    assert cycles({"a": {"b"}, "b": set()}) == set()
    assert package_of("kiln.distill.train") == "kiln.distill.train" and package_of("kiln.distill.shards") == "kiln.distill"
