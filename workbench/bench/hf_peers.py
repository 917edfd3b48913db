"""HF transformers "peers" for the engine benchmark.

Three ways of running the same greedy workload with plain HF transformers, so our engine can be compared with HF
in the same process / same run:

* ``hf_generate_b1``     -- batch-1 ``model.generate`` (latency: TTFT, TPOT, decode tok/s)
* ``hf_generate_static`` -- static batches of ``model.generate`` (left-padded, run to the longest request of the batch)
* ``hf_generate_batch``  -- HF continuous batching (``model.init_continuous_batching`` manager, paged KV cache),
                            one ``max_new_tokens`` per request

All peers are greedy and never stop on EOS, so every request produces exactly the number of tokens it asked for
(static batching produces more, see below). Only torch / transformers / stdlib are imported; transformers is imported
lazily.

Sizing of the continuous batching peer (``CB_DEFAULTS``)
--------------------------------------------------------
Machine: 2 CPU cores, torch 2.13.0+cpu, transformers 5.24.0, SmolLM2-135M-Instruct fp32. Workload =
``bench.make_workload`` with 64 requests (seed 0: 8298 prompt tokens, 8908 wanted output tokens). Another engineer's test runs shared
the machine during part of the sweep, so timings are noisy. Runs marked "clean" had no other process using CPU.

CPU attention options: flash is not available; the manager accepts ``sdpa`` and ``paged|eager`` (``eager`` is switched
to it). Both use a dense additive mask of shape [batch tokens, read KV tokens + batch tokens] over the KV of *all*
requests in the batch. Decode attention therefore costs about ``R * sum(context of the R requests)``, which grows with
the square of the concurrency R. That makes ``max_requests_per_batch`` the setting that matters most. CUDA graphs /
async batching / the decode fast path are GPU-only and turn off by themselves. ``torch.compile``
(``default_compile_level``) was not tried (warm-up cost; dynamic shapes).

16-request slice, 2327 output tokens, default 2 threads, sdpa, page 64, max_batch_tokens 512 (clean):
    max_requests_per_batch 16: 62.9 tok/s (37.0 s) | 8: 69.6 tok/s (33.5 s) | 4: 44.8 tok/s (51.9 s)
Same slice with a competing process on one core (unreliable: 2 OMP threads sharing one free core slow down 3-7x):
    paged|eager, mrb 16: 10.4 tok/s;  sdpa mbt 256, mrb 16: 8.6 tok/s;  sdpa mrb 8: 37.3 tok/s and, shortly after,
    mbt 256: 9.2 tok/s. The spread comes from the contention, not the setting (see the next line).
12-request slice, torch.set_num_threads(1), clean (the other core was left idle to avoid contention):
    mrb 8, mbt 512: 26.4 tok/s | mrb 8, mbt 256: 27.1 tok/s  -> max_batch_tokens 256 vs 512 makes no difference
Full 64-request workload, 2 threads, sdpa, page 64, mbt 512, num_blocks 308 (everything resident), clean:
    max_requests_per_batch 8: 51.6 tok/s (172.6 s) | max_requests_per_batch 16: 71.1 tok/s (125.3 s)
    (for reference, static batching with batch 16 on the same workload: 49.2 useful tok/s, 181.0 s, 15584 generated)
HF's own defaults (page 256, 8192 batch tokens, cache sized from 60% of RAM, mrb = number of requests) and
max_requests_per_batch 32/64 on the full workload were not measured in time.

Chosen defaults: sdpa, max_requests_per_batch 16, max_batch_tokens 512, page_size 64, num_blocks = enough for all
requests at once (no preemption/offloading), block sharing off (random prompts share no prefix, so prefix caching
only adds bookkeeping; it was not measured).

Correctness: for 6 workload requests (prompts 28-232 tokens, up to 96 new tokens), the continuous batching tokens
(4 requests per batch) and the static-batch tokens (left-padded batch of 6) are identical to unbatched greedy
``model.generate`` tokens. EOS did not come up in those outputs, so these runs do not show
that EOS is ignored. That rests on the configuration: ``eos_token_id`` is None for ``generate`` and -1 for continuous
batching, and every run asserts that it got the exact lengths.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

__all__ = [
    "CB_DEFAULTS",
    "load_hf_model",
    "hf_generate_b1",
    "hf_generate_static",
    "hf_generate_batch",
]

# Defaults for HF continuous batching on CPU, chosen from the sweep documented in the module docstring.
CB_DEFAULTS: dict[str, Any] = {
    "attn_implementation": "sdpa",
    "max_batch_tokens": 512,
    "max_requests_per_batch": 16,
    "page_size": 64,
    "num_blocks": None,  # None -> enough blocks for every request of the workload to be resident at once
    "allow_block_sharing": False,
}


# --------------------------------------------------------------------------------------------------------------------
# Model loading / workload
# --------------------------------------------------------------------------------------------------------------------


def load_hf_model(model_dir, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  attn_implementation: str | None = None):
    """Load an HF causal LM in eval mode, with a generation config that never stops on EOS.

    ``generation_config.eos_token_id`` is set to ``None`` (so ``generate`` has no stopping token and
    ``min_new_tokens`` adds no EOS-masking processor), ``pad_token_id`` is set (to the model's pad token, else its EOS
    token, else 0) so that left-padded batches work, and sampling is off (greedy).  The continuous batching peer uses
    its own copy of this config with ``eos_token_id=-1`` (its "no EOS" convention).
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    model.to(device)
    model.eval()

    gc = model.generation_config
    pad = gc.pad_token_id
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        eos = gc.eos_token_id if gc.eos_token_id is not None else getattr(model.config, "eos_token_id", None)
        pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0
    gc.pad_token_id = int(pad)
    gc.eos_token_id = None
    gc.do_sample = False
    gc.num_beams = 1
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if hasattr(gc, name):
            setattr(gc, name, None)
    return model


