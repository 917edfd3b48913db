"""A Llama-family decoder for paged attention: Llama (rope_scaling too), Mistral without a
sliding window, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), GQA, tied or untied
embeddings. Every number comes from the checkpoint's HF config.

Layout differs from HF in one way: q/k/v and gate/up are fused into one matmul each
(`qkv_proj`, `gate_up_proj`, as vLLM does), so a layer runs four matmuls instead of seven.
`load_hf_state_dict` maps HF's names onto the fused weights.

Numerics follow HF's modules (RMSNorm in fp32, RoPE tables in fp32, rotate-half RoPE) so that
greedy tokens match HF transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # HF's steps, minus its no-op casts: five ops
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(cfg, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, [max_positions, head_dim], in fp32 (HF's RoPE init)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = getattr(cfg, "rope_parameters", None) or {}
    if not params:   # older configs
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    else:
        raise ValueError(f"model: rope type {rope_type!r} is not supported")
    pos = torch.arange(max_positions, dtype=torch.float32, device="cpu")
    freqs = torch.outer(pos, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, D]; cos/sin_signed: [T, 1, D].

    HF writes it as x * cos + cat(-x2, x1) * sin. The sign is folded into the table
    (sin_signed = cat(-sin1, sin2)), so the rotation is one roll: cat(x2, x1) * sin_signed.
    Negation is exact, so the result is bitwise the same in four ops instead of six.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg, head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if qk_norm else None

    def qkv(self, x, cos, sin):
        """Project and rotate: x [T, hidden] -> q [T, H, D], k and v [T, kvH, D]."""
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg, bias: bool):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, head_dim, qkv_bias, o_bias, qk_norm, mlp_bias):
        super().__init__()
        self.self_attn = Attention(cfg, head_dim, qkv_bias, o_bias, qk_norm)
        self.mlp = MLP(cfg, mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        q, k, v = self.before_attention(x, cos, sin)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.self_attn.scale)
        return self.after_attention(x, o)

    # The layer is cut around attention so that piecewise graphs (graph_runner.py) can
    # capture everything but attention itself.
    def before_attention(self, x, cos, sin):
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def after_attention(self, x, o):
        """x: the layer's input (the residual); o: attention's output [T, H, D]."""
        x = x + self.self_attn.o_proj(o.reshape(x.shape[0], self.self_attn.q_size))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, max_positions: int):
        super().__init__()
        model_type = getattr(cfg, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model: architecture {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if model_type == "mistral" and getattr(cfg, "sliding_window", None):
            raise ValueError("model: Mistral with a sliding window is not supported")
        self.config = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        qkv_bias = model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        o_bias = model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        qk_norm = model_type == "qwen3"
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.head_dim, qkv_bias, o_bias, qk_norm, mlp_bias)
            for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.register_buffer("rope_cos", torch.empty(max_positions, self.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, self.head_dim), persistent=False)
        """rope_cos / rope_sin hold HF's tables (fp32, then cast to the model dtype as HF does
        before applying them); rope_sin's first half is negated for apply_rope."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions: [T]; returns fp32 logits for the rows in logits_indices."""
        x, cos, sin = self.embed(input_ids, positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.compute_logits(x, logits_indices)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Token embeddings [T, hidden] and the RoPE rows cos, sin [T, 1, D] of the positions."""
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        return self.embed_tokens(input_ids), cos, sin

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows that sample: fp32 [len(logits_indices), vocab]."""
        x = self.norm(hidden.index_select(0, logits_indices))
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()

    # ---- weights --------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Missing or unused weights raise."""
        params = dict(self.named_parameters())
        done: set[str] = set()
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        unused = []
        for name, tensor in state.items():
            key = name.removeprefix("model.")
            if "rotary_emb" in key:
                continue
            parts = key.split(".")
            if len(parts) >= 3 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                p = params.get(key)
                if p is None:
                    unused.append(name)
                    continue
                if target == "qkv_proj":
                    attn = self.layers[int(parts[1])].self_attn
                    sizes = [attn.q_size, attn.kv_size, attn.kv_size]
                else:
                    sizes = [p.shape[0] // 2] * 2
                offset = sum(sizes[:shard])
                p[offset:offset + sizes[shard]].copy_(tensor)
                done.add(f"{key}#{shard}")
                continue
            p = params.get(key)
            if p is None:
                if key == "lm_head.weight" and self.lm_head is None:
                    continue   # a tied checkpoint that stores the head anyway
                unused.append(name)
                continue
            p.copy_(tensor)
            done.add(key)
        missing = []
        for key, p in params.items():
            if key.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                need = [f"{key}#{i}" for i in range(3)]
            elif key.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
                need = [f"{key}#{i}" for i in range(2)]
            else:
                need = [key]
            missing += [n for n in need if n not in done]
        if missing or unused:
            raise ValueError(f"model: checkpoint does not match the architecture; "
                             f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, "
                             f"unexpected {unused[:5]}{'…' if len(unused) > 5 else ''}")

    @torch.no_grad()
    def init_random(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
