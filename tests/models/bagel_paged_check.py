"""Run under TRITON_INTERPRET=1 by test_bagel_networks.py: BAGEL's tiny LLM decodes contexts of different
lengths (crossing pages) in batched steps with a pool whose decode attention is the SDPA reference, then the
Triton paged decode kernel, then that kernel under the component's decode plan with the rows padded as a
captured graph runs them; prints the largest logit differences to the first as JSON."""

from __future__ import annotations

import json

import torch

from mstar.engines.base import KVLayout, KVPoolSpec
from mstar.engines.kv_cache.paged import PagedKV
from mstar.models.bagel.components import LLMComponent
from mstar.models.bagel.config import TokenIds
from mstar.models.bagel.context import KVContext, PackedAttention, QuerySpec
from mstar.models.bagel.llm import Routing
from mstar.models.bagel.tiny import tiny_config
from mstar.models.bagel.weights import PARTS
from mstar.models.common.loading import load_named_tensors
from tests.models.bagel_reference import llm_shapes, random_state
from tests.unit.paged_attention_cases import _fix_interpreter_scalars


@torch.no_grad()
def decode(llm, backend: str, ids: list[torch.Tensor], prompts: tuple[int, ...], steps: int,
           pad_to: int | None = None) -> torch.Tensor:
    """Logits [steps, B, vocab] of batched decode steps after each prompt's prefill; with `pad_to`, each step
    runs as a captured one would: the component's decode plan over rows padded to `pad_to`."""
    lm, cfg = llm.language_model, tiny_config().llm
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    pool = PagedKV(KVPoolSpec(layout, 32, "test", page_size=4, max_rows=8, attention_backend=backend), "cpu")
    contexts = [KVContext(pool) for _ in prompts]
    for x, n, context in zip(ids, prompts, contexts, strict=True):
        attn = PackedAttention([QuerySpec(context, n, None, store=True)], lm.attention_scale)
        lm(lm.embed_tokens(x[:n]), torch.arange(n), Routing(), attn)
        attn.commit([n])
    component = LLMComponent(llm, tiny_config(), TokenIds(bos=1, eos=2, start_of_image=3, end_of_image=4))
    component.set_kv_pool(pool)
    out = []
    for step in range(steps):
        tokens = torch.stack([x[n + step] for x, n in zip(ids, prompts, strict=True)])
        positions = torch.tensor([n + step for n in prompts])
        if pad_to is None:
            attn = PackedAttention([QuerySpec(c, 1, None, store=True) for c in contexts], lm.attention_scale)
            out.append(lm.logits(lm(lm.embed_tokens(tokens), positions, Routing(), attn)))
            attn.commit((positions + 1).tolist())
            continue
        rows, rope = component.decode_rows(contexts, tokens.tolist(), pad_to)
        padding = torch.full((pad_to - len(prompts),), 5)
        hidden = component.decode_plan().fn(torch.cat([rows, padding]), torch.cat([rope, padding]))
        out.append(lm.logits(hidden[: len(prompts)]))
        for context in contexts:
            context.commit(1, context.rope + 1)
    return torch.stack(out)


def main() -> None:
    _fix_interpreter_scalars()
    cfg = tiny_config()
    build, mapper, _ = PARTS["llm"]
    llm = build(cfg, torch.float32, "cpu")
    load_named_tensors(llm, random_state(llm_shapes(cfg), 7).items(), mapper(cfg))
    prompts, steps = (3, 6, 9, 13, 1), 3
    gen = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, cfg.llm.vocab_size, (n + steps,), generator=gen) for n in prompts]
    sdpa = decode(llm, "sdpa", ids, prompts, steps)
    triton = decode(llm, "triton", ids, prompts, steps)
    padded = decode(llm, "triton", ids, prompts, steps, pad_to=8)
    print(json.dumps({"max_diff": float((triton - sdpa).abs().max()), "padded_diff": float((padded - sdpa).abs().max()),
                      "scale": float(sdpa.abs().max())}))


if __name__ == "__main__":
    main()