def _gen_config(model, new_tokens: int, exact: bool = True):
    """Greedy generation config derived from the model's, with a fixed output length and no EOS."""
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = None
    gc.do_sample = False
    gc.num_beams = 1
    gc.max_new_tokens = int(new_tokens)
    gc.min_new_tokens = int(new_tokens) if exact else None
    gc.max_length = None
    return gc


def _device(model) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------------------------------------------------
# Batch 1
# --------------------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def hf_generate_b1(model, prompt_ids: list[int], new_tokens: int) -> dict:
    """Batch-1 greedy ``model.generate`` latency/throughput.

    * warm-up: one ``generate`` of a few tokens on the same prompt;
    * ``ttft_ms``: a separate, timed prefill forward (``model(input_ids)``, prompt through the model + logits of
      the last position, i.e. what produces the first token);
    * ``seconds``: wall time of one full ``generate`` with ``min_new_tokens = max_new_tokens = new_tokens``;
    * decode: the full run is prefill + (new_tokens - 1) decode steps (the first token comes from the prefill), so
      ``decode_tok_s = (new_tokens - 1) / (seconds - ttft)`` and ``tpot_ms = 1000 * (seconds - ttft) / (new_tokens
      - 1)``.  The prefill measured separately stands in for the prefill inside ``generate``; the small per-call
      overhead of ``generate`` (config / processor setup) is left in the decode part.
    """
    dev = _device(model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    mask = torch.ones_like(ids)

    model.generate(ids, attention_mask=mask, generation_config=_gen_config(model, min(4, new_tokens)))

    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    _ = int(logits[0, -1].argmax())
    ttft = time.perf_counter() - t0

    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, generation_config=_gen_config(model, new_tokens))
    seconds = time.perf_counter() - t0

    tokens = out[0, ids.shape[1]:].tolist()
    assert len(tokens) == new_tokens, (len(tokens), new_tokens)
    decode_s = max(seconds - ttft, 1e-9)
    n_dec = max(new_tokens - 1, 1)
    return {
        "tokens": len(tokens),
        "seconds": round(seconds, 2),
        "decode_tok_s": round(n_dec / decode_s, 1),
        "tpot_ms": round(1000.0 * decode_s / n_dec, 2),
        "ttft_ms": round(1000.0 * ttft, 1),
    }


