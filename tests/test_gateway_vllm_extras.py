"""vLLM's extensions of the OpenAI API, with the official ``openai`` client
against a real gateway in front of a prefill and a decode worker:
``stop_reason``, ``logit_bias`` and ``allowed_token_ids``, ``echo`` with the
prompt's logprobs, ``return_token_ids``, ``prompt_logprobs``, and the
/tokenize, /detokenize, /version and /ping routes."""

from __future__ import annotations

import openai
import pytest
from engine_fixtures import with_generation_config
from gateway_fixtures import (
    GREEDY,
    MESSAGES,
    PROMPT,
    SERVED,
    module_cluster,
    openai_fixtures,
    start_gateway,
)

NUM_BLOCKS = 64

cluster, workers, gateway, no_leaks = module_cluster(NUM_BLOCKS)
client, tokenizer = openai_fixtures()


def test_a_stop_token_is_the_stop_reason(client, tokenizer):
    free = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12, logprobs=0,
                                     **GREEDY).choices[0]
    assert free.stop_reason is None and free.finish_reason == "length"
    # logprobs=0: no alternatives, but the sampled token's own logprob (OpenAI's shape).
    assert [len(top) for top in free.logprobs.top_logprobs] == [1] * 12
    assert [next(iter(top)) for top in free.logprobs.top_logprobs] == free.logprobs.tokens
    # A generated token whose text encodes back to one id: that id is the token.
    token = next(ids[0] for text in free.logprobs.tokens[1:]
                 if len(ids := tokenizer.encode(text, add_special_tokens=False)) == 1
                 and tokenizer.decode(ids) == text)
    for stream in (False, True):
        out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12,
                                        stream=stream, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [token]})
        last = list(out)[-1].choices[0] if stream else out.choices[0]
        assert last.finish_reason == "stop" and last.stop_reason == token


def test_a_stop_string_of_digits_is_not_a_stop_token(client, tokenizer):
    # "7" forced by logit_bias, stopped by the string "7" while token id 7 is
    # also a stop token: the reason is the string, as the request gave it.
    [seven] = tokenizer.encode("7", add_special_tokens=False)
    assert seven != 7
    for stream in (False, True):
        out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, stream=stream,
                                        stop=["7"], logit_bias={str(seven): 100}, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [7]})
        last = list(out)[-1].choices[0] if stream else out.choices[0]
        assert last.finish_reason == "stop" and last.stop_reason == "7"


def test_logit_bias_and_allowed_token_ids(client, tokenizer):
    fox = tokenizer.encode("fox", add_special_tokens=False)[0]
    want = tokenizer.decode([fox] * 6)
    biased = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6,
                                       logit_bias={str(fox): 100}, **GREEDY)
    assert biased.choices[0].text == want
    allowed = client.chat.completions.create(
        model=SERVED, messages=MESSAGES, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "allowed_token_ids": [fox]})
    assert allowed.choices[0].message.content == want
    for bias in ({"fox": 1}, {str(10**6): 1}, {str(fox): 500}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2, logit_bias=bias)
        assert "logit_bias" in err.value.message and err.value.body.get("param") == "logit_bias"


def test_vllms_tokenize_detokenize_version_and_ping(gateway, tokenizer):
    with gateway.http() as http:
        out = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert out["tokens"] == tokenizer.encode(PROMPT) and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 1024
        bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
        assert bare.json()["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["tokens"] == tokenizer.encode_chat(MESSAGES)
        # Earlier tool calls and results: the tokens a chat request's prompt has.
        call = {"id": "c1", "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        tools = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        chat = http.post("/tokenize", json={"messages": tools}).json()
        served = http.post("/v1/chat/completions", json={
            "messages": tools, "max_tokens": 1, "return_token_ids": True}).json()
        assert chat["tokens"] == served["prompt_token_ids"]
        # Special tokens kept, as vLLM's: a chat prompt's ids come back whole.
        assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {
            "prompt": tokenizer.decode(out["tokens"], skip_special_tokens=False)}
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": chat}).json()["prompt"] == \
            tokenizer.apply_chat_template(MESSAGES)
        # Assistant prefill: the last message left open, as the chat request sees it.
        started = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
        open_ = http.post("/tokenize", json={"messages": started, "add_generation_prompt": False,
                                             "continue_final_message": True}).json()["tokens"]
        assert open_ == tokenizer.encode(tokenizer.apply_chat_template(
            started, False, continue_final_message=True), add_special_tokens=False)
        assert tokenizer.decode(open_).endswith("The answer is")
        for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": MESSAGES}),
                           ("/detokenize", {"tokens": [10**9]}),
                           ("/detokenize", {"tokens": [True]})):
            r = http.post(path, json=body)
            assert r.status_code == 400 and "error" in r.json(), (path, body, r.text)
        assert http.get("/version").json()["version"]
        assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_return_token_ids(client, tokenizer):
    extra = {"ignore_eos": True, "return_token_ids": True}
    out = client.completions.create(model=SERVED, prompt=[PROMPT, "a b"], max_tokens=5,
                                    temperature=0, extra_body=extra)
    for choice, prompt in zip(out.choices, [PROMPT, "a b"]):
        assert choice.prompt_token_ids == tokenizer.encode(prompt)
        assert len(choice.token_ids) == 5 and tokenizer.decode(choice.token_ids) == choice.text
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=5,
                                            temperature=0, stream=True, extra_body=extra))
    assert chunks[0].choices[0].prompt_token_ids == tokenizer.encode(PROMPT)
    assert [t for c in chunks for t in c.choices[0].token_ids] == out.choices[0].token_ids
    chat = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=5,
                                          temperature=0, extra_body=extra)
    assert chat.prompt_token_ids == tokenizer.encode_chat(MESSAGES)
    assert tokenizer.decode(chat.choices[0].token_ids) == chat.choices[0].message.content
    plain = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2, **GREEDY)
    assert getattr(plain.choices[0], "token_ids", None) is None


