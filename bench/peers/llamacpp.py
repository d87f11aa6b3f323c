"""llama.cpp's server as a serving peer for the benchmarks, built from source (bench/quantized.py,
``bench/serving.py --llamacpp``).

The source is the llama.cpp tree vendored in the ``llama-cpp-python`` sdist on PyPI (``pip download
--no-binary``; the only registry the project's machines reach). It is built with CMake (the
``llama-server`` and ``llama-quantize`` targets, ``GGML_NATIVE`` so it uses this CPU's ISA, no
CURL) once per version under ``~/.cache/kiln/peers/`` (``$XDG_CACHE_HOME`` honoured). Our
random-weight HF models are converted with the tree's own ``convert_hf_to_gguf.py`` (its
``gguf-py`` on the path; it imports ``sentencepiece``, in the ``dev`` extra) to an f32 GGUF,
then quantized by ``llama-quantize`` to Q8_0 / Q4_0 (cached per model file).

Qwen3.5 hybrids (``Qwen3_5ForCausalLM``, llama.cpp's ``qwen35`` architecture) and Qwen3-Next convert
with ``--no-mtp``: the converter expects multi-token-prediction tensors for these families and asserts
(``opt_num_mtp_layers != 0``) when a checkpoint has none, as our bench shapes have none.

The converter refuses a tokenizer whose pre-tokenizer hash it does not list (the built-in
tokenizer's); where that tokenizer's pre-tokenizer is the plain GPT-2 ``ByteLevel`` one, the
conversion names it ``gpt-2`` (llama.cpp's name for the same regex) instead of failing. Speed
does not depend on it; token counts come from the server's usage.

Anything missing (pip, cmake, a compiler, a failed build or conversion) raises
:class:`PeerUnavailable` with the reason; the caller skips the peer and says why.

    .venv/bin/python bench/peers/llamacpp.py MODEL_DIR      # build, convert, print the commands
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python sdist: vendored llama.cpp 0c1e570 (the tree measured in docs/benchmarks.md)
TYPES = ("Q8_0", "Q4_0")
BUILD_TIMEOUT_S = 3600


class PeerUnavailable(RuntimeError):
    """llama.cpp cannot be built or prepared here (the reason is the message)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kiln" / "peers"


def _run(cmd: list[str], what: str, timeout: float, **kw) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.SubprocessError) as exc:
        raise PeerUnavailable(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise PeerUnavailable(f"{what} failed ({done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
    return done.stdout


def source(version: str = VERSION) -> Path:
    """The vendored llama.cpp tree of the ``llama-cpp-python`` sdist ``version`` (downloaded once)."""
    root = cache_dir() / "src"
    tree = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={version}", "-d", str(root)], "pip download llama-cpp-python", 900)
    if not sdist.exists():
        raise PeerUnavailable(f"pip download left no {sdist.name} in {root}")
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    if not (tree / "CMakeLists.txt").exists():
        raise PeerUnavailable(f"{sdist.name} holds no vendor/llama.cpp")
    return tree


def build(version: str = VERSION, jobs: int | None = None) -> dict[str, Path]:
    """``{"server": llama-server, "quantize": llama-quantize}``, built once per version."""
    out = cache_dir() / f"llamacpp-{version}" / "build"
    bins = {"server": out / "bin" / "llama-server", "quantize": out / "bin" / "llama-quantize"}
    if all(p.exists() for p in bins.values()):
        return bins
    if shutil.which("cmake") is None:
        raise PeerUnavailable("no cmake on PATH")
    tree = source(version)
    _run(["cmake", "-S", str(tree), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON",
          "-DBUILD_SHARED_LIBS=OFF"], "cmake configure", 600)
    _run(["cmake", "--build", str(out), "--target", "llama-server", "llama-quantize", "-j",
          str(jobs or os.cpu_count() or 1)], "cmake build", BUILD_TIMEOUT_S)
    missing = [str(p) for p in bins.values() if not p.exists()]
    if missing:
        raise PeerUnavailable(f"the build produced no {', '.join(missing)}")
    return bins


# Run inside the converter's process: its own main, with an unknown GPT-2 ByteLevel pre-tokenizer named.
_CONVERT = """
import json, runpy, sys
tree, model = sys.argv[1], sys.argv[2]
sys.path[:0] = [tree + "/gguf-py", tree]
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        spec = json.load(open(model + "/tokenizer.json")).get("pre_tokenizer") or {}
        if spec.get("type") == "ByteLevel" and spec.get("use_regex", True):
            return "gpt-2"
        raise
base.TextModel.get_vocab_base_pre = pre
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _model_key(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json", model_dir / "tokenizer.json"]:
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{model_dir.name}-{digest.hexdigest()[:12]}"


MTP_FAMILIES = ("Qwen3_5", "Qwen3Next")  # architectures whose conversion needs --no-mtp without MTP tensors


def _convert_flags(model_dir: Path) -> list[str]:
    """``--no-mtp`` for a Qwen3.5 / Qwen3-Next checkpoint without ``mtp.*`` tensors (see the docstring)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = (cfg.get("architectures") or [""])[0]
    n_mtp = cfg.get("mtp_num_hidden_layers", cfg.get("text_config", {}).get("mtp_num_hidden_layers", 0))
    return ["--no-mtp"] if arch.startswith(MTP_FAMILIES) and not n_mtp else []


def convert(model_dir: Path, types: tuple[str, ...] = TYPES, version: str = VERSION) -> dict[str, Path]:
    """GGUF files of ``model_dir``: ``{"F32": ..., "Q8_0": ..., ...}`` (cached per model file)."""
    bins = build(version)
    tree = source(version)
    out = cache_dir() / "gguf" / _model_key(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"F32": out / "model-f32.gguf"}
    if not files["F32"].exists():
        tmp = out / "model-f32.gguf.tmp"
        _run([sys.executable, "-c", _CONVERT, str(tree), str(model_dir), *_convert_flags(model_dir),
              "--outtype", "f32", "--outfile", str(tmp)],
             "convert_hf_to_gguf.py", 900)
        tmp.rename(files["F32"])
    for t in types:
        files[t] = out / f"model-{t.lower()}.gguf"
        if not files[t].exists():
            tmp = out / f"model-{t.lower()}.gguf.tmp"
            _run([str(bins["quantize"]), str(files["F32"]), str(tmp), t], f"llama-quantize {t}", 900)
            tmp.rename(files[t])
    return files


def server_command(gguf: Path, threads: int, parallel: int, ctx_per_slot: int, alias: str,
                   version: str = VERSION) -> list[str]:
    """``llama-server`` on ``{port}`` (bench/serving.py's ``running_server`` fills it in): ``parallel``
    slots of ``ctx_per_slot`` tokens, continuous batching, ``threads`` threads for decode and prompts."""
    server = build(version)["server"]
    return [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}", "-t", str(threads),
            "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "--alias", alias,
            "--jinja", "--no-webui"]


def server_env() -> dict:
    """The environment for ``llama-server``: this one without Kiln's settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}


def main() -> None:
    model_dir = Path(sys.argv[1]).resolve()
    try:
        files = convert(model_dir)
    except PeerUnavailable as exc:
        print(f"llama.cpp peer unavailable: {exc}")
        raise SystemExit(1)
    print(json.dumps({k: str(v) for k, v in files.items()}, indent=2))
    for t, f in files.items():
        print(t, " ".join(server_command(f, os.cpu_count() or 1, 8, 1024, model_dir.name)))


if __name__ == "__main__":
    main()
