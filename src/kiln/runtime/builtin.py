"""Kiln's built-in model: a tiny Qwen3 that ships inside the package.

Its two trained parts ship in ``builtin_weights/`` with their SHA-256 pinned in
:data:`SHIPPED`: ``tokenizer.json`` (a byte-level BPE tokenizer) and
``model.safetensors`` (float32, 1.5 MB). ``build_builtin_model(out_dir)`` checks
both digests, writes them beside the config, generation config and chat template
it derives from the constants here (a ChatML template with ``{% generation %}``
markers so assistant-token masks work, and a Hermes/Qwen tools section), and
publishes the directory in one rename. It trains nothing and needs no network,
so every machine builds the same bytes and serves the same ``base_model_sha256``
and the same greedy answers.

:mod:`kiln.runtime.builtin_train` is the recipe that trained the shipped files
from the corpus beside them (``corpus/builtin.txt``: plain text, questions and
answers, and a few ``get_weather(city)`` tool-call examples, so asked about the
weather with that tool offered the model answers with a ``<tool_call>`` block).
Training is bit-for-bit reproducible only on one CPU code path (ATen's
AVX-512, AVX2 and default kernels sum in different orders), which is why the
result ships instead of being trained at build time; the shipped files were
trained under ``ATEN_CPU_CAPABILITY=default``, which any x86-64 CPU can run.
``<tool_call>`` is no added token: the byte-level BPE spells it in a few pieces.
The model loads in transformers, PEFT and vLLM (head size 32).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from kiln.canonical import atomic_publish_dir
from kiln.errors import Internal

log = logging.getLogger(__name__)

BUILTIN_NAME = "kiln-builtin-v1"
WEIGHTS_DIR = "builtin_weights"  # inside the kiln.runtime package
# SHA-256 of each shipped file; build_builtin_model refuses files that do not match.
SHIPPED = {
    "tokenizer.json": "ebac59a19588e4a257c5d973e49c058284f4741556d4a34d17fe7dc625dd4677",
    "model.safetensors": "7a481c9926df16f100d5684a2b7c7f3e75c098acd1d05d44ca22ac4e4a7ba041",
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CALL_PREFIX = "Call: "  # corpus lines that are tool-call examples, not plain text

# The tool the corpus's tool-call examples are rendered with.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# ChatML; with ``tools`` the Hermes/Qwen tools section: the tools as JSON lines in a system turn
# (after the caller's system message, if any), assistant calls as ``<tool_call>`` JSON blocks and
# tool results as ``<tool_response>`` blocks in a user turn. Without tools and tool messages it
# renders exactly as the plain ChatML template did before the tools section existed.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call>'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{%- if (message['content'] or '') or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def _corpus_file() -> str:
    return resources.files("kiln.runtime").joinpath("corpus/builtin.txt").read_text("utf-8")


def corpus_text() -> str:
    """The corpus's plain text (without its tool-call example lines)."""
    return "".join(line for line in _corpus_file().splitlines(keepends=True) if not line.startswith(CALL_PREFIX))


def tool_call_examples() -> list[tuple[str, str, dict]]:
    """The corpus's tool-call examples: ``(question, tool name, arguments)`` from lines
    ``Call: <question> -> <tool name> <arguments as JSON>``."""
    import json

    examples = []
    for line in _corpus_file().splitlines():
        if line.startswith(CALL_PREFIX):
            question, call = line[len(CALL_PREFIX):].split(" -> ", 1)
            name, arguments = call.split(" ", 1)
            examples.append((question.strip(), name, json.loads(arguments)))
    return examples


