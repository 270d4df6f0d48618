"""Incremental detokenization and stop strings, with a real byte-level BPE
tokenizer (tests/engine_fixtures.toy_tokenizer)."""

from __future__ import annotations

import pytest
from engine_fixtures import EOS, assert_all_free, make_engine, tiny_with_tokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

TEXT = "héllo 🙂 world, the quick brown fox 日本"


@pytest.fixture(scope="module")
def model_dir():
    return tiny_with_tokenizer()


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


def byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: the byte-level alphabet's single-byte tokens."""
    return [tok._tok.token_to_id(_BYTE_TO_CHAR[b]) for b in text.encode()]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the
    # others for chr(256 + n) in byte order.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


_BYTE_TO_CHAR = _bytes_to_unicode()


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for i, token in enumerate(ids):
        detok.add(token)
        deltas.append(detok.take(final=i == len(ids) - 1 or detok.stop_reason is not None))
        if detok.stop_reason is not None:
            break
    return deltas


def test_byte_tokens_are_single_bytes(tok):
    ids = byte_tokens(tok, TEXT)
    assert len(ids) == len(TEXT.encode()) and tok.decode(ids) == TEXT


@pytest.mark.parametrize("text", [TEXT, "the quick brown fox jumps over a lazy dog", "a"])
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text)
    for split in (0, 1, 3):
        if split >= len(ids):
            continue
        prompt, out = ids[:split], ids[split:]
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(stream(detok, out)) == tok.decode(out)
        assert detok.text == tok.decode(out)


def test_no_delta_holds_half_a_character(tok):
    ids = byte_tokens(tok, TEXT)
    detok = IncrementalDetokenizer(tok, tok.encode("say:"))
    deltas = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT
    # The 4 bytes of the emoji come out as one delta, on the last byte.
    at = deltas.index("🙂")
    assert deltas[at - 3 : at] == ["", "", ""]


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tok):
    ids = byte_tokens(tok, TEXT)
    detok = IncrementalDetokenizer(tok, [], stop=["o 🙂 w"])
    deltas = stream(detok, ids)
    assert detok.text == "héll" and detok.stop_reason == "o 🙂 w"
    assert "".join(deltas) == "héll"
    shown = ""
    for d in deltas:
        shown += d
        assert "héll".startswith(shown)


def test_stop_string_included_on_request(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["zzz", "o 🙂 w"], include_stop_str_in_output=True)
    assert "".join(stream(detok, byte_tokens(tok, TEXT))) == "héllo 🙂 w"
    assert detok.stop_reason == "o 🙂 w"


def test_the_earliest_stop_string_wins_and_holdback_is_released_at_the_end(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["world", "llo"])
    assert "".join(stream(detok, tok.encode(TEXT))) == "hé"
    detok = IncrementalDetokenizer(tok, [], stop=["nowhere to be found"])
    deltas = stream(detok, tok.encode(TEXT))
    assert "".join(deltas[:-1]) != TEXT and "".join(deltas) == TEXT


def test_special_tokens_are_skipped_unless_asked(tok):
    ids = tok.encode("hello") + [EOS]
    assert "".join(stream(IncrementalDetokenizer(tok, []), ids)) == "hello"
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "hello</s>"


# ---- through the engine -------------------------------------------------------------


def _pick_stop(tok: Tokenizer, ids: list[int]) -> tuple[int, str]:
    """A place where three tokens decode to plain ASCII that first occurs
    there: (index of its first token, the string)."""
    full = tok.decode(ids)
    for i in range(1, len(ids) - 3):
        pieces = [tok.decode([t]) for t in ids[i : i + 3]]
        stop = "".join(pieces)
        if (all(p and p.isascii() and p.isprintable() for p in pieces)
                and tok.decode(ids[: i + 3]) == tok.decode(ids[:i]) + stop
                and full.find(stop) == len(tok.decode(ids[:i]))):
            return i, stop
    raise AssertionError("no usable stop string in the output")


def _run_streaming(engine, prompt, params):
    engine.add_request("s", prompt, params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    return deltas, final


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_through_the_engine(model_dir, tok, include):
    engine = make_engine(model_dir, block_size=4)
    prompt = "the quick brown fox"
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, out = _run_streaming(engine, prompt, plain)
    ids = out.outputs[0].token_ids
    assert out.outputs[0].text == tok.decode(ids)
    i, stop = _pick_stop(tok, ids)
    before = tok.decode(ids[:i])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include)
    deltas, out = _run_streaming(engine, prompt, params)
    comp = out.outputs[0]
    want = before + stop if include else before
    assert comp.text == want and "".join(deltas) == want
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    assert comp.token_ids == ids[: i + 3]
    shown = ""
    for d in deltas:
        shown += d
        assert want.startswith(shown)
    if not include:
        assert stop not in shown
    assert_all_free(engine)


def test_stop_string_completed_by_the_last_allowed_token_reports_stop(model_dir, tok):
    engine = make_engine(model_dir, block_size=4)
    prompt = "the quick brown fox"
    _, out = _run_streaming(engine, prompt, SamplingParams(temperature=0, max_tokens=40,
                                                            ignore_eos=True))
    ids = out.outputs[0].token_ids
    i, stop = _pick_stop(tok, ids)
    params = SamplingParams(temperature=0, max_tokens=i + 3, ignore_eos=True, stop=[stop])
    _, out = _run_streaming(engine, prompt, params)
    comp = out.outputs[0]
    assert comp.text == tok.decode(ids[:i])
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    assert_all_free(engine)
