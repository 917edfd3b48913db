"""Grammar engines for structured output, measured on this machine (docs/benchmarks.md).

For xgrammar, llguidance and outlines-core, with the smollm2 tokenizer: import time, the
one-off tokenizer set-up, compile time for a few JSON schemas, a regex and a choice, and the
per-step cost of filling the token bitmask for a batch of 1 and of 16 constrained rows while
they walk a valid answer token by token (fill + apply on [rows, vocab] fp32 logits + accept).

    python benchmarks/structured_output.py
"""
from __future__ import annotations

import json
import statistics
import time

import torch

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "owner": {"type": "object", "properties": {"email": {"type": "string"},
                                                   "active": {"type": "boolean"}},
                  "required": ["email", "active"]},
        "score": {"type": "number"}}, "required": ["id", "tags", "owner", "score"]},
    "enum_list": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "cyan", "magenta"]}},
        "count": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["colors", "count"]},
}
ANSWER = json.dumps({"id": 12, "tags": ["alpha", "beta", "gamma"],
                     "owner": {"email": "someone@example.com", "active": True}, "score": 3.25},
                    separators=(",", ":"))   # compact: what the engine's JSON grammar allows
REGEX = r"\d{3}-\d{3}-\d{4}"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    pairs = [(chr(b), b) for b in printable] + [(chr(256 + n), b) for n, b in enumerate(extra)]
    return dict(pairs)


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 2)


def _time_steps(steps: list[int], batch: int, fill_and_apply, advance) -> dict:
    """Per step: fill + apply the mask (`fill_and_apply()`), then advance every row by the
    step's token (`advance(token)`). The first step apart (lazy engines build there)."""
    times = []
    for t in steps:
        t0 = time.perf_counter()
        fill_and_apply()
        advance(t)
        times.append(time.perf_counter() - t0)
    return {f"first_step_b{batch}_ms": round(times[0] * 1e3, 3),
            f"step_b{batch}_ms": round(statistics.median(times) * 1e3, 3)}


def bench_xgrammar(tok, vocab: int, steps: list[int], batch: int) -> dict:
    t0 = time.perf_counter()
    import xgrammar as xgr
    out = {"import_ms": _ms(t0)}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out["tokenizer_ms"] = _ms(t0)
    for name, s in SCHEMAS.items():
        t0 = time.perf_counter()
        compiler.compile_json_schema(json.dumps(s))
        out[f"compile_{name}_ms"] = _ms(t0)
    t0 = time.perf_counter(); compiler.compile_regex(REGEX); out["compile_regex_ms"] = _ms(t0)
    t0 = time.perf_counter(); compiler.compile_builtin_json_grammar(); out["compile_json_object_ms"] = _ms(t0)
    g = compiler.compile_json_schema(json.dumps(SCHEMAS["nested"]))
    matchers = [xgr.GrammarMatcher(g) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    batcher = xgr.BatchGrammarMatcher(max_threads=min(batch, 8)) if batch > 1 else None

    def fill_and_apply():
        if batcher is None:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            batcher.batch_fill_next_token_bitmask(matchers, bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)

    def advance(t):
        assert all(m.accept_token(t) for m in matchers)
    return {**out, **_time_steps(steps, batch, fill_and_apply, advance)}


def bench_llguidance(tok, vocab: int, steps: list[int], batch: int) -> dict:
    t0 = time.perf_counter()
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    out = {"import_ms": _ms(t0)}
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    out["tokenizer_ms"] = _ms(t0)

    def compile_(grm):
        m = llguidance.LLMatcher(lltok, grm)
        assert not m.is_error(), m.get_error()
        return m
    for name, s in SCHEMAS.items():
        t0 = time.perf_counter()
        compile_(llguidance.LLMatcher.grammar_from_json_schema(s))
        out[f"compile_{name}_ms"] = _ms(t0)
    t0 = time.perf_counter(); compile_(llguidance.grammar_from("regex", REGEX)); out["compile_regex_ms"] = _ms(t0)
    t0 = time.perf_counter(); compile_(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})); out["compile_json_object_ms"] = _ms(t0)
    grm = llguidance.LLMatcher.grammar_from_json_schema(SCHEMAS["nested"])
    matchers = [compile_(grm) for _ in range(batch)]
    bitmask = lt.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    pool = llguidance.LLExecutor() if batch > 1 else None

    def fill_and_apply():
        if pool is None:
            lt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            lt.fill_next_token_bitmask_par(pool, [(m, i) for i, m in enumerate(matchers)], bitmask)
        lt.apply_token_bitmask_inplace(logits, bitmask)

    def advance(t):
        assert all(m.consume_token(t) for m in matchers)
    return {**out, **_time_steps(steps, batch, fill_and_apply, advance)}


