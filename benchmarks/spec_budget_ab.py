"""Same-run A/B of the draft budget's early stop: before (stop at the first option under 0.8x the
best) against after (look on through the verify curve's flat part), n-gram k=4 and the gguf-a8
self-draft, batch 1, greedy and sampled (temperature 0.7, top_p 0.9, seeded), 3 interleaved
rounds, best round; plain decoding beside them."""
import statistics, time, types
from workbench import Engine, SamplingParams
from workbench.bench.speculative import workload
from workbench.engine.speculative import Curve, SpecDecoding

def old_budget(self, decoding, values):
    base = Curve(self.costs[False].table()).at(decoding)
    if base is None:
        return [0] * len(values)
    verify = Curve(self.costs[True].table())
    order = sorted(((v, i) for i, vs in enumerate(values) for v in vs), key=lambda vi: -vi[0])
    best, best_n, gain = decoding / base, 0, 0.0
    for n, (v, _) in enumerate(order, 1):
        gain += v
        rate = (decoding + gain) / (verify.at(decoding + n) or base)
        if rate > best:
            best, best_n = rate, n
        elif rate < 0.8 * best:
            break
    out = [0] * len(values)
    for _, i in order[:best_n]:
        out[i] += 1
    return out

def arms(kw, spec):
    plain = Engine(**kw)
    before, after = Engine(**kw, speculative_config=spec), Engine(**kw, speculative_config=spec)
    sd = before.core.pipeline.spec
    sd.budget = types.MethodType(old_budget, sd)
    return {"plain": plain, "before": before, "after": after}

for label, kw, spec, kind in [
        ("ngram grounded", dict(model="smollm2", device="cpu"), {"method": "ngram", "num_speculative_tokens": 4}, "grounded"),
        ("self-draft open", dict(model="smollm2", device="cpu", quantization=None),
         {"method": "draft_model", "model": "smollm2", "quantization": "gguf-a8", "num_speculative_tokens": 4}, "open")]:
    es = arms(kw, spec)
    prompts = workload(kind, es["plain"].tokenizer, 1)
    for mode, p in (("greedy", SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)),
                    ("sampled", SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=128, ignore_eos=True))):
        for e in es.values():
            e.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
        best = {k: 0.0 for k in es}
        for r in range(3):
            for k in (list(es) if r % 2 == 0 else list(es)[::-1]):
                t = time.perf_counter()
                out = es[k].generate(prompts, p)
                best[k] = max(best[k], sum(len(o.token_ids) for o in out) / (time.perf_counter() - t))
        print(f"{label:16s} {mode:7s} plain {best['plain']:6.1f}  before {best['before']:6.1f} "
              f"({best['before'] / best['plain']:.2f}x)  after {best['after']:6.1f} "
              f"({best['after'] / best['plain']:.2f}x)", flush=True)
    for e in es.values():
        e.shutdown()
