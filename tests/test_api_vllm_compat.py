"""Code written for vLLM's offline ``LLM`` runs on ``tandem.LLM`` with the
same meaning: prompt dicts, stop tokens kept out of the text, ``min_tokens``
against stop strings, ``Logprob`` objects, ``max_tokens=None``,
``detokenize=False``, vLLM's constructor and chat arguments."""

from __future__ import annotations

import pickle

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_all_free,
    tiny_llm,
    tiny_with_tokenizer,
    with_generation_config,
)

from engine.prompts import bad_word_ids
from tandem import LLM, SamplingParams
from tandem.llm import engine_config

PROMPT = "the quick brown fox"
VOCAB_OUTSIDE = VOCAB + 5


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 8, **kwargs})


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


def one(llm, prompt, params):
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    return out


def test_prompt_dicts(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    want = one(llm, PROMPT, greedy()).outputs[0].token_ids
    by_ids = one(llm, {"prompt_token_ids": ids}, greedy())
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == want
    (by_text,) = llm.generate([{"prompt": PROMPT}], greedy(), use_tqdm=False)
    assert by_text.prompt == PROMPT and by_text.outputs[0].token_ids == want
    for bad in ({"prompt": PROMPT, "multi_modal_data": {}}, {"text": PROMPT},
                {"prompt_token_ids": "abc"}):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, greedy(), use_tqdm=False)
    assert llm.generate([], greedy(), use_tqdm=False) == []
    assert_all_free(llm.engine)


def test_a_stop_token_ends_the_ids_but_not_the_text(llm):
    tok = llm.get_tokenizer()
    free = one(llm, PROMPT, greedy()).outputs[0].token_ids
    # The first generated token whose text is not empty, as the stop token.
    at = next(i for i, t in enumerate(free) if tok.decode([t]) and free.index(t) == i)
    stop = free[at]
    out = one(llm, PROMPT, greedy(stop_token_ids=[stop])).outputs[0]
    assert out.token_ids == free[: at + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == tok.decode(free[:at]) != tok.decode(free[: at + 1])
    kept = one(llm, PROMPT, greedy(stop_token_ids=[stop], include_stop_str_in_output=True))
    assert kept.outputs[0].text == tok.decode(free[: at + 1])


def test_stop_strings_wait_for_min_tokens(llm):
    free = one(llm, PROMPT, greedy()).outputs[0]
    stop = free.text.strip()[:1]
    assert stop
    early = one(llm, PROMPT, greedy(stop=[stop])).outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    late = one(llm, PROMPT, greedy(stop=[stop], min_tokens=8)).outputs[0]
    assert late.finish_reason == "length" and late.token_ids == free.token_ids
    assert late.text == free.text


def test_logprobs_are_vllm_logprob_objects(llm):
    tok = llm.get_tokenizer()
    out = one(llm, PROMPT, greedy(logprobs=2, prompt_logprobs=1))
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids) == 8
    total = 0.0
    for token, entry in zip(comp.token_ids, comp.logprobs):
        chosen = entry[token]
        assert chosen.rank == 1  # greedy, no penalties: the most likely token
        assert isinstance(chosen.logprob, float) and chosen.logprob == float(chosen) <= 0
        top = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top][:2] == [1, 2] and top[0].logprob >= top[1].logprob
        for tid, lp in entry.items():
            assert lp.decoded_token == tok.decode([tid], False)
        total += chosen.logprob
    assert comp.cumulative_logprob == pytest.approx(total)
    assert pickle.loads(pickle.dumps(comp.logprobs[0])) == comp.logprobs[0]
    back = pickle.loads(pickle.dumps(comp.logprobs[0][comp.token_ids[0]]))
    assert (back.rank, back.decoded_token) == (1, comp.logprobs[0][comp.token_ids[0]].decoded_token)
    assert out.prompt_logprobs[0] is None
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        # Its rank counts the tokens at least as likely: 1 exactly when it is the best.
        best = max(entry.values())
        assert entry[token].rank >= 1 and (entry[token].rank == 1) == (entry[token] == best)
    assert one(llm, PROMPT, greedy()).outputs[0].cumulative_logprob is None


def test_max_tokens_none_runs_to_the_end_of_the_context(llm):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    out = one(llm, prompt, greedy(max_tokens=None)).outputs[0]
    assert len(out.token_ids) == 256 - len(prompt) and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([5] * 256, greedy(max_tokens=None), use_tqdm=False)
    assert_all_free(llm.engine)


def test_detokenize_false_gives_ids_only(llm):
    want = one(llm, PROMPT, greedy()).outputs[0].token_ids
    out = one(llm, PROMPT, greedy(detokenize=False)).outputs[0]
    assert out.token_ids == want and out.text == ""
    with pytest.raises(ValueError, match="detokenize"):
        greedy(detokenize=False, stop=["x"])