class BuiltinModelError(Internal):
    """The built-in model's files are not the ones this Kiln ships."""

    code = "builtin_model_mismatch"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def shipped_bytes(name: str) -> bytes:
    """One shipped file (``tokenizer.json`` or ``model.safetensors``), its SHA-256 checked."""
    data = resources.files("kiln.runtime").joinpath(f"{WEIGHTS_DIR}/{name}").read_bytes()
    digest = _sha256(data)
    if digest != SHIPPED[name]:
        raise BuiltinModelError(
            f"the packaged built-in model file {name} has SHA-256 {digest}, expected {SHIPPED[name]}",
            hint="reinstall Kiln: the package's files were changed")
    return data


def tokenizer_from_json(tokenizer_json: str):
    """The built-in tokenizer (special tokens, chat template, left padding) around a tokenizers JSON."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def model_config(tokenizer):
    """The built-in model's ``Qwen3Config`` for ``tokenizer``."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        architectures=["Qwen3ForCausalLM"],
        **MODEL_SHAPE,
    )


def write_model_dir(out_dir: Path, tokenizer_json: bytes, weights: bytes) -> Path:
    """Publish a built-in model directory at ``out_dir`` (which must not exist) from its tokenizer JSON
    and safetensors weights; the other files derive from them and the constants above.

    The files are written in a sibling temporary directory that is renamed into place only when
    complete, so an interrupted build never leaves a half-written model.
    """
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        tokenizer = tokenizer_from_json(tokenizer_json.decode("utf-8"))
        tokenizer.save_pretrained(staging)
        (staging / "tokenizer.json").write_bytes(tokenizer_json)  # the exact bytes, not a re-serialization
        model_config(tokenizer).save_pretrained(staging)
        GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         do_sample=False).save_pretrained(staging)
        (staging / "model.safetensors").write_bytes(weights)
        for f in staging.iterdir():
            os.chmod(f, 0o644)
        os.chmod(staging, 0o755)
        atomic_publish_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def build_builtin_model(out_dir: Path) -> Path:
    """Build the built-in model into ``out_dir`` (which must not exist) from the shipped files and return it."""
    return write_model_dir(out_dir, shipped_bytes("tokenizer.json"), shipped_bytes("model.safetensors"))


def verify_builtin_model(path: Path) -> Path:
    """Check that a built-in model directory holds the shipped tokenizer and weights; return it."""
    for name, expected in SHIPPED.items():
        f = Path(path) / name
        digest = _sha256(f.read_bytes()) if f.is_file() else "missing"
        if digest != expected:
            raise BuiltinModelError(
                f"{f} has SHA-256 {digest}, but this Kiln's built-in model has {expected} "
                "(an earlier Kiln trained the model on the local CPU, so its weights differed between machines)",
                hint=f"rebuild it: kiln model init --force {path}")
    return Path(path)


def builtin_model_dir(home: Path) -> Path:
    return Path(home) / "models" / BUILTIN_NAME


def ensure_builtin_model(home: Path) -> Path:
    """Return the built-in model under ``home``, building it first if missing and checking it if present.

    The directory is Kiln's own copy of a shipped artifact: one that does not match (an earlier Kiln
    trained it on the local CPU) is moved aside to ``<dir>.stale`` (replacing an older one there) and
    built again from the shipped files, so ``kiln serve`` keeps working after an upgrade. Adapters
    trained on the old weights name the old base hash and are refused by it, as they should be."""
    path = builtin_model_dir(home)
    if not (path / "config.json").is_file():
        build_builtin_model(path)
    try:
        return verify_builtin_model(path)
    except BuiltinModelError as exc:
        stale = path.with_name(path.name + ".stale")
        log.warning("%s; moving it to %s and building the shipped model", exc.message, stale)
        if stale.exists():
            shutil.rmtree(stale)
        path.rename(stale)
        build_builtin_model(path)
        return verify_builtin_model(path)


def bench_model_path() -> Path:
    """The built-in model for benchmarks and scripts outside a Kiln home: built once (from the shipped files,
    in well under a second) under the system temp dir and checked on every use."""
    return ensure_builtin_model(Path(tempfile.gettempdir()) / "kiln-bench-home")
