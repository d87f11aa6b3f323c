"""A Qwen3 with the real Qwen3 tokenizer and template whose next token depends only on the last one.

Random weights never write a ``<think>`` span, so reasoning through training and evals cannot be tested
with them. :func:`scripted_qwen3_dir` builds (once per cache) a one-layer Qwen3 whose attention and MLP
write nothing (``o_proj`` and ``down_proj`` are zero), so the final norm sees the last token's embedding
alone, and whose untied output head maps each token of ``SCRIPT`` to its successors: every successor's row
is 10x the normalised embedding of its predecessor, so it outscores every other token by hundreds of
logits on any CPU path, and successors that share their predecessors tie exactly (sampling picks between
them with the row's seed). The script (Qwen3 token IDs):

* thinking prompt (ends ``assistant\\n``) -> ``<think>`` -> ``banana`` -> ``</think>`` -> `` banana`` or
  ``apple`` -> ``<|im_end|>``;
* ``enable_thinking: false`` prompt (ends ``</think>\\n\\n``) -> `` banana`` or ``apple`` -> ``<|im_end|>``.

So with thinking on every answer reasons "banana" and answers "banana" or "apple" half the time each; a
reward that reads the reasoning sees "banana" in every completion.
"""

from __future__ import annotations

from pathlib import Path

from tests.realtok import _cache, publish, real_tokenizer_dir, staged_tokenizer

NL, NLNL, THINK, END_THINK, BANANA, SP_BANANA, APPLE, IM_END = 198, 271, 151667, 151668, 87747, 43096, 22377, 151645
SCRIPT: dict[int, tuple[int, ...]] = {NL: (THINK,), THINK: (BANANA,), BANANA: (END_THINK,),
                                      END_THINK: (SP_BANANA, APPLE), NLNL: (SP_BANANA, APPLE),
                                      SP_BANANA: (IM_END,), APPLE: (IM_END,)}
HIDDEN = 64
MARGIN = 10.0


def scripted_qwen3_dir() -> Path:
    tok_dir = real_tokenizer_dir("qwen3")
    target = _cache() / "real-models" / "qwen3-scripted-v1"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    staged = staged_tokenizer(tok_dir, target)
    tok = AutoTokenizer.from_pretrained(staged)
    for word, ids in (("<think>", [THINK]), ("</think>", [END_THINK]), ("banana", [BANANA]),
                      (" banana", [SP_BANANA]), ("apple", [APPLE]), ("\n\n", [NLNL]), ("\n", [NL])):
        assert tok.encode(word, add_special_tokens=False) == ids, word
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=False, eos_token_id=IM_END, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_()
        head = model.lm_head.weight
        head.zero_()
        for prev, nexts in SCRIPT.items():
            unit = emb[prev] / emb[prev].pow(2).mean().sqrt()
            for n in nexts:
                head[n] += MARGIN * unit
    model.save_pretrained(str(staged), safe_serialization=True)
    return publish(staged, target)