def test_top_k_zero_means_no_top_k(llm):
    seeded = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = one(llm, PROMPT, SamplingParams(top_k=0, **seeded)).outputs[0].token_ids
    b = one(llm, PROMPT, SamplingParams(top_k=-1, **seeded)).outputs[0].token_ids
    assert a == b


def test_vllm_constructor_and_generate_arguments(llm):
    model_dir = tiny_with_tokenizer()
    small = LLM(str(model_dir), dtype=torch.float32, seed=None, trust_remote_code=True,
                disable_log_stats=True, tokenizer=str(model_dir), max_logprobs=1,
                block_size=4, num_blocks=64)
    assert small.engine.config.dtype == "float32"
    with pytest.raises(ValueError, match="max_logprobs"):
        small.generate(PROMPT, greedy(logprobs=2), use_tqdm=False)
    assert engine_config(dtype="half").dtype == "float16"
    assert engine_config(dtype="float").dtype == "float32"
    with pytest.raises(TypeError, match="LLM"):
        LLM(str(model_dir), no_such_argument=1)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(model_dir), tokenizer="some/other/tokenizer")
    assert one(llm, PROMPT, greedy()).outputs[0].token_ids == llm.generate(
        PROMPT, greedy(), use_tqdm=False, lora_request=None, priority=[0])[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate(PROMPT, greedy(), lora_request=object())
    with pytest.raises(ValueError, match="priorit"):
        llm.generate([PROMPT, PROMPT], greedy(), priority=[0, 1])


def test_chat_arguments(llm):
    tok = llm.get_tokenizer()
    plain = [{"role": "user", "content": "hello there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                          {"type": "text", "text": "there"}]}]
    (a,) = llm.chat([{"role": "user", "content": "hello\nthere"}], greedy(), use_tqdm=False)
    (b,) = llm.chat(parts, greedy(), use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids  # one part per line, as vLLM joins them
    # No content at all is an empty one (vLLM's reading), with or without the key.
    (none,) = llm.chat([{"role": "user", "content": None}], greedy(), use_tqdm=False)
    (empty,) = llm.chat([{"role": "user", "content": ""}], greedy(), use_tqdm=False)
    (missing,) = llm.chat([{"role": "user"}], greedy(), use_tqdm=False)
    assert none.prompt_token_ids == empty.prompt_token_ids == missing.prompt_token_ids
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 greedy(), use_tqdm=False)

    started = plain + [{"role": "assistant", "content": "general kenobi"}]
    (c,) = llm.chat(started, greedy(), use_tqdm=False, add_generation_prompt=False,
                    continue_final_message=True)
    assert tok.decode(c.prompt_token_ids, False).endswith("assistant: general kenobi")
    (closed,) = llm.chat(started, greedy(), use_tqdm=False, add_generation_prompt=False)
    assert len(closed.prompt_token_ids) > len(c.prompt_token_ids)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(started, greedy(), use_tqdm=False, continue_final_message=True)

    template = "{% for m in messages %}{{ greeting }} {{ m.content }}|{% endfor %}"
    (d,) = llm.chat(plain, greedy(), use_tqdm=False, chat_template=template,
                    chat_template_kwargs={"greeting": "well"})
    assert d.prompt_token_ids == tok.encode("well hello there|", add_special_tokens=False)
    (e,) = llm.chat(started, greedy(), use_tqdm=False,
                    chat_template_kwargs={"add_generation_prompt": False})
    assert e.prompt_token_ids == closed.prompt_token_ids
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(plain, greedy(), use_tqdm=False, chat_template_kwargs={"tools": []})


def test_chat_with_an_earlier_tool_call(llm):
    # OpenAI's history: the assistant's call has no content and its arguments
    # as JSON text; templates get "" and an object.
    tok = llm.get_tokenizer()
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }} "
                "{{ c.function.arguments.city }}]{% endfor %}|{% endfor %}")
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    (out,) = llm.chat(messages, greedy(), use_tqdm=False, chat_template=template)
    assert out.prompt_token_ids == tok.encode(
        "user:weather?|assistant:[get_weather Paris]|tool:sunny|", add_special_tokens=False)
    with pytest.raises(ValueError, match="not JSON"):
        bad = [messages[0], {**messages[1], "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]
        llm.chat(bad, greedy(), use_tqdm=False, chat_template=template)


def test_the_tokenizer_answers_hugging_faces_common_calls(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    assert tok(PROMPT) == {"input_ids": ids, "attention_mask": [1] * len(ids)}
    assert tok([PROMPT, "a"])["input_ids"] == [ids, tok.encode("a")]
    assert len(tok) == tok.vocab_size
    assert tok.convert_ids_to_tokens(ids) == [tok.id_to_token(i) for i in ids]
    messages = [{"role": "user", "content": "hello"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s>user: hello\n<s>assistant:"  # `tokenize` is not a template variable
    assert tok.apply_chat_template(messages, tokenize=True) == tok.encode(
        text, add_special_tokens=False)
    assert tok(PROMPT).input_ids == ids  # attributes too, as Hugging Face's
    # Hugging Face's name for another template: it was taken for a variable.
    assert tok.apply_chat_template(messages, chat_template="{{ messages[0].content }}!") \
        == "hello!"


def test_logit_bias_allowed_token_ids_and_bad_words(llm):
    tok = llm.get_tokenizer()
    base = one(llm, PROMPT, greedy()).outputs[0].token_ids
    banned = one(llm, PROMPT, greedy(logit_bias={base[0]: -100})).outputs[0].token_ids
    assert banned[0] != base[0]
    forced = one(llm, PROMPT, greedy(logit_bias={7: 100})).outputs[0].token_ids
    assert forced == [7] * 8
    allowed = one(llm, PROMPT, greedy(allowed_token_ids=[base[3], 7])).outputs[0].token_ids
    assert set(allowed) <= {base[3], 7}

    # A one-token word is banned everywhere; a longer one only where its
    # other tokens end the output.
    word = tok.decode(base[:1])
    assert [base[0]] in bad_word_ids(tok, [word])
    assert one(llm, PROMPT, greedy(bad_words=[word])).outputs[0].token_ids[0] != base[0]
    pair = tok.decode(base[1:3])
    assert base[1:3] in bad_word_ids(tok, [pair])
    out = one(llm, PROMPT, greedy(bad_words=[pair])).outputs[0].token_ids
    assert out[:2] == base[:2] and out[2] != base[2]

    for bad in (dict(logit_bias={VOCAB_OUTSIDE: 1.0}), dict(allowed_token_ids=[VOCAB_OUTSIDE])):
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate(PROMPT, greedy(**bad), use_tqdm=False)
    for bad in (dict(logit_bias={1: 101}), dict(logit_bias={-1: 1}), dict(allowed_token_ids=[]),
                dict(bad_words=[""])):
        with pytest.raises(ValueError):
            greedy(**bad)
    assert_all_free(llm.engine)


def test_bad_words_complete_only_after_their_other_tokens():
    from types import SimpleNamespace

    from engine.sampler import _completing

    def after(prompt, output):
        return SimpleNamespace(token_ids=prompt + output, num_output_tokens=len(output))

    words = [[5], [7, 8], [1, 2, 3]]
    assert _completing(words, after([9], []), 100) == [5]
    assert _completing(words, after([9], [4, 7]), 100) == [5, 8]
    assert _completing(words, after([9], [1, 2]), 100) == [5, 3]
    assert _completing(words, after([9], [2, 1]), 100) == [5]
    # Only generated tokens start a word: the prompt's last ones do not.
    assert _completing(words, after([1, 2], []), 100) == [5]
    assert _completing(words, after([4, 1], [2]), 100) == [5]
    assert _completing(words, after([1], [2]), 100) == [5]
    assert _completing(words, after([4], [1, 2]), 100) == [5, 3]


def test_a_batch_is_queued_whole_or_not_at_all(llm, monkeypatch):
    engine, added = llm.engine, []
    add = engine.add_request

    def fails_second(request_id, *args, **kwargs):
        if added:
            raise ValueError("refused at the second prompt")
        added.append(request_id)
        return add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", fails_second)
    with pytest.raises(ValueError, match="second prompt"):
        llm.generate([PROMPT, PROMPT], greedy(), use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()  # the first prompt was taken back
    assert_all_free(engine)


def test_generate_returns_its_own_requests_beside_others_in_the_engine(llm):
    want = one(llm, PROMPT, greedy()).outputs[0].token_ids
    llm.engine.add_request("queued-by-someone-else", [5, 6, 7], greedy(max_tokens=1))
    assert one(llm, PROMPT, greedy()).outputs[0].token_ids == want
    llm.engine.abort_request(["queued-by-someone-else"])
    assert_all_free(llm.engine)


def test_n_with_the_largest_seed(llm):
    # Completion i is seeded seed + i, wrapped as a signed 64-bit integer.
    top = one(llm, PROMPT, SamplingParams(n=2, seed=2**63 - 1, max_tokens=4)).outputs
    wrapped = one(llm, PROMPT, SamplingParams(seed=-2**63, max_tokens=4)).outputs[0]
    assert len(top) == 2 and top[1].token_ids == wrapped.token_ids


# ---- what the review against vLLM's API found ------------------------------------------------


def test_sampling_params_read_values_as_vllm_does():
    import numpy as np

    assert SamplingParams(logprobs=True, prompt_logprobs=True).logprobs == 1  # True is 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    p = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), seed=np.int64(7),
                       temperature=np.float32(0.5), top_p=np.float64(0.9))
    assert (p.n, p.max_tokens, p.seed, p.temperature, p.top_p) == (2, 5, 7, 0.5, 0.9)
    assert type(p.n) is int and type(p.temperature) is float
    with pytest.raises(ValueError, match="max_tokens must be an integer, got 3.0"):
        SamplingParams(max_tokens=3.0)
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(seed="x")


def test_logprobs_true_runs_beside_other_requests(llm):
    """It crashed the sampler's step (topk of a bool), and every request in it."""
    outs = llm.generate([PROMPT, PROMPT], [greedy(max_tokens=3, logprobs=True), greedy()],
                        use_tqdm=False)
    # Three tokens, each with its own logprob and the top one (one entry when they are one).
    assert [1 <= len(e) <= 2 for e in outs[0].outputs[0].logprobs] == [True] * 3
    assert len(outs[1].outputs[0].token_ids) == 8
    assert_all_free(llm.engine)


def test_a_stop_token_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids: token id"):
        llm.generate(PROMPT, greedy(stop_token_ids=[VOCAB + 5]), use_tqdm=False)
    assert_all_free(llm.engine)


def test_chat_takes_vllms_parameters_in_vllms_order(llm):
    messages = [{"role": "user", "content": "hello"}]
    (a,) = llm.chat(messages, greedy(), False, None, None, "string", True)
    (b,) = llm.chat(messages, greedy(), use_tqdm=False, lora_request=None,
                    mm_processor_kwargs=None, chat_template_content_format="auto")
    assert a.prompt_token_ids == b.prompt_token_ids
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(messages, greedy(), use_tqdm=False, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="LoRA"):
        llm.chat(messages, greedy(), use_tqdm=False, lora_request=object())
    assert b.outputs[0].finished()  # a method, as vLLM's


def test_the_models_generation_config_sets_the_defaults(tmp_path):
    model = str(with_generation_config(tmp_path / "model", temperature=0.0, max_new_tokens=3))
    kw = dict(dtype="float32", block_size=4, num_blocks=128, max_model_len=256)
    llm = LLM(model, **kw)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.max_tokens) == (0.0, 3)
    first, second = (llm.generate(PROMPT, use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert len(first.token_ids) <= 3 and first.token_ids == second.token_ids  # greedy
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert len(chat.outputs[0].token_ids) <= 3
    # Given params are used as given; "vllm" ignores the file.
    given = llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(given[0].outputs[0].token_ids) == 5
    plain = LLM(model, generation_config="vllm", **kw)
    assert plain.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be one of"):
        LLM(model, generation_config="hf", **kw)
    bad = str(with_generation_config(tmp_path / "bad", temperature=-1))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        LLM(bad, **kw)


def test_a_generate_interrupted_mid_step_leaves_no_unwritten_prefix():
    """Ctrl-C in the forward pass: the step had published its blocks to the
    prefix cache before writing them; the next generate of the same prompt
    read them as cached (wrong tokens)."""
    llm = tiny_llm()
    prompt = {"prompt_token_ids": list(range(3, 43))}
    want = llm.generate(prompt, greedy(max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    llm.reset_prefix_cache()

    def interrupt(layer: int) -> None:
        if layer == 0:  # layer 0's KV is written, the others' are not
            raise KeyboardInterrupt

    llm.engine.runner.model.on_layer_done = interrupt
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt, greedy(max_tokens=8), use_tqdm=False)
    llm.engine.runner.model.on_layer_done = None
    assert_all_free(llm.engine)
    again = llm.generate(prompt, greedy(max_tokens=8), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want and again.num_cached_tokens == 0


def test_vllms_keywords_that_change_nothing_here_are_taken():
    llm = LLM(str(tiny_with_tokenizer()), dtype="float32", block_size=4, num_blocks=32,
              max_model_len=64, swap_space=4, enable_chunked_prefill=True, tokenizer_mode="auto",
              revision=None, download_dir=None, max_seq_len_to_capture=8192,
              distributed_executor_backend="mp", pipeline_parallel_size=1, enable_lora=False,
              skip_tokenizer_init=False, task="generate", hf_overrides=None,
              compilation_config=3, disable_custom_all_reduce=True)
    assert llm.generate(PROMPT, greedy(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    for bad in ({"enable_lora": True}, {"pipeline_parallel_size": 2}, {"revision": "v2"}):
        with pytest.raises(ValueError, match="is not supported"):
            LLM(str(tiny_with_tokenizer()), **bad)
    with pytest.raises(TypeError, match="unexpected keyword"):
        LLM(str(tiny_with_tokenizer()), no_such_option=1)
