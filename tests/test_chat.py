"""`LLM.chat` against vLLM's signature, with transformers' `apply_chat_template` over the same
tokenizer as the reference for the prompt text (and the tokenizer's ids of that text, no special
tokens added, as the prompt ids)."""

import pytest

from mambaserve import LLM, SamplingParams
from tests.tokenized import tokenized_checkpoint

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
PARAMS = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def llm():
    return LLM(tokenized_checkpoint(), dtype="float32", device="cpu", max_num_seqs=4)


def test_chat_template_argument_replaces_the_tokenizers(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello there"}]
    [out] = llm.chat(conv, PARAMS, use_tqdm=False, chat_template=TEMPLATE)
    text = tok.apply_chat_template(conv, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert text.startswith("[system] Be brief\n") and out.prompt == text
    assert out.prompt_token_ids == tok(text, add_special_tokens=False)["input_ids"]
    alone = llm.generate({"prompt_token_ids": out.prompt_token_ids}, PARAMS, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    # the tokenizer's own template is untouched for the next call
    [plain] = llm.chat(conv, PARAMS, use_tqdm=False)
    assert plain.prompt == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) != text


def test_content_parts_as_plain_strings_are_text(llm):
    """vLLM takes a plain string in a content list as a text part (it was refused: 'only text
    content parts are supported'); parts are joined with newlines either way."""
    tok = llm.get_tokenizer()
    parts = [{"role": "user", "content": ["Hello", {"type": "text", "text": "there"}]}]
    [out] = llm.chat(parts, PARAMS, use_tqdm=False)
    flat = [{"role": "user", "content": "Hello\nthere"}]
    assert out.prompt == tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
