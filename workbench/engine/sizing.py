"""What an engine's model and pool come to, in numbers: its longest request, the bytes and
counts of its weights, the shape figures a step's cost needs, its EOS ids. The real build
(build.py) and the modelled one (modelled.py) size an engine by the same rules."""
from __future__ import annotations

import json

import torch

from ..config import EngineConfig
from ..executor.kv_sizing import kv_bytes_per_token
from ..platforms.quant import packed_weights

DEFAULT_MAX_MODEL_LEN = 8192


def model_max_len(config: EngineConfig, hf_config) -> int:
    """The longest request before the pool is sized: max_model_len if asked for (an error
    past the model's positions), else the model's limit capped at DEFAULT_MAX_MODEL_LEN."""
    model_limit = getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
    if config.max_model_len is not None and config.max_model_len > model_limit:
        raise ValueError(f"max_model_len: the model supports at most {model_limit} positions "
                         f"(got {config.max_model_len})")
    return config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)


def fit_max_model_len(config: EngineConfig, max_model_len: int, pool_tokens: int) -> int:
    """A request must fit in the pool (and in one step when prompts are not chunked): the
    model's limit is lowered to what fits; a max_model_len asked for that does not fit is
    an error naming what limits it."""
    limit = (pool_tokens if config.enable_chunked_prefill
             else min(pool_tokens, config.max_num_batched_tokens))
    if max_model_len <= limit:
        return max_model_len
    if config.max_model_len is not None:
        what = ("num_kv_blocks (one block is the reserved null block)" if limit == pool_tokens
                else "max_num_batched_tokens")
        raise ValueError(f"max_model_len: {max_model_len} tokens do not fit; {what} "
                         f"allows {limit} (raise it or lower max_model_len)")
    return limit


def num_params(module) -> int:
    """Weights of a module, packed ones (platforms/quant.py) counted as the matrices they are."""
    return sum(p.numel() for p in module.parameters()) + \
        sum(w.numel() for w in packed_weights(module))


def weight_formats(model) -> tuple[str, ...]:
    """The formats of the matrices a forward reads (the norms aside), largest share first."""
    share: dict[str, int] = {}
    for w in packed_weights(model):
        share[w.format] = share.get(w.format, 0) + w.numel()
    for name, p in model.named_parameters():
        if p.dim() == 2:
            key = str(p.dtype).replace("torch.", "")
            share[key] = share.get(key, 0) + p.numel()
    return tuple(sorted(share, key=share.get, reverse=True))


def weight_bytes(module) -> int:
    """The bytes a module's weights take, packed ones as packed."""
    return sum(p.numel() * p.element_size() for p in module.parameters()) + \
        sum(w.nbytes for w in packed_weights(module))


def model_shape(model, hf_config, dtype: torch.dtype) -> dict:
    """The shape figures EngineInfo carries (what FLOP and byte counts of a step need): the
    bytes a decode step reads are the layers' and the LM head's, as stored."""
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    return dict(num_layer_params=num_params(model.layers), hidden_size=hf_config.hidden_size,
                intermediate_size=hf_config.intermediate_size,
                num_attention_heads=hf_config.num_attention_heads,
                num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                weight_bytes=weight_bytes(model.layers) + weight_bytes(head),
                kv_bytes_per_token=kv_bytes_per_token(model, dtype))


def eos_ids(hf_config, tokenizer, model_path) -> set[int]:
    """EOS ids from the config, the tokenizer and generation_config.json, together."""
    found = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    gen = model_path / "generation_config.json" if model_path else None
    if gen is not None and gen.is_file():
        found.append(json.loads(gen.read_text()).get("eos_token_id"))
    ids: set[int] = set()
    for v in found:
        ids.update([v] if isinstance(v, int) else [x for x in (v or []) if isinstance(x, int)])
    return ids
