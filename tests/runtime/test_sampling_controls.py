"""Penalties, logit bias, min_p, min_tokens, stop_token_ids and bad words in the batched sampler,
checked against transformers' logits processors on the same inputs (and, for the penalties
OpenAI defines but transformers lacks, against their formula)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from kiln.runtime.sampling import SamplingParams, adjust_logits, make_generator, select_tokens

VOCAB = 50
EOS = 49


class Hist:
    def __init__(self, prompt, generated, eos_ids=frozenset({EOS})):
        self.prompt, self.generated, self.eos_ids = list(prompt), list(generated), eos_ids


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, VOCAB, generator=g) * 3
    prompt = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    generated = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    return logits, prompt, generated


def test_repetition_penalty_matches_transformers():
    for seed in range(20):
        logits, prompt, generated = _case(seed)
        for penalty in (0.7, 1.3, 2.0):
            ours = adjust_logits(logits, [SamplingParams(max_tokens=1, temperature=0, repetition_penalty=penalty)],
                                 [Hist(prompt, generated)])
            ids = torch.tensor([prompt + generated])
            theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
            torch.testing.assert_close(ours, theirs)
            greedy = select_tokens(logits, [SamplingParams(max_tokens=1, temperature=0, repetition_penalty=penalty)],
                                   [None], rows=[Hist(prompt, generated)])[0].token_id
            assert greedy == int(theirs.argmax())


def test_logit_bias_matches_sequence_bias():
    logits, prompt, generated = _case(1)
    bias = ((3, 5.0), (7, -100.0), (int(logits.argmax()), -50.0))
    ours = adjust_logits(logits, [SamplingParams(max_tokens=1, logit_bias=bias)], [Hist(prompt, generated)])
    theirs = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(torch.tensor([prompt + generated]), logits.clone())
    torch.testing.assert_close(ours, theirs)


def test_min_tokens_matches_transformers_and_stop_ids_count_as_ends():
    logits, prompt, generated = _case(2)
    logits[0, EOS] = 100.0  # eos would win
    p = SamplingParams(max_tokens=10, temperature=0, min_tokens=8)
    ids = torch.tensor([prompt + generated])
    theirs = MinNewTokensLengthLogitsProcessor(len(prompt), 8, EOS)(ids, logits.clone())
    torch.testing.assert_close(adjust_logits(logits, [p], [Hist(prompt, generated)]), theirs)
    assert select_tokens(logits, [p], [None], rows=[Hist(prompt, generated)])[0].token_id != EOS
    # reached: eos is allowed again
    assert select_tokens(logits, [p], [None], rows=[Hist(prompt, generated + [0, 0, 0])])[0].token_id == EOS
    # stop_token_ids are end tokens too
    logits[0, 5] = 200.0
    p2 = SamplingParams(max_tokens=10, temperature=0, min_tokens=8, stop_token_ids=frozenset({5}))
    assert select_tokens(logits, [p2], [None], rows=[Hist(prompt, generated)])[0].token_id not in (5, EOS)
    # ignore_eos leaves eos alone (it cannot end the row anyway)
    p3 = SamplingParams(max_tokens=10, temperature=0, min_tokens=8, ignore_eos=True)
    assert select_tokens(logits[:, :], [p3], [None], rows=[Hist(prompt, generated)])[0].token_id == 5


def test_bad_words_match_transformers():
    for seed in range(10):
        logits, prompt, generated = _case(seed)
        top = int(logits.argmax())
        words = [(top,), (generated[-1], 11), (generated[-2], generated[-1], 12), (13, 14)]
        ours = adjust_logits(logits, [SamplingParams(max_tokens=1, bad_words=tuple(words))], [Hist(prompt, generated)])
        theirs = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=EOS)(
            torch.tensor([prompt + generated]), logits.clone())
        torch.testing.assert_close(ours, theirs)


def test_frequency_and_presence_penalties_follow_openai_formula():
    logits, prompt, generated = _case(3)
    generated = [4, 4, 4, 9]
    p = SamplingParams(max_tokens=1, frequency_penalty=0.5, presence_penalty=1.5)
    out = adjust_logits(logits, [p], [Hist(prompt, generated)])
    expected = logits.clone()
    expected[0, 4] -= 3 * 0.5 + 1.5
    expected[0, 9] -= 1 * 0.5 + 1.5
    torch.testing.assert_close(out, expected)  # prompt tokens are not penalized (OpenAI, vLLM)


def test_min_p_keeps_what_transformers_keeps():
    for seed in range(10):
        logits, _, _ = _case(seed)
        for min_p, temp in ((0.05, 1.0), (0.3, 0.7), (0.9, 1.5)):
            p = SamplingParams(max_tokens=1, temperature=temp, min_p=min_p)
            warped = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temp)(None, logits.clone()))
            allowed = set(torch.isfinite(warped[0]).nonzero().flatten().tolist())
            picks = {select_tokens(logits, [p], [make_generator(s)])[0].token_id for s in range(40)}
            assert picks <= allowed


def test_neighbours_and_logprobs_unaffected():
    logits, prompt, generated = _case(4)
    both = torch.cat([logits, logits])
    plain = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
    biased = SamplingParams(max_tokens=1, temperature=0, logprobs=1, logit_bias=((0, 100.0),))
    out = select_tokens(both, [biased, plain], [None, None], rows=[Hist(prompt, generated)] * 2)
    assert out[0].token_id == 0 and out[1].token_id == int(logits.argmax())
    # logprobs stay those of the raw model distribution (vLLM's default)
    raw = logits.log_softmax(-1)[0]
    assert abs(out[0].logprob - float(raw[0])) < 1e-5
