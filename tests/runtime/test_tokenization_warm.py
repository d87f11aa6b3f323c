"""``Tokenization.warm``: the chat template is compiled when the engine starts, not in the first request."""

from __future__ import annotations

import copy

import pytest

from kiln.runtime.loader import load_model
from kiln.runtime.tokenization import Tokenization


@pytest.fixture(scope="module")
def loaded(builtin_model_dir):
    return load_model(builtin_model_dir)


def _compiles():
    from transformers.utils import chat_template_utils

    return chat_template_utils._compile_jinja_template.cache_info().misses


def test_warm_compiles_the_template_so_the_first_request_does_not(loaded):
    tok = copy.deepcopy(loaded.tokenizer)
    tok.chat_template = tok.chat_template + "{# warm-test #}"  # a template no earlier test compiled
    tokens = Tokenization(tok, loaded.model)
    before = _compiles()
    tokens.warm()
    assert _compiles() == before + 1
    ids = tokens.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert ids and _compiles() == before + 1


def test_warm_survives_a_template_that_refuses_a_lone_user_message(loaded):
    tok = copy.deepcopy(loaded.tokenizer)
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message "
                         "comes first') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokens = Tokenization(tok, loaded.model)
    before = _compiles()
    tokens.warm()  # refused by the template's own check, compiled all the same
    assert _compiles() == before + 1
    with pytest.raises(Exception, match="system message comes first"):
        tokens.render_chat([{"role": "user", "content": "hi"}])
    assert tokens.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]).startswith("SU")
