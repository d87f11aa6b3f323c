"""Engine building blocks: incremental text with stop sequences, prompt-logprob rows, sampling filters."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.sampling import SamplingParams, select_tokens
from kiln.runtime.scoring import prompt_logprob_rows
from kiln.runtime.textstream import TextStream


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_model_dir)


def feed(ts: TextStream, ids):
    out = []
    for i in ids:
        out.append(ts.push(i))
        if ts.stopped:
            break
    else:
        out.append(ts.flush())
    return "".join(out)


def test_textstream_roundtrip_multibyte(tokenizer):
    text = "héllo wörld, 3 + 4 = 7 ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert feed(TextStream(tokenizer), ids) == text


def test_textstream_stop_spanning_tokens_is_trimmed_and_never_leaked(tokenizer):
    text = "The capital of France is Paris. More text"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ts = TextStream(tokenizer, stop=("is Par", "never"))
    released = []
    for i in ids:
        released.append(ts.push(i))
        assert "is Par" not in "".join(released)
        if ts.stopped:
            break
    assert ts.stopped
    assert "".join(released) == "The capital of France "


def test_prompt_logprob_rows_shape_and_ranks():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    rows = prompt_logprob_rows(logits, [1, 0, 2], k=2)
    assert rows[0] is None
    # position 1 (token 0) scored by logits[0]: token 0 has rank 4, top-2 are 1 and 3 -> 3 entries, actual first
    assert [e.token_id for e in rows[1]] == [0, 1, 3]
    assert [e.rank for e in rows[1]] == [4, 1, 2]
    lp = logits[0].log_softmax(-1)
    assert rows[1][0].logprob == pytest.approx(lp[0].item())
    # position 2 (token 2) scored by logits[1] = [5, 0, 0, 1]: tied with token 1, both count -> rank 4
    assert rows[2][0].token_id == 2 and rows[2][0].rank == 4
    assert len(rows[2]) == 3
    # actual token inside the top k -> k entries, rank from the top-k order
    rows = prompt_logprob_rows(logits, [1, 0, 0], k=2)
    assert [e.token_id for e in rows[2]] == [0, 3] and rows[2][0].rank == 1


def test_select_tokens_greedy_topk_topp_and_seeds():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9], [0.0, 5.0, 1.0, 4.9]])
    greedy = SamplingParams(max_tokens=1, temperature=0, logprobs=2)
    out = select_tokens(logits, [greedy, greedy], [None, None])
    assert [o.token_id for o in out] == [1, 1]
    assert [t for t, _ in out[0].top] == [1, 3]
    # top_k=1 makes sampling deterministic; top_p tiny keeps only the best token
    k1 = SamplingParams(max_tokens=1, temperature=1.0, top_k=1)
    p0 = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01)
    assert [o.token_id for o in select_tokens(logits, [k1, p0], [None, None])] == [1, 1]
    # top_k=2 never picks outside {1, 3}
    k2 = SamplingParams(max_tokens=1, temperature=2.0, top_k=2)
    gen = torch.Generator().manual_seed(0)
    picks = {select_tokens(logits[:1], [k2], [gen])[0].token_id for _ in range(50)}
    assert picks == {1, 3}
    # the same seed gives the same draws
    a = [select_tokens(logits[:1], [k2], [torch.Generator().manual_seed(7)])[0].token_id for _ in range(5)]
    assert len(set(a)) == 1
