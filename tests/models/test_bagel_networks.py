"""BAGEL's networks at tiny size against independent references with the same weights (float32): the
understanding expert's path against transformers' Qwen3 (Qwen2's layers plus qk-norm, which is what BAGEL's
understanding path is; its o_proj bias zeroed), the ViT against transformers' SiglipVisionModel, the FLUX VAE
against diffusers' AutoencoderKL in the FLUX configuration. Full-size name and shape mapping on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mstar.engines.base import KVLayout, KVPoolSpec
from mstar.engines.kv_cache.paged import PagedKV
from mstar.models.bagel.config import BagelConfig, LLMConfig, vit_from_hf
from mstar.models.bagel.context import KVContext, PackedAttention, QuerySpec
from mstar.models.bagel.embeddings import grid_positions, patchify
from mstar.models.bagel.llm import Routing
from mstar.models.bagel.tiny import TINY_LLM, tiny_config
from mstar.models.bagel.weights import PARTS
from mstar.models.common.loading import load_named_tensors
from tests.models.bagel_reference import diffusers_vae_state, llm_shapes, random_state, vae_shapes, vit_shapes

transformers = pytest.importorskip("transformers")
TOL = 1e-4
# BAGEL-7B-MoT's llm_config.json and vit_config.json (the keys the parsers read)
FULL_LLM = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06}
FULL_VIT = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
            "patch_size": 14, "image_size": 980, "layer_norm_eps": 1e-06}


def _load(part: str, cfg: BagelConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    build, mapper, _ = PARTS[part]
    module = build(cfg, torch.float32, "cpu")
    load_named_tensors(module, state.items(), mapper(cfg))
    return module


def test_full_size_config_is_the_checkpoints():
    cfg = BagelConfig(llm=LLMConfig.from_hf(FULL_LLM), vit=vit_from_hf(FULL_VIT))
    assert cfg == BagelConfig()  # the defaults (--load-format dummy without files) are BAGEL-7B-MoT's
    assert cfg.vit.num_layers == 26 and cfg.latent_downsample == 16 and cfg.patch_latent_dim == 64


@pytest.mark.parametrize("size", ["full", "tiny"])
def test_checkpoint_keys_map_onto_our_parameters(size):
    """Every tensor of ema.safetensors and ae.safetensors fills a parameter of exactly one component with its
    shape, and every parameter is filled (load_named_tensors raises otherwise); on meta at full size."""
    cfg = BagelConfig() if size == "full" else tiny_config()
    device = "meta" if size == "full" else "cpu"
    ema = {**llm_shapes(cfg), **vit_shapes(cfg)}
    files = {"llm": ema, "vit": ema, "vae": vae_shapes(cfg)}
    claimed: dict[str, list[str]] = {}
    for part, (build, mapper, _) in PARTS.items():
        module = build(cfg, torch.float32, device)
        names = mapper(cfg)
        tensors = ((n, torch.empty(s, device=device)) for n, s in files[part].items())
        load_named_tensors(module, tensors, names)
        for name in files[part]:
            if names(name) is not None:
                claimed.setdefault(name, []).append(part)
    assert set(claimed) == set(ema) | set(files["vae"])
    assert all(len(parts) == 1 for parts in claimed.values())  # no tensor read by two components
    if size == "full":
        params = sum(p.numel() for p in PARTS["llm"][0](cfg, torch.bfloat16, "meta").parameters())
        assert 14.0e9 < params < 14.3e9  # two 7B experts sharing the embeddings


def _qwen3_reference(seed: int = 0):
    """A tiny transformers Qwen3 with q/k/v biases (o_proj's zeroed): BAGEL's understanding path."""
    cfg = TINY_LLM
    config = transformers.Qwen3Config(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
        rope_theta=cfg["rope_theta"], rms_norm_eps=cfg["rms_norm_eps"], attention_bias=True,
        tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(seed)
    reference = transformers.Qwen3ForCausalLM(config).eval()
    state = random_state({k: tuple(v.shape) for k, v in reference.state_dict().items()}, seed + 1)
    for name in state:
        if name.endswith("o_proj.bias"):
            state[name].zero_()
    reference.load_state_dict(state)
    return reference, state


@pytest.fixture(scope="module")
def llm_pair():
    cfg = tiny_config()
    reference, hf_state = _qwen3_reference()
    ours = random_state(llm_shapes(cfg), 7)  # the generation expert and heads: random
    for name, value in hf_state.items():
        if not name.endswith("o_proj.bias"):
            ours["language_model." + name] = value
    return reference, _load("llm", cfg, ours)


def _pool(num_pages: int = 64, page_size: int = 4) -> PagedKV:
    """A CPU pool of the tiny LLM's shape with small pages, so that contexts cross page boundaries."""
    cfg = tiny_config().llm
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return PagedKV(KVPoolSpec(layout, num_pages, "test", page_size), "cpu")


def _und_forward(llm, ids: torch.Tensor, context: KVContext, start: int, blocks=None) -> torch.Tensor:
    lm = llm.language_model
    attn = PackedAttention([QuerySpec(context, ids.numel(), blocks, store=True)], lm.attention_scale)
    positions = torch.arange(start, start + ids.numel())
    hidden = lm(lm.embed_tokens(ids), positions, Routing(), attn)
    attn.commit([start + ids.numel()])
    return lm.logits(hidden)


@torch.no_grad()
def test_understanding_path_equals_qwen3_with_qk_norm(llm_pair):
    reference, llm = llm_pair
    ids = torch.randint(0, TINY_LLM["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(3))
    want = reference(ids).logits[0]
    whole = _und_forward(llm, ids[0], KVContext(_pool()), 0)
    torch.testing.assert_close(whole, want, atol=TOL, rtol=0)
    # the same prompt in two chunks, then one token at a time, through one context
    context = KVContext(_pool())
    parts = [_und_forward(llm, ids[0, :5], context, 0), _und_forward(llm, ids[0, 5:9], context, 5)]
    parts += [_und_forward(llm, ids[0, i:i + 1], context, i) for i in range(9, 12)]
    torch.testing.assert_close(torch.cat(parts), want, atol=TOL, rtol=0)
    assert context.length == 12 and context.rope == 12


@pytest.mark.parametrize("prompts", [(4, 4, 4), (3, 6, 9, 2)], ids=["same_length", "mixed"])
@torch.no_grad()
def test_a_decode_batch_equals_each_sequence_alone(llm_pair, prompts):
    """Single stored tokens over contexts of different lengths attend in one batched call (keys padded and
    masked); each gets what it gets alone, and a multi-token sequence beside them keeps its own path."""
    _, llm = llm_pair
    lm, pool = llm.language_model, _pool()
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, TINY_LLM["vocab_size"], (n + 2,), generator=gen) for n in prompts]
    # the last prompt continues with two tokens (not a decode row); the others with one
    new = [x[n:n + 1] for x, n in zip(ids[:-1], prompts[:-1], strict=True)] + [ids[-1][prompts[-1]:]]
    alone, batched = [], []
    for x, n, tokens in zip(ids, prompts, new, strict=True):
        context = KVContext(pool)
        _und_forward(llm, x[:n], context, 0)
        alone.append(_und_forward(llm, tokens, context, n))
        batched.append(KVContext(pool))
        _und_forward(llm, x[:n], batched[-1], 0)
    attn = PackedAttention([QuerySpec(c, t.numel(), None, store=True) for c, t in zip(batched, new, strict=True)],
                           lm.attention_scale)
    assert attn.decoding == list(range(len(prompts) - 1)) and attn.others == [len(prompts) - 1]
    positions = torch.cat([torch.arange(n, n + t.numel()) for n, t in zip(prompts, new, strict=True)])
    hidden = lm(lm.embed_tokens(torch.cat(new)), positions, Routing(), attn)
    attn.commit([n + t.numel() for n, t in zip(prompts, new, strict=True)])
    torch.testing.assert_close(lm.logits(hidden), torch.cat(alone), atol=1e-5, rtol=0)
    assert [c.length for c in batched] == [n + t.numel() for n, t in zip(prompts, new, strict=True)]


@torch.no_grad()
def test_paged_decode_rows_equal_the_reference(llm_pair):
    """Contexts of different lengths, crossing 4-token pages, decode three tokens each in batched steps
    through the pool's paged decode attention (read in place, no padded copy): every row's logits are
    transformers' Qwen3 over the whole sequence; freeing the contexts gives every page back."""
    reference, llm = llm_pair
    lm, pool = llm.language_model, _pool(num_pages=32)
    gen = torch.Generator().manual_seed(11)
    prompts, steps = (3, 6, 9, 13), 3
    ids = [torch.randint(0, TINY_LLM["vocab_size"], (n + steps,), generator=gen) for n in prompts]
    contexts = [KVContext(pool) for _ in prompts]
    for x, n, context in zip(ids, prompts, contexts, strict=True):
        _und_forward(llm, x[:n], context, 0)
    got = []
    for step in range(steps):
        attn = PackedAttention([QuerySpec(c, 1, None, store=True) for c in contexts], lm.attention_scale)
        assert attn.decoding == list(range(len(prompts))) and not attn.others
        tokens = torch.stack([x[n + step] for x, n in zip(ids, prompts, strict=True)])
        positions = torch.tensor([n + step for n in prompts])
        got.append(lm.logits(lm(lm.embed_tokens(tokens), positions, Routing(), attn)))
        attn.commit((positions + 1).tolist())
    for row, (x, n) in enumerate(zip(ids, prompts, strict=True)):
        want = reference(x[None]).logits[0, n:]
        torch.testing.assert_close(torch.stack([g[row] for g in got]), want, atol=TOL, rtol=0)
    assert [len(c.pages) for c in contexts] == [-(-(n + steps) // 4) for n in prompts]
    for context in contexts:
        context.free()
    assert pool.num_free == 32


@pytest.mark.slow  # an interpreted kernel at a model's shapes; tests/unit/test_triton_attention.py checks it by default
def test_paged_decode_through_the_triton_kernel_equals_the_sdpa_reference():
    """The same batched decode steps with the pool's decode attention as the Triton paged decode kernel
    (interpreted on CPU: tests/models/bagel_paged_check.py) and as the SDPA reference give the same logits,
    also when the kernel runs under the decode plan with rows padded as a captured graph's are."""
    pytest.importorskip("triton")
    from tests.interpreted import run_interpreted

    proc = run_interpreted(Path(__file__).parent / "bagel_paged_check.py", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert max(result["max_diff"], result["padded_diff"]) <= 2e-5 * max(1.0, result["scale"]), result


@torch.no_grad()
def test_a_prefix_view_shares_pages_and_reads_what_a_copy_would(llm_pair):
    """A prefix view holds its source's first pages (no copy); a denoising-like block over it equals the block
    over a context prefilled with that prefix alone, also after the source grows past it and is freed; the
    pages go back once both are freed; a pool too small for a prefill says which setting sizes it."""
    _, llm = llm_pair
    lm, pool = llm.language_model, _pool(num_pages=12)
    ids = torch.randint(0, TINY_LLM["vocab_size"], (11,), generator=torch.Generator().manual_seed(12))
    full, alone = KVContext(pool), KVContext(pool)
    _und_forward(llm, ids, full, 0)
    _und_forward(llm, ids[:7], alone, 0)
    view = full.prefix(7, 7)
    assert view.pages == full.pages[:2] and all(pool.blocks.refcount(p) == 2 for p in view.pages)
    x = torch.randn(3, lm.cfg.hidden_size, generator=torch.Generator().manual_seed(13))

    def block(context: KVContext) -> torch.Tensor:
        return lm(x, torch.full((3,), 7), Routing(), PackedAttention([QuerySpec(context, 3, "full")], lm.attention_scale))

    seen = block(view)
    torch.testing.assert_close(seen, block(alone), atol=1e-5, rtol=0)  # prefilled in another shape
    _und_forward(llm, ids[:5], full, 11)  # the source grows: its writes land past the view
    full.free()
    torch.testing.assert_close(block(view), seen, atol=0, rtol=0)
    assert view.length == 7 and alone.length == 7
    view.free()
    alone.free()
    assert pool.num_free == 12
    with pytest.raises(RuntimeError, match="raise test"):
        _und_forward(llm, torch.zeros(13 * 4, dtype=torch.long), KVContext(pool), 0)


@torch.no_grad()
def test_the_decode_plan_run_eagerly_equals_the_packed_forward(llm_pair):
    """The decode step the stateless engine captures in CUDA graphs (`LLMComponent.decode_plan`), run eagerly
    over rows `decode_rows` described, gives the packed forward's hidden states for the same tokens over
    equal contexts of different lengths, step after step; on a CPU pool nothing is captured."""
    from mstar.models.bagel.components import LLMComponent
    from mstar.models.bagel.config import TokenIds
    from mstar.models.bagel.queries import run

    _, llm = llm_pair
    pool = _pool(num_pages=64)
    component = LLMComponent(llm, tiny_config(), TokenIds(bos=1, eos=2, start_of_image=3, end_of_image=4))
    component.set_kv_pool(pool)
    plan = component.decode_plan()
    assert plan.key == "decode" and tuple(component.capture_plans()) == ()
    prompts = (3, 6, 9, 13)
    gen = torch.Generator().manual_seed(14)
    ids = [torch.randint(0, TINY_LLM["vocab_size"], (n + 2,), generator=gen) for n in prompts]
    packed, planned = [KVContext(pool) for _ in prompts], [KVContext(pool) for _ in prompts]
    for x, n, a, b in zip(ids, prompts, packed, planned, strict=True):
        _und_forward(llm, x[:n], a, 0)
        _und_forward(llm, x[:n], b, 0)
    for step in range(2):
        tokens = [int(x[n + step]) for x, n in zip(ids, prompts, strict=True)]
        want = run(llm, [(c, component.queries.text([t], c.rope)) for c, t in zip(packed, tokens, strict=True)])
        got = plan.fn(*component.decode_rows(planned, tokens))
        for context in planned:
            context.commit(1, context.rope + 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert [c.length for c in planned] == [c.length for c in packed] == [n + 2 for n in prompts]


@torch.no_grad()
def test_the_generation_expert_taking_every_row_changes_nothing(llm_pair):
    """A denoising-like block (two understanding markers around many generation rows) routed with the
    generation expert on every row gives what routing each expert to its own rows gives."""
    _, llm = llm_pair
    lm, t = llm.language_model, 70
    is_gen = torch.ones(t, dtype=torch.bool)
    is_gen[0] = is_gen[-1] = False
    routing = Routing.of(is_gen)
    assert routing.gen_takes_all
    x = torch.randn(t, lm.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    positions = torch.arange(t)  # distinct, so a row given another's rope would show

    def forward(route: Routing) -> torch.Tensor:
        return lm(x, positions, route, PackedAttention([QuerySpec(None, t, "full")], lm.attention_scale))

    apart = Routing(routing.und, routing.gen, gen_takes_all=False)
    torch.testing.assert_close(forward(routing), forward(apart), atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_bidirectional_block_sees_itself_whole(llm_pair):
    """Tokens of one block attend each other both ways: its first token's output changes with its last token,
    while a causal run's first token does not."""
    _, llm = llm_pair
    ids = torch.tensor([5, 6, 7, 8, 9])
    blocks = torch.tensor([0, 1, 1, 1, 4])
    changed = ids.clone()
    changed[3] = 100
    pool = _pool()
    a = _und_forward(llm, ids, KVContext(pool), 0, blocks)
    b = _und_forward(llm, changed, KVContext(pool), 0, blocks)
    assert torch.equal(a[0], b[0])  # before the block
    assert not torch.allclose(a[1], b[1])  # in the block, before the changed token
    causal_a, causal_b = _und_forward(llm, ids, KVContext(pool), 0), _und_forward(llm, changed, KVContext(pool), 0)
    torch.testing.assert_close(causal_a[:3], causal_b[:3], atol=0, rtol=0)


@torch.no_grad()
def test_vit_equals_siglip_vision_model():
    """At the grid's full size the NaViT's positions are SigLIP's; a smaller image packed beside it changes
    nothing (each image attends over its own patches)."""
    cfg = tiny_config()
    vit = cfg.vit
    config = transformers.SiglipVisionConfig(
        hidden_size=vit.hidden_size, intermediate_size=vit.intermediate_size, num_hidden_layers=vit.num_layers,
        num_attention_heads=vit.num_heads, patch_size=vit.patch_size, image_size=vit.image_size,
        layer_norm_eps=vit.layer_norm_eps, hidden_act="gelu_pytorch_tanh")
    torch.manual_seed(0)
    reference = transformers.SiglipVisionModel(config).eval()
    hf = random_state({k: tuple(v.shape) for k, v in reference.state_dict().items()
                       if not k.startswith("head.") and "position_ids" not in k}, 2)
    reference.load_state_dict(hf, strict=False)
    ema = random_state(vit_shapes(cfg), 3)
    for name, value in hf.items():
        if name == "embeddings.patch_embedding.weight":  # conv -> Linear over (row, col, channel)
            value = value.permute(0, 2, 3, 1).reshape(value.shape[0], -1)
        ema["vit_model.vision_model." + name] = value
    tower = _load("vit", cfg, ema)
    image = torch.randn(3, vit.image_size, vit.image_size, generator=torch.Generator().manual_seed(4))
    small = torch.randn(3, 42, 28, generator=torch.Generator().manual_seed(5))
    want = reference(pixel_values=image[None]).last_hidden_state[0]
    p = vit.patch_size
    patches = torch.cat([patchify(image, p), patchify(small, p)])
    positions = torch.cat([grid_positions(vit.grid_side, vit.grid_side, vit.grid_side), grid_positions(3, 2, vit.grid_side)])
    n = vit.grid_side**2
    got = tower.vit(patches, positions, [n, 6])
    torch.testing.assert_close(got[:n], want, atol=TOL, rtol=0)
    alone = tower.vit(patchify(small, p), grid_positions(3, 2, vit.grid_side), [6])
    torch.testing.assert_close(got[n:], alone, atol=TOL, rtol=0)


@torch.no_grad()
def test_vae_equals_diffusers_autoencoder_kl_flux_config():
    diffusers = pytest.importorskip("diffusers")
    cfg = tiny_config()
    v = cfg.vae
    widths = [v.ch * m for m in v.ch_mult]
    reference = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(widths),
        up_block_types=("UpDecoderBlock2D",) * len(widths), block_out_channels=tuple(widths),
        layers_per_block=v.num_res_blocks, latent_channels=v.z_channels, norm_num_groups=32, use_quant_conv=False,
        use_post_quant_conv=False, scaling_factor=v.scale_factor, shift_factor=v.shift_factor).eval()
    ae = random_state(vae_shapes(cfg), 6, scale=0.1)
    reference.load_state_dict(diffusers_vae_state(ae, cfg))
    ours = _load("vae", cfg, ae)
    images = torch.rand(2, 3, 16, 32, generator=torch.Generator().manual_seed(8)) * 2 - 1
    mean = reference.encode(images).latent_dist.mean
    latents = ours.encode(images)
    torch.testing.assert_close(latents, (mean - v.shift_factor) * v.scale_factor, atol=TOL, rtol=0)
    want = reference.decode(latents / v.scale_factor + v.shift_factor).sample
    torch.testing.assert_close(ours.decode(latents), want, atol=TOL, rtol=0)


def test_a_missing_weight_file_is_named(tmp_path):
    from mstar.models.bagel.weights import load_part
    from mstar.models.common.loading import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="no ae.safetensors in"):
        load_part("vae", tiny_config(), tmp_path, torch.float32, "cpu")
