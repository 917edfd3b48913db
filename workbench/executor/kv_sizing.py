"""How many KV blocks a device can hold (vLLM's workers decide the same after loading the
weights): the pool gets what the memory budget leaves after the weights and one step's
activations."""
from __future__ import annotations

import torch

from ..config import EngineConfig


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """K and V of every layer for one token, in the KV pool's dtype."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    return block_size * kv_bytes_per_token(model, dtype)


def activation_reserve(config: EngineConfig, hf_config, dtype: torch.dtype) -> int:
    """A generous estimate of one step's peak activations: the widest tensors (MLP, QKV,
    logits) of max_num_batched_tokens tokens, a few of each alive at once, plus graph-pool
    headroom."""
    width = 2 * hf_config.intermediate_size + 3 * hf_config.hidden_size
    elem = torch.empty((), dtype=dtype).element_size()
    logits = max(config.max_num_seqs, 1) * hf_config.vocab_size * 4 * 2
    return int(4 * config.max_num_batched_tokens * width * elem + logits + 512 * 2**20)


def kv_cache_budget(config: EngineConfig, memory: tuple[int, int] | None, hf_config,
                    dtype: torch.dtype, device: str = "") -> float:
    """Bytes for the KV pool, the one rule for real and modelled devices: kv_cache_memory_gb
    if given; else, where the device has memory of its own, `memory` = (free, total) bytes,
    gpu_memory_utilization of the total minus what is in use (the weights) and the activation
    reserve; else (the CPU) 1 GiB. device: the device's name in the error."""
    if config.kv_cache_memory_gb is not None:
        return config.kv_cache_memory_gb * 2**30
    if memory is None:
        return 2**30
    free, total = memory
    budget = (config.gpu_memory_utilization * total - (total - free)
              - activation_reserve(config, hf_config, dtype))
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization: {config.gpu_memory_utilization} of "
                         f"{device + chr(39) + 's ' if device else ''}{total / 2**30:.1f} GiB "
                         f"leaves no room for a KV pool after the weights "
                         f"({(total - free) / 2**30:.1f} GiB in use); raise it or set "
                         "num_kv_blocks")
    return budget


def num_kv_blocks(config: EngineConfig, memory: tuple[int, int] | None, per_block: int,
                  hf_config, dtype: torch.dtype, device: str = "") -> int:
    """num_kv_blocks if given, else as many blocks of per_block bytes as the budget holds
    (the pool's null block among them)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    return max(2, int(kv_cache_budget(config, memory, hf_config, dtype, device) // per_block))
