"""The recipe that trained the built-in model's shipped tokenizer and weights.

:mod:`kiln.runtime.builtin` ships the result; this module reproduces it. It trains
a byte-level BPE tokenizer on the corpus that ships in the package, creates the
built-in Qwen3 with fixed seeds, trains it on one thread on the corpus's text,
the same text rendered as chats and its tool-call examples, and publishes the
directory as :func:`kiln.runtime.builtin.write_model_dir` does for the shipped
files. Under ``ATEN_CPU_CAPABILITY=default`` on x86-64 it reproduces the shipped
bytes exactly; another ATen path (AVX2, AVX-512) trains to slightly different
weights, which is why the build does not train.

To retrain after changing the corpus or the recipe, then ship the result::

    ATEN_CPU_CAPABILITY=default python -m kiln.runtime.builtin_train /tmp/kiln-builtin
    cp /tmp/kiln-builtin/{model.safetensors,tokenizer.json} src/kiln/runtime/builtin_weights/

and put the two SHA-256 it prints into :data:`kiln.runtime.builtin.SHIPPED`.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

from kiln.runtime.builtin import (
    SPECIAL_TOKENS,
    WEATHER_TOOL,
    corpus_text,
    model_config,
    tokenizer_from_json,
    tool_call_examples,
    write_model_dir,
)

VOCAB_SIZE = 2048
SEED = 20261130
PRETRAIN_STEPS = 240
PRETRAIN_SEQ = 64
PRETRAIN_BATCH = 8
TOOL_STEPS = 50  # the tool-call phase after pretraining (see _pretrain)
TOOL_LR = 1e-3


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
    """A byte-level BPE tokenizer trained on ``text``, saved as the built-in tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
    fast = tokenizer_from_json(tok.to_str())
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


def train_builtin_model(out_dir: Path) -> Path:
    """Train the built-in model on this CPU and publish it at ``out_dir`` (which must not exist)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="kiln-builtin-train-") as tmp:
        work = Path(tmp)
        text = corpus_text()
        _train_tokenizer(text + "\n" + "\n".join(_arithmetic_lines()), work / "tokenizer")
        tokenizer_json = (work / "tokenizer" / "tokenizer.json").read_bytes()
        tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
        try:
            # One thread and deterministic kernels: the same bytes on every run.
            torch.set_num_threads(1)
            torch.manual_seed(SEED)
            model = Qwen3ForCausalLM(model_config(tokenizer))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED)
                _pretrain(model, tokenizer, text)
        finally:
            torch.set_num_threads(threads)
        model.save_pretrained(work / "model", safe_serialization=True)
        weights = (work / "model" / "model.safetensors").read_bytes()
    return write_model_dir(out_dir, tokenizer_json, weights)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kiln.runtime.builtin_train OUT_DIR", file=sys.stderr)
        return 2
    out = train_builtin_model(Path(argv[0]))
    for name in ("tokenizer.json", "model.safetensors"):
        print(f"{hashlib.sha256((out / name).read_bytes()).hexdigest()}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