# --------------------------------------------------------------------------------------------------------------------
# Static batching
# --------------------------------------------------------------------------------------------------------------------


def _left_pad(prompts: list[list[int]], pad_id: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(dev), mask.to(dev)


@torch.inference_mode()
def _static_batches(model, requests, batch: int, return_tokens: bool):
    dev = _device(model)
    pad_id = model.generation_config.pad_token_id
    outputs: list[list[int]] = []
    useful = generated = 0
    for start in range(0, len(requests), batch):
        chunk = requests[start:start + batch]
        n_new = max(n for _, n in chunk)
        ids, mask = _left_pad([list(p) for p, _ in chunk], pad_id, dev)
        out = model.generate(ids, attention_mask=mask, generation_config=_gen_config(model, n_new))
        new = out[:, ids.shape[1]:]
        assert new.shape[1] == n_new, (new.shape, n_new)
        useful += sum(n for _, n in chunk)
        generated += new.numel()
        if return_tokens:
            outputs.extend(new[i, :n].tolist() for i, (_, n) in enumerate(chunk))
    return outputs, useful, generated


def hf_generate_static(model, requests: list[tuple[list[int], int]], batch: int = 16,
                       warmup: bool = True, return_tokens: bool = False) -> dict:
    """Static batching with ``model.generate``.

    Requests are processed in order, ``batch`` at a time, left-padded with an attention mask, greedy, each batch
    running ``min_new_tokens = max_new_tokens = max(wanted lengths in the batch)``.  ``out_tok_s`` counts only the
    tokens the requests asked for (``useful_tokens = sum of wanted lengths``) over the wall time; ``generated_tokens``
    is everything the batches produced, including the tokens past each request's wanted length.  A small warm-up
    ``generate`` (2 prompts, 4 tokens) runs before timing when ``warmup``.
    """
    if warmup and requests:
        _static_batches(model, [(list(p)[:32], 4) for p, _ in requests[:2]], batch, False)
    t0 = time.perf_counter()
    outputs, useful, generated = _static_batches(model, requests, batch, return_tokens)
    seconds = time.perf_counter() - t0
    res = {
        "out_tok_s": round(useful / seconds, 1),
        "seconds": seconds,
        "useful_tokens": useful,
        "generated_tokens": generated,
        "batch": batch,
    }
    if return_tokens:
        res["outputs"] = outputs
    return res


# --------------------------------------------------------------------------------------------------------------------
# Continuous batching
# --------------------------------------------------------------------------------------------------------------------


def _cb_run(manager, requests, prefix: str, timeout_s: float) -> dict[str, Any]:
    """Submit ``requests`` to a running manager, wait for all of them; returns {request_id: GenerationOutput}."""
    ids = []
    for i, (prompt, n) in enumerate(requests):
        rid = manager.add_request(list(prompt), request_id=f"{prefix}{i}", max_new_tokens=int(n), eos_token_id=-1)
        if rid is None:
            raise RuntimeError("continuous batching manager refused a request")
        ids.append(rid)
    pending = set(ids)
    results: dict[str, Any] = {}
    deadline = time.perf_counter() + timeout_s
    while pending:
        res = manager.get_result(timeout=0.5)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("continuous batching generation thread stopped unexpectedly")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"continuous batching: {len(pending)} requests unfinished after {timeout_s}s")
            continue
        if res.request_id in pending and res.is_finished():
            if res.error is not None:
                raise RuntimeError(f"request {res.request_id} failed: {res.error}")
            results[res.request_id] = res
            pending.discard(res.request_id)
    return {rid: results[rid] for rid in ids}


