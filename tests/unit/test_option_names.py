"""Each model declares the request options it takes (`Model.accepted_options`); any other name is an
OptionError naming it, its closest known name and the model's options, rather than a request run at defaults."""

from __future__ import annotations

import pytest

from mstar.models.base import OptionError, check_option_names
from mstar.models.registry import get_model_class


def test_a_misspelt_option_is_refused_naming_it_the_nearest_and_every_option():
    accepted = get_model_class("toy").accepted_options()
    with pytest.raises(OptionError) as info:
        check_option_names("toy", accepted, {"max_tokens": 3, "max_tokenz": 8})
    assert info.value.option == "max_tokenz"
    message = str(info.value)
    assert "'max_tokenz'" in message and "did you mean 'max_tokens'" in message
    assert "guidance, height, max_tokens, modalities" in message


def test_known_options_pass_and_a_name_with_no_near_one_has_no_hint():
    accepted = get_model_class("llama").accepted_options()
    check_option_names("llama", accepted, {"max_tokens": 3, "temperature": 0.0, "stop": ["x"], "logprobs": 2,
                                           "structured_outputs": "{}", "seed": 1, "skip_special_tokens": False})
    with pytest.raises(OptionError, match=r"takes no option 'zzzz'; it takes frequency_penalty") as info:
        check_option_names("llama", accepted, {"zzzz": 1})
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("name,taken", [
    ("talker.temperature", True), ("thinker.max_tokens", True), ("code_predictor.top_k", True),
    ("code_predictor.seed", True), ("temperature", True), ("voice", True), ("stop", True),
    ("talker.tempreature", False), ("thinker.return_hidden", False), ("code_predictor.min_p", False),
    ("speaker.top_k", False), ("media", False),
    ("logprobs", True), ("thinker.logprobs", False),  # the text's logprobs have one name, which every route reads
    ("talker.logprobs", True),  # named to be refused with the reason (codec codes are no text)
])
def test_qwen3_omni_takes_each_components_sampling_keys_and_no_other_dotted_name(name, taken):
    assert (name in get_model_class("qwen3_omni").accepted_options()) is taken


def test_options_a_model_only_reads_in_its_processor_are_declared():
    # a few per model whose names are in no default: refusing them would break documented requests
    wanted = {"toy": {"size", "width", "height"}, "wan22": {"size", "num_frames", "seconds", "fps", "seed"},
              "cosmos3": {"embodiment", "chunk_size", "num_frames", "temperature"}, "pi05": {"modalities"},
              "vjepa2_ac": {"samples", "topk", "cem_iterations", "seed"}, "vjepa2": {"num_frames"},
              "bagel": {"size", "seed", "temperature", "stop"}, "orpheus": {"speed", "instructions", "seed"}}
    for model, names in wanted.items():
        assert names <= get_model_class(model).accepted_options(), model
