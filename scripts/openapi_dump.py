"""Write the app's OpenAPI document as canonical JSON, to compare two revisions byte for byte.

    PYTHONPATH=src .venv/bin/python scripts/openapi_dump.py OUT.json [--model-dir DIR]

The app is built as ``kiln serve`` builds it (training enabled) on the built-in model (built under a
temporary home unless ``--model-dir`` names one); nothing is served. A refactor that must not change the
API compares ``sha256sum`` of the files written before and after it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model-dir", type=Path, help="a model directory (default: the built-in model)")
    args = ap.parse_args()
    from kiln.canonical import canonical_json_bytes
    from kiln.config import load_settings
    from kiln.runtime.builtin import ensure_builtin_model
    from kiln.serving.app import create_app

    with tempfile.TemporaryDirectory() as home:
        model = args.model_dir or ensure_builtin_model(Path(home))
        settings = load_settings(cli={"model.path": str(model), "home": home}, environ={})
        doc = create_app(settings).openapi()
        args.out.write_bytes(canonical_json_bytes(doc))
    print(f"{args.out}: {len(doc['paths'])} paths")


if __name__ == "__main__":
    main()
