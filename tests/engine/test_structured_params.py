"""StructuredOutputsParams: exactly one constraint, each checked for shape at construction."""
import pytest

from nanovllm import SamplingParams, StructuredOutputsParams


def test_each_kind_and_its_key():
    assert StructuredOutputsParams(json={"type": "object"}).key == ("json", '{"type": "object"}')
    assert StructuredOutputsParams(json='{"type": "integer"}').kind == "json"
    assert StructuredOutputsParams(json_object=True).key == ("json_object", "")
    assert StructuredOutputsParams(regex="[ab]+").key == ("regex", "[ab]+")
    assert StructuredOutputsParams(choice=("yes", "no")).choice == ["yes", "no"]
    assert StructuredOutputsParams(grammar='root ::= "a"').kind == "grammar"
    # Key order in a schema dict does not change the cache key.
    a = StructuredOutputsParams(json={"type": "object", "properties": {}})
    b = StructuredOutputsParams(json={"properties": {}, "type": "object"})
    assert a.key == b.key
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["x"]))
    assert sp.structured_outputs.choice == ["x"] and SamplingParams().structured_outputs is None


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json_object": False}, "exactly one"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 5}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
])
def test_bad_params_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**kwargs)


def test_wrong_types():
    with pytest.raises(TypeError, match="json_object"):
        StructuredOutputsParams(json_object="yes")
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams, or None"):
        SamplingParams(structured_outputs={"regex": "a"})