def test_echo_puts_the_prompt_and_its_logprobs_first(client, tokenizer):
    plain = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, **GREEDY)
    echoed = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, echo=True,
                                       n=2, **GREEDY)
    assert [c.text for c in echoed.choices] == [PROMPT + plain.choices[0].text] * 2
    streamed = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, echo=True,
                                         stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain.choices[0].text
    # lm-eval-harness's use: the prompt's logprobs, the first token's None.
    ids = tokenizer.encode(PROMPT)
    scored = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=1, echo=True,
                                       logprobs=1, **GREEDY).choices[0].logprobs
    assert len(scored.tokens) == len(ids) + 1
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    assert all(v <= 0 for v in scored.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in scored.top_logprobs[1:])
    assert scored.text_offset == sorted(scored.text_offset)
    by_ids = client.completions.create(model=SERVED, prompt=ids, max_tokens=1, echo=True,
                                       logprobs=1, **GREEDY).choices[0].logprobs
    both = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=1, echo=True,
                                     logprobs=1, n=2, **GREEDY).choices
    for choice in both:  # each choice starts with the same prompt logprobs
        assert choice.logprobs.tokens[:len(ids)] == scored.tokens[:len(ids)]
        assert choice.logprobs.text_offset[:len(ids)] == scored.text_offset[:len(ids)]
    assert by_ids.token_logprobs[0] is None
    assert by_ids.token_logprobs[1:] == pytest.approx(scored.token_logprobs[1:], rel=1e-5)


def test_echo_with_no_tokens_scores_the_prompt_alone(client, tokenizer):
    """echo with max_tokens 0: the prompt and its logprobs, nothing generated
    (how perplexity and log-likelihood scripts score a text)."""
    ids = tokenizer.encode(PROMPT)
    scored = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=1, echo=True,
                                       logprobs=1, **GREEDY).choices[0].logprobs
    out = client.completions.create(model=SERVED, prompt=[PROMPT, PROMPT], max_tokens=0,
                                    echo=True, logprobs=1, **GREEDY)
    for choice in out.choices:
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert choice.logprobs.tokens == scored.tokens[:len(ids)]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            scored.token_logprobs[1:len(ids)], rel=1e-5)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == 2 * len(ids)
    streamed = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=0,
                                              echo=True, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == PROMPT
    assert streamed[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=0)


def test_text_offsets_point_into_the_text(client, tokenizer):
    # Characters split over byte tokens (日本 in the toy tokenizer), and a
    # special token first in a token-id prompt, echoed as vLLM echoes one.
    ids = [1, *tokenizer.encode("héllo 日本 café", add_special_tokens=False)]
    for prompt in (ids, "héllo 日本 café"):
        choice = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, echo=True,
                                           logprobs=0, **GREEDY).choices[0]
        text, lp = choice.text, choice.logprobs
        ends = [*lp.text_offset[1:], len(text)]
        assert lp.text_offset == sorted(lp.text_offset) and ends[-1] <= len(text)
        pieces = [text[a:b] for a, b in zip(lp.text_offset, ends)]
        assert "".join(pieces) == text
        for token, piece in zip(lp.tokens, pieces):
            assert token == "\ufffd" or piece.startswith(token) or token == "</s>", (token, piece)
    assert text.startswith("héllo 日本 café")
    assert choice.text.startswith("héllo") and client.completions.create(
        model=SERVED, prompt=ids, max_tokens=1, echo=True, **GREEDY
    ).choices[0].text.startswith("<s>héllo")


