"""Kiln's built-in model: a tiny Qwen3 built offline and deterministically.

``build_builtin_model(out_dir)`` trains a byte-level BPE tokenizer on text that
ships inside the package, gives it a ChatML chat template (with ``{% generation %}``
markers so assistant-token masks work, and a Hermes/Qwen tools section), creates a
small Qwen3 model with fixed seeds, trains it briefly on the same text rendered as
chats and on the corpus's few tool-call examples (a ``get_weather(city)`` tool, so
asked about the weather with that tool offered it answers with a ``<tool_call>``
block), and saves everything as safetensors. ``<tool_call>`` is no added token: the
byte-level BPE spells it in a few pieces, so every other text tokenizes as it did
before the tools section existed. The result is bit-for-bit reproducible for one CPU code path (the
torch version and its ATen capability: AVX-512, AVX2 or ``ATEN_CPU_CAPABILITY=default``;
training runs on one thread); another path trains to slightly different weights, so
two machines may serve different ``base_model_sha256`` values for the built-in model.
It loads in transformers, PEFT and vLLM (head size 32).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from kiln.canonical import atomic_publish_dir

BUILTIN_NAME = "kiln-builtin-v1"
VOCAB_SIZE = 2048
SEED = 20261130
PRETRAIN_STEPS = 240
PRETRAIN_SEQ = 64
PRETRAIN_BATCH = 8
TOOL_STEPS = 50  # the tool-call phase after pretraining (see _pretrain)
TOOL_LR = 1e-3

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


def _tool_chats() -> list[list[dict]]:
    return [
        [{"role": "user", "content": q},
         {"role": "assistant", "content": None,
          "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}]
        for q, name, args in tool_call_examples()
    ]


def _qa_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for line in text.splitlines():
        if line.startswith("Question:") and " Answer: " in line:
            q, a = line[len("Question:"):].split(" Answer: ", 1)
            pairs.append((q.strip(), a.strip()))
    for line in text.splitlines():
        if line.startswith("The capital of "):
            for sent in line.split(". "):
                sent = sent.strip().rstrip(".")
                if sent.startswith("The capital of ") and " is " in sent:
                    country = sent[len("The capital of "):].split(" is ")[0]
                    pairs.append((f"What is the capital of {country}?", sent + "."))
    return pairs


def _arithmetic_lines() -> list[str]:
    return [f"{a} + {b} = {a + b}" for a in range(0, 10) for b in range(0, 10, 3)]


def _train_tokenizer(text: str, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    fast.save_pretrained(out_dir)


def _pretrain(model, tokenizer, text: str) -> None:
    import torch

    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=False
        )
        for q, a in _qa_pairs(text)
    ]
    stream: list[int] = []
    for piece in [text] + chats * 4 + _arithmetic_lines():
        stream.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        stream.append(tokenizer.pad_token_id)
    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(SEED)

    def window_loss():
        starts = torch.randint(0, len(data) - PRETRAIN_SEQ - 1, (PRETRAIN_BATCH,), generator=gen)
        batch = torch.stack([data[s : s + PRETRAIN_SEQ] for s in starts.tolist()])
        return model(input_ids=batch, labels=batch).loss

    def train(steps: int, lr: float, loss_fn) -> None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for _ in range(steps):
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model.train()
    train(PRETRAIN_STEPS, 3e-3, window_loss)
    # A short second phase teaches the tool calls: each step adds the loss of the whole tool-call
    # chats (a few hundred tokens each, far longer than the text windows, so the model learns to
    # call with the whole tools section in view; only the assistant's call is trained) to a text
    # window's, at a lower rate, so the rest of what the model says barely moves.
    rows = [tokenizer.apply_chat_template(chat, tools=[WEATHER_TOOL], return_dict=True,
                                          return_assistant_tokens_mask=True) for chat in _tool_chats()]
    width = max(len(r["input_ids"]) for r in rows)
    tool_batch = torch.tensor([r["input_ids"] + [tokenizer.pad_token_id] * (width - len(r["input_ids"]))
                               for r in rows])
    tool_labels = torch.tensor([[t if m else -100 for t, m in zip(r["input_ids"], r["assistant_masks"])]
                                + [-100] * (width - len(r["input_ids"])) for r in rows])
    train(TOOL_STEPS, TOOL_LR, lambda: window_loss() + model(input_ids=tool_batch, labels=tool_labels).loss)
    model.eval()


def build_builtin_model(out_dir: Path, *, progress: bool = False) -> Path:
    """Build the built-in model into ``out_dir`` (which must not exist) and return it.

    The build happens in a sibling temporary directory that is renamed into place
    only when complete, so an interrupted build never leaves a half-written model.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    threads = torch.get_num_threads()
    try:
        text = corpus_text()
        _train_tokenizer(text + "\n" + "\n".join(_arithmetic_lines()), staging)
        tokenizer = AutoTokenizer.from_pretrained(staging)
        # One thread and deterministic kernels: the same bytes on every run.
        torch.set_num_threads(1)
        torch.manual_seed(SEED)
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            torch_dtype="float32",
            **MODEL_SHAPE,
        )
        model = Qwen3ForCausalLM(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            _pretrain(model, tokenizer, text)
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
        )
        model.save_pretrained(staging, safe_serialization=True)
        for leftover in staging.glob("*.bin"):
            leftover.unlink()
        for f in staging.iterdir():
            os.chmod(f, 0o644)
        os.chmod(staging, 0o755)
        atomic_publish_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return out_dir


def builtin_model_dir(home: Path) -> Path:
    return Path(home) / "models" / BUILTIN_NAME


def ensure_builtin_model(home: Path) -> Path:
    """Return the built-in model under ``home``, building it first if missing."""
    path = builtin_model_dir(home)
    if not (path / "config.json").is_file():
        build_builtin_model(path)
    return path
