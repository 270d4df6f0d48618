"""The bundled SmolLM2-135M-Instruct end to end: Tandem's ``LLM()`` against Hugging Face.

``LLM()`` with no model converts the bundled GGUF (into a temporary cache here, so a fresh clone
and a warm machine run the same path) and serves it in float32. Hugging Face loads the same GGUF
through its own loader, so the reference shares nothing with our converter. Greedy decoding must
agree token for token.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_fixtures import assert_all_free

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 20
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    # Longer than several 16-token KV blocks, so the batch mixes one-block and many-block prompts.
    "Once upon a time, in a small village by the sea, there lived an old fisherman who went out "
    "every morning before dawn. One day, after a terrible storm had kept the boats in the harbour "
    "for a week, he found something strange tangled in his nets:",
    "List three colors:",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.mktemp("tandem-cache")))
        engine = LLM(dtype="float32")
    yield engine
    # Whatever the tests did, every request finished and gave its blocks back.
    assert not engine.engine.has_unfinished_requests()
    assert_all_free(engine.engine)


@pytest.fixture(scope="module")
def hf_model(llm: LLM):
    """Transformers' model of the same weights: read from the directory the
    GGUF was converted to, which test_gguf.py checks tensor by tensor against
    Transformers' own reading of the GGUF (that dequantizes in Python, about
    9 s of this module's set-up on a 2-core EPYC: once is enough)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32)
    # Like ignore_eos: EOS may be chosen and generation carries on past it.
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """One prompt at a time, so no padding enters the reference."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_all_blocks_free(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert_all_free(llm.engine)


def test_greedy_batch_matches_transformers(llm: LLM, hf_model) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    lengths = [len(o.prompt_token_ids) for o in outputs]
    assert min(lengths) < 16 < 48 < max(lengths), lengths  # mixed: one block to several
    assert outputs[0].outputs[0].text.startswith(" Paris.")
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        completion = output.outputs[0]
        assert output.prompt_token_ids == llm.get_tokenizer().encode(prompt)
        assert completion.finish_reason == "length"
        assert completion.token_ids == hf_greedy(hf_model, output.prompt_token_ids, MAX_TOKENS), (
            prompt
        )
    assert_all_blocks_free(llm)


def test_chat_applies_chatml_template(llm: LLM) -> None:
    from transformers import AutoTokenizer

    (output,) = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)

    # The converted directory is a valid Hugging Face one: its tokenizer renders the same ChatML.
    reference = AutoTokenizer.from_pretrained(str(llm.engine.model_dir))
    want = reference.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert output.prompt_token_ids == want
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(want, skip_special_tokens=False).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    completion = output.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # stopped at <|im_end|>, not at max_tokens
    assert_all_blocks_free(llm)


def test_three_tensor_parallel_ranks_match_transformers(llm: LLM, hf_model) -> None:
    """SmolLM2's 9 heads and 3 kv heads split over three gloo ranks."""
    split = LLM(str(llm.engine.model_dir), dtype="float32", tensor_parallel_size=3)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = split.generate(PROMPTS[:2], params, use_tqdm=False)
        for output in outputs:
            assert output.outputs[0].token_ids == hf_greedy(
                hf_model, output.prompt_token_ids, MAX_TOKENS)
        assert_all_blocks_free(split)
    finally:
        split.engine.shutdown()


def test_gptq_8bit_quantized_copy_keeps_the_greedy_tokens(llm: LLM, tmp_path) -> None:
    """`tandem quantize` at 8 bits, groups of 64: measured identical for
    these prompts over 32 tokens (benchmarks/quantized.py)."""
    from engine.quantization.writer import quantize_model

    qdir = quantize_model(str(llm.engine.model_dir), tmp_path / "gptq8", "gptq", 8, 64)
    quantized = LLM(str(qdir), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in quantized.generate(PROMPTS[:2], params, use_tqdm=False)]
    assert got == want
    assert quantized.get_tokenizer() is not None  # the tokenizer travelled with the weights
