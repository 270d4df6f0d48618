"""The public API: ``tandem.LLM``, ``tandem.AsyncEngine``, input validation,
and the ``tandem generate`` command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_fixtures import VOCAB, assert_all_free, root, tiny_llm, tiny_with_tokenizer
from safetensors.torch import save_file

import tandem
from tandem import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir():
    return tiny_with_tokenizer()


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


@pytest.fixture
async def aengine(model_dir):
    engine = tandem.AsyncEngine(str(model_dir), block_size=4, num_blocks=128)
    yield engine
    await engine.shutdown()
    assert_all_free(engine.engine)


# ---- LLM --------------------------------------------------------------------------


def test_generate_keeps_input_order(llm):
    tok = llm.get_tokenizer()
    prompts = ["the quick brown fox", tok.encode("hello world"), "a", [5, 6, 7, 8, 9, 10]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert outs[0].prompt == "the quick brown fox"
    assert outs[0].prompt_token_ids == tok.encode("the quick brown fox")
    assert outs[1].prompt is None and outs[1].prompt_token_ids == tok.encode("hello world")
    assert outs[3].prompt_token_ids == [5, 6, 7, 8, 9, 10]
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outs)
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    assert_all_free(llm.engine)


def test_reset_prefix_cache_forgets_what_was_cached(llm):
    prompt = list(range(5, 45))  # 10 full blocks of 4
    llm.generate(prompt, GREEDY, use_tqdm=False)
    hits = llm.engine.stats().prefix_hits
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.engine.stats().prefix_hits > hits  # the control: the prefix was cached
    hits = llm.engine.stats().prefix_hits
    assert llm.reset_prefix_cache() is True
    assert llm.engine.stats().prefix_hits == hits  # a counter: it never goes back
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.engine.stats().prefix_hits == hits  # nothing found this time
    assert_all_free(llm.engine)


def test_generate_with_a_list_of_params(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 3, 5)]
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3, 5]
    with pytest.raises(ValueError, match="3 prompts"):
        llm.generate(["a", "b", "c"], params[:2], use_tqdm=False)


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("<s>user: hello\n<s>assistant:",
                                              add_special_tokens=False)
    assert out.prompt_token_ids[0] == 1  # <s> is a token of the template
    assert out.prompt == "<s>user: hello\n<s>assistant:"  # the rendered text, as vLLM gives it
    outs = llm.chat([messages, messages + [{"role": "assistant", "content": "hi"}]], GREEDY,
                    use_tqdm=False)
    assert len(outs) == 2 and outs[0].outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "hello"}], GREEDY, use_tqdm=False)


# ---- AsyncEngine ------------------------------------------------------------------


async def _collect(engine, prompt, params, request_id=""):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def test_async_generate_streams_until_finished(aengine, llm):
    outs = await _collect(aengine, "the quick brown fox", GREEDY, "one")
    assert len(outs) == 8 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    final = outs[-1].outputs[0]
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
    want = llm.generate("the quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    assert final.token_ids == want.token_ids and final.finish_reason == "length"


async def test_two_concurrent_generates(aengine):
    a, b = await asyncio.gather(
        _collect(aengine, "the quick brown fox", GREEDY),
        _collect(aengine, [7, 8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
    )
    assert len(a) == 8 and len(b) == 5 and a[-1].finished and b[-1].finished
    assert a[-1].request_id != b[-1].request_id  # generated ids are unique
    alone = await _collect(aengine, [7, 8, 9], SamplingParams(temperature=0, max_tokens=5,
                                                               ignore_eos=True))
    assert alone[-1].outputs[0].token_ids == b[-1].outputs[0].token_ids


async def test_abort_frees_the_blocks_at_once(aengine):
    engine = aengine.engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    gen = aengine.generate("the quick brown fox", params, "long")
    first = await gen.__anext__()
    assert not first.finished and engine.stats().num_free_blocks < engine.stats().num_blocks
    await aengine.abort("long")
    assert_all_free(engine)
    rest = [out async for out in gen]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"


async def test_leaving_the_loop_aborts(aengine):
    engine = aengine.engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    async for out in aengine.generate("the quick brown fox", params, "left"):
        assert not out.finished
        break
    for _ in range(200):  # the generator is closed by the event loop, soon
        if not engine.stats().num_sequences:
            break
        await asyncio.sleep(0.01)
    assert_all_free(engine)


async def test_closing_the_generator_aborts_at_once(aengine):
    engine = aengine.engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    gen = aengine.generate("the quick brown fox", params, "closed")
    await gen.__anext__()
    await gen.aclose()
    assert_all_free(engine)


async def test_a_duplicate_id_fails_without_touching_the_first(aengine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    gen = aengine.generate("hello", params, "dup")
    await gen.__anext__()
    with pytest.raises(ValueError, match="in use"):
        await _collect(aengine, "hello", params, "dup")
    rest = [out async for out in gen]
    assert rest[-1].outputs[0].finish_reason == "length"
    assert len(rest[-1].outputs[0].token_ids) == 6


async def test_async_bad_input_raises_before_anything_is_queued(aengine):
    with pytest.raises(ValueError):
        await _collect(aengine, "", GREEDY)
    with pytest.raises(ValueError):
        await _collect(aengine, [VOCAB], GREEDY)
    with pytest.raises(ValueError, match="SamplingParams"):
        await _collect(aengine, "hi", {"max_tokens": 2})
    with pytest.raises(ValueError, match="request id"):
        await _collect(aengine, "hi", GREEDY, request_id=5)
    assert aengine.num_requests == 0


# ---- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(n=0), dict(min_p=1.5), dict(min_tokens=-1),
    dict(logprobs=21), dict(stop=[""]), dict(presence_penalty=3.0),
    dict(temperature=float("inf")), dict(temperature=float("nan")), dict(top_p=float("nan")),
    dict(repetition_penalty=float("inf")), dict(frequency_penalty=float("-inf")),
    # Wrong types are ValueErrors too, not a TypeError from deep inside.
    dict(stop=5), dict(stop={"a": 1}), dict(stop_token_ids=5), dict(logit_bias=[1, 2]),
    dict(logit_bias=5), dict(allowed_token_ids=5), dict(bad_words=5),
    dict(structured_outputs={"foo": 1}), dict(n=True), dict(max_tokens=True), dict(seed=False),
])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_one_stop_string_or_bad_word_alone_is_a_list_of_it():
    assert SamplingParams(stop="x", bad_words="Paris").bad_words == ["Paris"]
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop_token_ids == [3]


@pytest.mark.parametrize("prompt,params,match", [
    ("", GREEDY, "empty"),
    ({"prompt_token_ids": []}, GREEDY, "empty"),  # ([] is a list of no prompts)
    ([5, VOCAB], GREEDY, "vocabulary"),
    ([-1], GREEDY, "vocabulary"),
    ([1.5], GREEDY, "integer"),
    ([5] * 250, GREEDY, "max_model_len"),
    ("hello", SamplingParams(n=17), "n must be at most 16"),
])
def test_bad_requests_raise_before_any_block_is_allocated(llm, prompt, params, match):
    engine = llm.engine
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    # Every prompt is checked before any is queued.
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], params, use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    assert_all_free(engine)
    assert not engine.has_unfinished_requests()


def test_a_cache_smaller_than_the_context_is_the_context():
    """8 blocks of 4 tokens under a 256-token max_model_len: the engine
    serves 32-token sequences, so a request without max_tokens gets the room
    the cache has instead of a ValueError for blocks it can never hold."""
    small = LLM(str(tiny_with_tokenizer()), dtype="float32", block_size=4, num_blocks=8,
                max_model_len=256)
    assert small.engine.max_model_len == 32
    (out,) = small.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 27 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="maximum context length is 32"):
        small.generate([[5] * 30], SamplingParams(max_tokens=8))


def test_a_model_path_that_does_not_exist():
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(root() / "no-such-model"))


def test_a_directory_without_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here")
    with pytest.raises(ValueError, match="no supported model"):
        LLM(str(tmp_path))


def test_an_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64,
        "n_head": 4, "n_layer": 2, "vocab_size": 512,
    }))
    import torch

    save_file({"wte.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        LLM(str(tmp_path))
    assert "LlamaForCausalLM" in str(err.value) and "Qwen2ForCausalLM" in str(err.value)


# ---- command line -------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True,
                          text=True, env=env, timeout=120, cwd=REPO)


def test_cli_generate(model_dir, llm):
    proc = _cli("generate", "the quick brown fox", "--model", str(model_dir),
                "--max-tokens", "8", "--temperature", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    want = llm.generate("the quick brown fox", SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].text
    assert proc.stdout == want + "\n"


def test_cli_reports_bad_input_without_a_traceback(tmp_path):
    proc = _cli("generate", "hi", "--model", str(tmp_path / "missing"), "--device", "cpu")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("--help")
    assert proc.returncode == 0 and "generate" in proc.stdout