def hf_generate_batch(model, requests: list[tuple[list[int], int]], *,
                      attn_implementation: str | None = None,
                      max_batch_tokens: int | None = None,
                      max_requests_per_batch: int | None = None,
                      page_size: int | None = None,
                      num_blocks: int | None = None,
                      allow_block_sharing: bool | None = None,
                      warmup: bool = True,
                      return_tokens: bool = False,
                      timeout_s: float = 3600.0,
                      **cb_kwargs) -> dict:
    """HF continuous batching (paged KV cache, ``ContinuousBatchingManager``) on ``requests``.

    Each request is submitted with ``add_request(prompt, max_new_tokens=wanted, eos_token_id=-1)``, so it produces
    exactly its wanted number of tokens (EOS disabled), greedily.  All requests are submitted at once (in order) and
    the clock runs from the first submission until the last result is back.  Before timing, a couple of short
    requests go through the same (already started) manager as a warm-up.  Unset sizing arguments come from
    ``CB_DEFAULTS``; ``num_blocks=None`` sizes the cache so that every request of the workload can be resident at
    once.  A sizing argument given as the string ``"auto"`` is left to HF's own resolution.  Extra ``cb_kwargs`` go
    straight to ``ContinuousBatchingConfig``.

    Returns ``out_tok_s`` (sum of wanted lengths / seconds), ``seconds``, ``tokens`` (sum of generated tokens, which
    equals the sum of wanted lengths) and the sizing used.
    """
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    d = CB_DEFAULTS
    attn = attn_implementation if attn_implementation is not None else d["attn_implementation"]
    mbt = max_batch_tokens if max_batch_tokens is not None else d["max_batch_tokens"]
    mrb = max_requests_per_batch if max_requests_per_batch is not None else d["max_requests_per_batch"]
    ps = page_size if page_size is not None else d["page_size"]
    share = allow_block_sharing if allow_block_sharing is not None else d["allow_block_sharing"]
    nb = num_blocks if num_blocks is not None else d["num_blocks"]
    if nb is None and ps != "auto":
        # every request resident at once (+ rounding of each request to whole pages, + a little slack)
        nb = sum(-(-(len(p) + n) // ps) for p, n in requests) + 4
    # "auto" leaves a setting to HF's own resolution (memory-based num_blocks, 8192 batch tokens, page 256, ...)
    explicit = {}
    for key, val in (("page_size", ps), ("num_blocks", nb), ("max_batch_tokens", mbt),
                     ("max_requests_per_batch", mrb)):
        if val != "auto":
            explicit[key] = val

    gen_cfg = _gen_config(model, max(n for _, n in requests), exact=False)
    gen_cfg.eos_token_id = -1  # the continuous batching convention for "no EOS"
    cb_cfg = ContinuousBatchingConfig(
        **explicit,
        allow_block_sharing=share,
        auto_switch_to_flash=False,
        **cb_kwargs,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p, _ in requests),
        max_generated_length=max(n for _, n in requests),
        num_requests=len(requests),
    )

    original_attn = model.config._attn_implementation
    if attn != original_attn:
        model.set_attn_implementation(attn)
    manager = None
    try:
        with torch.inference_mode():
            manager = model.init_continuous_batching(
                generation_config=gen_cfg, continuous_batching_config=cb_cfg, workload_hints=hints
            )
            manager.start()
            if warmup:
                _cb_run(manager, [(list(p)[:24], 4) for p, _ in requests[:2]], "warmup_", timeout_s)
            t0 = time.perf_counter()
            results = _cb_run(manager, requests, "req_", timeout_s)
            seconds = time.perf_counter() - t0
            resolved = manager.continuous_batching_config
            sizing = {
                "attn_implementation": model.config._attn_implementation,
                "max_batch_tokens": resolved.max_batch_tokens,
                "max_requests_per_batch": resolved.max_requests_per_batch,
                "page_size": resolved.page_size,
                "num_blocks": resolved.num_blocks,
                "allow_block_sharing": resolved.allow_block_sharing,
            }
    finally:
        if manager is not None:
            manager.stop(block=True)
            manager.destroy()
        if model.config._attn_implementation != original_attn:
            model.set_attn_implementation(original_attn)

    outputs = [list(r.generated_tokens) for r in results.values()]
    for out, (_, n) in zip(outputs, requests):
        if len(out) != n:
            raise RuntimeError(f"continuous batching produced {len(out)} tokens for a request that wanted {n}")
    tokens = sum(len(o) for o in outputs)
    res = {"out_tok_s": round(tokens / seconds, 1), "seconds": round(seconds, 2), "tokens": tokens, **sizing}
    if return_tokens:
        res["outputs"] = outputs
    return res
