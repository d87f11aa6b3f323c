"""Tiny Qwen3.5 hybrids (Gated DeltaNet + full attention) built at test time, offline, in well under
a second: random weights, the built-in model's tokenizer and chat template."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def hybrid_text_kwargs(vocab_size: int, eos: int, pad: int) -> dict:
    """Linear-attention and full-attention layers 2:1, twice (a full-attention layer before linear ones:
    its output at padded positions is not zero), grouped heads on both."""
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 2
                + ["full_attention"], max_position_embeddings=4096,
                initializer_range=0.1, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)


def build_tiny_hybrid(out: Path, tokenizer_dir: Path, *, multimodal: bool = False, seed: int = 0) -> Path:
    """``Qwen3_5ForCausalLM`` (or, ``multimodal``, the published ``Qwen3_5ForConditionalGeneration``
    layout with a ``text_config`` and a one-block vision tower) saved as safetensors in ``out``."""
    import torch
    from transformers import (AutoTokenizer, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5TextConfig)

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = hybrid_text_kwargs(len(tok), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    if multimodal:
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def greedy_rows(engine, batch: list[list[int]], new_tokens: int, deadline_s: float) -> list[list[int]]:
    """``engine``'s greedy continuations of ``batch`` (every prompt queued before the first cycle)."""
    from kiln.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    subs = [engine.submit(p, [params], incremental=False) for p in batch]
    out = []
    for sub in subs:
        stream, row = sub.streams[0], sub._rows[0]
        while (chunk := stream.next_chunk_sync(deadline_s)) is not None and chunk.finish_reason is None:
            pass
        out.append(list(row.generated))
    return out
