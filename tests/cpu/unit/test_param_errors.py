"""An invalid field raises ParamError whose `param` is the field: the HTTP
layer's OpenAI `param` comes from it, never from parsing the message."""
import math
import pickle

import pytest

from conveyor.engine import SamplingParams
from conveyor.engine.errors import ParamError

BAD = [("n", 0), ("temperature", math.nan), ("top_p", 0.0), ("top_k", -2), ("min_p", 2.0),
       ("seed", 2**64), ("max_tokens", 0), ("min_tokens", -1), ("stop", [""]), ("stop_token_ids", [-1]),
       ("ignore_eos", 1), ("logprobs", -1), ("logit_bias", {0: math.inf}), ("allowed_token_ids", []),
       ("presence_penalty", 3.0), ("repetition_penalty", 0.0)]


@pytest.mark.parametrize("field,value", BAD)
def test_each_bad_field_names_itself(field, value):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and str(e.value).startswith(field)


def test_min_tokens_above_max_tokens_names_min_tokens_and_pickles_whole():
    with pytest.raises(ParamError) as e:
        SamplingParams(min_tokens=5, max_tokens=2)
    again = pickle.loads(pickle.dumps(e.value))  # crosses Ray / multiprocessing intact
    assert (again.param, str(again)) == ("min_tokens", str(e.value)) and isinstance(again, ValueError)
