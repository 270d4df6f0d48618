"""Structured outputs in the engine: specs checked when built, the spec on
the wire, outputs held to their grammar (tiny random model: whatever it
prefers, the grammar decides), a dead end that ends the request cleanly,
and the bundled SmolLM2 filling twenty schemas in one batch."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_fixtures import assert_all_free, make_engine, run_to_completion, tiny_with_tokenizer
from structured_schemas import SCHEMAS

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from rpc.convert import params_from_proto, params_to_proto

PROMPT = "the quick brown fox"


@pytest.mark.parametrize("spec, field", [
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": {"type": "objectx"}}, "structured_outputs.json"),
    ({"json": {"type": "object", "dependentSchemas": {"a": {}}}}, "structured_outputs.json"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
])
def test_invalid_specs_raise_naming_the_field(spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(structured_outputs=StructuredOutputsParams(**spec))


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"anyOf": [{"$ref": "#"}]},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
])
def test_a_schema_no_text_matches_is_refused_before_any_step(schema):
    """A schema that is only a reference to itself compiles, but allows no
    first byte: refused when built (the gateway's 400), not at a worker."""
    with pytest.raises(ValueError, match="structured_outputs.json: no text matches it"):
        StructuredOutputsParams(json=schema)
    # Grammars that allow the empty text, or that recurse through a choice, are fine.
    assert StructuredOutputsParams(regex="a*").key
    assert StructuredOutputsParams(json={"type": "object", "properties": {
        "next": {"$ref": "#"}}}).key


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_schemas_nested_too_deep_are_refused_not_crashed_on():
    # A dict thousands of levels deep crashed the process inside llguidance;
    # as text, past Python's own JSON reader, it was a RecursionError.
    assert StructuredOutputsParams(json=_nested(63)).key  # 64 levels
    for schema in (_nested(64), _nested(5000), '{"items": ' * 3000 + "{}" + "}" * 3000):
        with pytest.raises(ValueError, match="nested more than 64 levels"):
            StructuredOutputsParams(json=schema)


def test_spec_crosses_the_wire_unchanged():
    for spec in ({"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}}},
                 {"regex": r"\d+"}, {"choice": ["a b", "c|d"]}, {"json_object": True},
                 {"grammar": 'root ::= "yes" | "no"'}):
        params = SamplingParams(structured_outputs=spec)
        back = params_from_proto(params_to_proto(params))
        assert back.structured_outputs.key == params.structured_outputs.key
    assert params_from_proto(params_to_proto(SamplingParams())).structured_outputs is None


@pytest.fixture(scope="module")
def tiny():
    engine = make_engine(tiny_with_tokenizer("llama-gqa"), num_blocks=256)
    yield engine
    assert_all_free(engine)


def _run(engine, specs, max_tokens=64, **kw) -> dict[str, object]:
    for i, spec in enumerate(specs):
        engine.add_request(f"r{i}", PROMPT, SamplingParams(
            temperature=kw.get("temperature", 0.0), seed=i, max_tokens=max_tokens,
            structured_outputs=spec))
    outs = run_to_completion(engine)
    return [outs[f"r{i}"].outputs[0] for i in range(len(specs))]


def test_tiny_model_outputs_match_their_grammar(tiny):
    specs = [{"regex": "[a-c]{4}-[0-9]{2}"}, {"choice": ["alpha", "beta", "gamma|delta"]},
             {"grammar": 'start: ("yes" | "no") " " NUMBER\nNUMBER: /[0-9]{1,3}/'},
             {"grammar": 'root ::= "(" [xyz]+ ")"'},
             {"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3,
                                                               "maximum": 7}},
                       "required": ["n"], "additionalProperties": False}},
             {"json_object": True}]
    for temperature in (0.0, 1.0):
        texts = [o.text for o in _run(tiny, specs, max_tokens=48, temperature=temperature)]
        assert re.fullmatch(r"[a-c]{4}-[0-9]{2}", texts[0])
        assert texts[1] in ("alpha", "beta", "gamma|delta")
        assert re.fullmatch(r"(yes|no) [0-9]{1,3}", texts[2])
        assert re.fullmatch(r"\([xyz]+\)", texts[3])
        assert 3 <= json.loads(texts[4])["n"] <= 7


def test_constrained_rows_leave_the_others_alone(tiny):
    alone = _run(tiny, [None, None])
    mixed = _run(tiny, [None, {"regex": "[0-9]+"}])
    assert mixed[0].token_ids == alone[0].token_ids
    assert re.fullmatch("[0-9]+", mixed[1].text)