def test_prompt_logprobs(client, tokenizer):
    """vLLM's ``prompt_logprobs``: per prompt token (the first None) its own
    logprob and rank and the N most likely tokens', by token id; the same
    values as an echo's; in a chat response at the top; never streamed."""
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2, n=2,
                                    extra_body={"prompt_logprobs": 2, "ignore_eos": True},
                                    temperature=0)
    echoed = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=1, echo=True,
                                       logprobs=3, **GREEDY).choices[0].logprobs
    for choice in out.choices:
        scored = choice.model_extra["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        for token, entry, value in zip(ids[1:], scored[1:], echoed.token_logprobs[1:]):
            own = entry[str(token)]
            assert own["logprob"] == pytest.approx(value, rel=1e-5)
            assert own["decoded_token"] == tokenizer.decode([token])
            # the top 2 by rank, the prompt token among them or beside them
            others = sorted(e["rank"] for t, e in entry.items() if t != str(token))
            assert own["rank"] >= 1 and others == [r for r in (1, 2) if r != own["rank"]]
    # More prompt logprobs than an echo's logprobs: each keeps its own count.
    wide = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=1, echo=True,
                                     logprobs=1, temperature=0,
                                     extra_body={"prompt_logprobs": 5}).choices[0]
    assert all(len(top) <= 2 for top in wide.logprobs.top_logprobs[1:])
    assert all(5 <= len(entry) <= 6 for entry in wide.model_extra["prompt_logprobs"][1:])
    chat = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0}, temperature=0)
    scored = chat.model_extra["prompt_logprobs"]
    assert scored[0] is None and all(len(entry) == 1 for entry in scored[1:])
    assert len(scored) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert "prompt_logprobs" in str(err.value)


def test_chat_logprob_bytes_join_split_characters_back(client):
    # Held to "日本" by a grammar: the toy tokenizer spells each character in
    # byte tokens whose text alone is U+FFFD; their bytes are the real ones.
    out = client.chat.completions.create(
        model=SERVED, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=1, extra_body={"guided_regex": "日本"}).choices[0]
    assert out.message.content == "日本"
    tokens = [t for t in out.logprobs.content if t.token != "</s>"]  # EOS ends it
    assert any(t.token == "\ufffd" for t in tokens)
    assert b"".join(bytes(t.bytes) for t in tokens) == "日本".encode()


def test_chat_continues_the_final_message(gateway, tokenizer):
    """vLLM's continue_final_message: the last (assistant) message is left
    open and the model goes on with it; both ways of ending the prompt at
    once, or a template variable the rendering sets itself, are 400s."""
    started = [{"role": "user", "content": "Say hi"},
               {"role": "assistant", "content": "The answer is"}]
    expected = tokenizer.encode(tokenizer.apply_chat_template(
        started, False, continue_final_message=True), add_special_tokens=False)
    body = {"model": SERVED, "messages": started, "max_tokens": 3, "return_token_ids": True,
            **GREEDY}
    with gateway.http() as http:
        out = http.post("/v1/chat/completions", json={
            **body, "add_generation_prompt": False, "continue_final_message": True}).json()
        assert out["prompt_token_ids"] == expected
        # The same through chat_template_kwargs, as vLLM also takes them.
        kw = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {
            "add_generation_prompt": False, "continue_final_message": True}}).json()
        assert kw["prompt_token_ids"] == expected
        closed = http.post("/v1/chat/completions", json=body).json()
        assert closed["prompt_token_ids"] != expected
        for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                             ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                             ({"chat_template_kwargs": {"eos_token": "x"}},
                              "chat_template_kwargs")):
            r = http.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_models_generation_config_fills_what_a_request_leaves_unset(cluster, workers,
                                                                       tmp_path):
    """As vLLM's server: the model's generation_config.json (greedy, 4 new
    tokens here) for the fields a request does not send; ``--generation-config
    vllm`` ignores it."""
    model = with_generation_config(tmp_path / "model", temperature=0.0, max_new_tokens=4)

    def chat(gw, **kw):
        out = gw.client().chat.completions.create(model=SERVED, messages=MESSAGES,
                                                  extra_body={"ignore_eos": True}, **kw)
        return out.choices[0].message.content, out.usage.completion_tokens

    defaulted = start_gateway(cluster, workers, model=model)
    text, used = chat(defaulted)
    assert used == 4  # max_new_tokens
    assert chat(defaulted, temperature=0, max_tokens=4) == (text, 4)  # greedy by default
    assert chat(defaulted, max_tokens=6)[1] == 6  # what a request sends wins
    plain = start_gateway(cluster, workers, "--generation-config", "vllm", model=model)
    assert chat(plain)[1] > 4  # the context's room, not the file's


def test_a_prompt_cached_on_the_prefill_worker_is_reported_cached(client):
    """Disaggregated, the prefill worker computes the prompt: its prefix
    cache hit is the usage's cached_tokens (it was always 0)."""
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    usages = [client.completions.create(model=SERVED, prompt=prompt, max_tokens=4,
                                        **GREEDY).usage for _ in range(2)]
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert 0 < cached < usages[1].prompt_tokens