def bench_outlines(tok, vocab: int, steps: list[int], batch: int) -> dict:
    t0 = time.perf_counter()
    from outlines_core import Guide, Index, Vocabulary, json_schema
    import outlines_core.kernels.torch as ot
    out = {"import_ms": _ms(t0)}
    t0 = time.perf_counter()
    # Byte-level BPE: map each vocabulary entry back to its bytes.
    dec = _byte_decoder()
    special = set(tok.all_special_ids)
    m: dict = {}
    for s, i in tok.get_vocab().items():
        if i in special:
            continue
        m.setdefault(bytes(dec[c] for c in s), []).append(i)
    v = Vocabulary(tok.eos_token_id, m)
    out["tokenizer_ms"] = _ms(t0)
    for name, s in SCHEMAS.items():
        t0 = time.perf_counter()
        Index(json_schema.build_regex_from_schema(json.dumps(s)), v)
        out[f"compile_{name}_ms"] = _ms(t0)
    t0 = time.perf_counter(); Index(REGEX, v); out["compile_regex_ms"] = _ms(t0)
    out["compile_json_object_ms"] = None   # no unconstrained-object grammar: needs a schema
    index = Index(json_schema.build_regex_from_schema(json.dumps(SCHEMAS["nested"])), v)
    guides = [Guide(index) for _ in range(batch)]
    bitmask = ot.allocate_token_bitmask(vocab)
    bitmask = bitmask.expand(batch, -1).contiguous() if bitmask.dim() == 2 else bitmask
    logits = torch.randn(batch, vocab)

    def fill_and_apply():
        for i, g in enumerate(guides):
            ot.fill_next_token_bitmask(g, bitmask[i:i + 1])
        ot.apply_token_bitmask_inplace(logits, bitmask)

    def advance(t):
        for g in guides:
            g.advance(t)
    return {**out, **_time_steps(steps, batch, fill_and_apply, advance)}


def bench_workbench(tok, vocab: int, steps: list[int], batch: int) -> dict:
    """What the engine runs: StructuredOutputManager (llguidance, one parallel fill for all
    rows) and the sampler's own apply_token_bitmask (no torch.compile)."""
    from workbench.core.sampling_params import StructuredOutputsParams
    from workbench.core.structured_output import StructuredOutputManager
    from workbench.executor.sampler import apply_token_bitmask
    t0 = time.perf_counter()
    manager = StructuredOutputManager(tok, vocab)
    manager.compile(StructuredOutputsParams(json_object=True))
    out = {"tokenizer_ms": _ms(t0)}
    for name, s in SCHEMAS.items():
        t0 = time.perf_counter()
        manager.compile(StructuredOutputsParams(json=s))
        out[f"compile_{name}_ms"] = _ms(t0)
    t0 = time.perf_counter(); manager.compile(StructuredOutputsParams(regex=REGEX)); out["compile_regex_ms"] = _ms(t0)
    matchers = [manager.compile(StructuredOutputsParams(json=SCHEMAS["nested"])) for _ in range(batch)]
    logits = torch.randn(batch, vocab)

    def advance(t):
        assert all(m.consume_token(t) for m in matchers)
    return {**out, **_time_steps(
        steps, batch, lambda: apply_token_bitmask(logits, manager.grammar_bitmask(matchers)),
        advance)}


def main() -> None:
    from importlib.metadata import version
    from transformers import AutoTokenizer
    from workbench.executor.models.loader import smollm2_checkpoint_dir
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(smollm2_checkpoint_dir())
    vocab = len(tok)
    steps = tok.encode(ANSWER, add_special_tokens=False)
    for name, fn, dist in (("xgrammar", bench_xgrammar, "xgrammar"),
                           ("llguidance", bench_llguidance, "llguidance"),
                           ("outlines-core", bench_outlines, "outlines-core"),
                           ("workbench (llguidance)", bench_workbench, "llguidance")):
        row = {"engine": name, "version": version(dist), "answer_tokens": len(steps)}
        for b in (1, 16):
            r = fn(tok, vocab, steps, b)
            row.update(r if b == 1 else {k: v for k, v in r.items() if k.startswith("step")})
        print(json.dumps(row))


if __name__ == "__main__":
    main()