def test_dead_end_ends_the_request(tiny):
    """A migrated request whose tokens so far already break its grammar: no
    token can follow, so it ends with finish_reason grammar_dead_end and its
    blocks are freed; a request beside it is untouched."""
    bad = tiny.tokenizer.encode("zzz", add_special_tokens=False)
    spec = {"regex": "[0-9]+"}
    tiny.add_request("dead", PROMPT, SamplingParams(temperature=0, max_tokens=20,
                                                    structured_outputs=spec),
                     output_token_ids=bad)
    tiny.add_request("alive", PROMPT, SamplingParams(temperature=0, max_tokens=5,
                                                     structured_outputs=spec))
    outs = run_to_completion(tiny)
    assert outs["dead"].outputs[0].finish_reason == "grammar_dead_end"
    assert outs["dead"].outputs[0].token_ids in ([], bad)  # nothing after the bad tokens
    assert re.fullmatch("[0-9]+", outs["alive"].outputs[0].text)
    assert_all_free(tiny)


def test_min_tokens_past_the_grammar_is_a_dead_end_not_a_stray_token(tiny):
    """The grammar is complete after "ab" and allows only EOS, which
    min_tokens bans: nothing can follow, so it ends there."""
    tiny.add_request("short", PROMPT, SamplingParams(
        temperature=0, max_tokens=10, min_tokens=5, structured_outputs={"choice": ["ab"]}))
    out = run_to_completion(tiny)["short"].outputs[0]
    assert (out.text, out.finish_reason) == ("ab", "grammar_dead_end")
    assert_all_free(tiny)


def test_a_dead_end_at_the_first_token_ends_every_one_of_n(tiny):
    """The grammar allows no first token: the siblings of an n=2 request,
    not forked yet, end with it (they were left unfinished, and the request
    never completed)."""
    [the] = tiny.tokenizer.encode(" the", add_special_tokens=False)[-1:]
    tiny.add_request("both", PROMPT, SamplingParams(
        temperature=0, max_tokens=8, n=2, allowed_token_ids=[the],
        structured_outputs={"regex": "a+"}))
    out = run_to_completion(tiny)["both"]
    assert [c.finish_reason for c in out.outputs] == ["grammar_dead_end"] * 2
    assert not tiny.has_unfinished_requests() and not tiny.output_processor.groups
    assert_all_free(tiny)


@pytest.mark.slow
def test_smollm2_twenty_schemas_in_one_batch(tmp_path_factory):
    from tandem import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.mktemp("tandem-cache")))
        llm = LLM(dtype="float32")
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Give {what} as JSON."}])
               for what, _ in SCHEMAS]
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json": s})
              for _, s in SCHEMAS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (what, schema), out in zip(SCHEMAS, outs):
        done = out.outputs[0]
        assert done.finish_reason == "stop", (what, done.text)
        jsonschema.validate(json.loads(done.text), schema)
    assert_all_free(llm.engine)


@pytest.mark.parametrize("choice", ["yes", {"yes": 1, "no": 0}, 5, ["a", 5], []])
def test_a_choice_that_is_not_a_list_of_strings_is_refused(choice):
    """A string was taken apart into its characters, a mapping into its keys;
    a number was a TypeError (INTERNAL over gRPC)."""
    with pytest.raises(ValueError, match="structured_outputs.choice must be"):
        StructuredOutputsParams(choice=choice)


@pytest.mark.parametrize("wire", ['"yes"', "5", "yes|no", "[" * 50_000])
def test_a_choice_off_the_wire_that_is_not_a_list_is_refused(wire):
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams.from_wire("choice", wire)


def test_an_object_holds_only_the_properties_its_schema_lists(tiny):
    """JSON Schema lets objects carry keys it does not list; a model held to
    a schema gets none (as vLLM's default backend and OpenAI's strict mode):
    ``{"name": ..., "age": ..., "city": ...}`` passed a schema of two keys."""
    from engine.structured_output.params import _closed

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for temperature in (0.0, 1.0):
        tiny.add_request("obj", PROMPT, SamplingParams(
            temperature=temperature, seed=3, max_tokens=40, structured_outputs={"json": schema}))
        text = run_to_completion(tiny)["obj"].outputs[0].text
        assert list(json.loads(text)) == ["n"]
    # Said otherwise, and parts of an allOf, stay open; data is left alone.
    assert _closed({"properties": {"a": {}}, "additionalProperties": True}) == {
        "properties": {"a": {}}, "additionalProperties": True}
    assert _closed({"allOf": [{"properties": {"a": {}}}]}) == {"allOf": [{"properties": {"a": {}}}]}
    assert _closed({"properties": {"properties": {"enum": [{"properties": {}}]}}}) == {
        "properties": {"properties": {"enum": [{"properties": {}}]}},
        "additionalProperties": False}
    assert_all_free(tiny)
