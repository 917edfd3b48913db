"""Models: the Llama-family decoder and where its weights come from."""
from __future__ import annotations

import torch

from .llama import LlamaForCausalLM, rope_tables
from .loader import LoadedCheckpoint, load_checkpoint, model_digest


def build_model(ckpt: LoadedCheckpoint, dtype: torch.dtype, device: torch.device,
                max_positions: int, seed: int = 0, ops=None,
                quantization: str | None = None) -> LlamaForCausalLM:
    """Instantiate the decoder for ckpt's config and fill it with ckpt's (or seeded) weights.
    `ops`: the fusable ops it runs (a platform's fused kernels); None keeps the torch
    reference. quantization='int8': the weights quantized once loaded ('gguf' ones come
    packed in the checkpoint's state already); '-a8': then interleaved for 8-bit
    activations (quant.py's tiled formats); 'bf16c': the bf16 weights packed losslessly."""
    with torch.device("meta"):
        model = LlamaForCausalLM(ckpt.hf_config, max_positions)
    model = model.to_empty(device="cpu")
    cos, sin = rope_tables(ckpt.hf_config, max_positions)
    half = sin.shape[-1] // 2
    model.rope_cos, model.rope_sin = cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    if ckpt.state_dict is None:
        model.init_random(seed)
    else:
        model.load_hf_state_dict(ckpt.state_dict)
    if quantization in ("int8", "int8-a8"):
        model.quantize_int8()
    if quantization in ("gguf-a8", "int8-a8"):
        model.tile_packed_weights()
    if ops is not None:
        model.ops = ops
    model = model.to(device=device, dtype=dtype).eval()
    if quantization == "bf16c":
        model.compress_bf16()
    return model


__all__ = ["LlamaForCausalLM", "build_model", "load_checkpoint", "LoadedCheckpoint",
           "model_digest"]
