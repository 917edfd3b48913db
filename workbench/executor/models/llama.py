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
from torch import nn

from ...platforms.attention import AttentionMetadata
from ...platforms.ops import TorchOps
from ...platforms.quant import PackedWeight, bf16c_pack, quantize_int8, set_weight

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class RMSNorm(nn.Module):
    """Holds the weight and eps; the arithmetic is the model's ops' (platforms/ops.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


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

    def rope(self, ops, qkv, cos, sin):
        """The projection's output [T, (H + 2 kvH) D] -> q [T, H, D] and k [T, kvH, D]
        (normed per head in Qwen3, then rotated) and v [T, kvH, D]."""
        t = qkv.shape[0]
        qkv = qkv.view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            qk = ops.qk_rope(qk, cos, sin, self.num_heads, self.q_norm.weight, self.k_norm.weight,
                             self.q_norm.eps)
        else:
            qk = ops.qk_rope(qk, cos, sin, self.num_heads)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v


class MLP(nn.Module):
    """Its weights; the arithmetic is in DecoderLayer.after_attention (the norm before it is
    fused into gate_up_proj where the platform can)."""

    def __init__(self, cfg, bias: bool):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)


class DecoderLayer(nn.Module):
    """One layer on the residual stream, as vLLM writes it: a layer takes (x, residual) and
    returns its MLP output and the residual stream *before* that output is added; the next
    norm adds them (ops.add_rms_norm, one fused kernel where the platform has it). The sums
    are HF's, in HF's order, so the numbers do not change."""

    def __init__(self, cfg, head_dim, qkv_bias, o_bias, qk_norm, mlp_bias):
        super().__init__()
        self.self_attn = Attention(cfg, head_dim, qkv_bias, o_bias, qk_norm)
        self.mlp = MLP(cfg, mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, ops, x, residual, cos, sin, kv_cache, meta: AttentionMetadata):
        q, k, v, residual = self.before_attention(ops, x, residual, cos, sin)
        o = meta.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.self_attn.scale)
        return self.after_attention(ops, o, residual)

    # The layer is cut around attention so that piecewise graphs (graph_runner.py) can
    # capture everything but attention itself.
    def before_attention(self, ops, x, residual, cos, sin):
        """-> q, k, v and the residual stream (x + residual; x itself in layer 0, where
        residual is None)."""
        norm, attn = self.input_layernorm, self.self_attn
        qkv, residual = ops.add_rms_norm_linear(x, residual, norm.weight, norm.eps,
                                                attn.qkv_proj.weight, attn.qkv_proj.bias)
        q, k, v = attn.rope(ops, qkv, cos, sin)
        return q, k, v, residual

    def after_attention(self, ops, o, residual):
        """o: attention's output [T, H, D] -> (MLP output, residual stream)."""
        attn, mlp, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        x = ops.linear(o.reshape(o.shape[0], attn.q_size), attn.o_proj.weight, attn.o_proj.bias)
        gate_up, residual = ops.add_rms_norm_linear(x, residual, norm.weight, norm.eps,
                                                    mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
        return ops.silu_and_mul_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias), residual


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
        before applying them); rope_sin's first half is negated for ops.apply_rope."""
        self.ops = TorchOps()
        """The fusable ops (platforms/ops.py); a platform may swap in fused kernels."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions: [T]; returns fp32 logits for the rows in logits_indices."""
        x, cos, sin = self.embed(input_ids, positions)
        fused = self.ops.decode_layers(self, x, cos, sin, kv_caches, meta)
        if fused is not None:
            return self.compute_logits(*fused, logits_indices)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(self.ops, x, residual, cos, sin, kv, meta)
        return self.compute_logits(x, residual, logits_indices)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Token embeddings [T, hidden] and the RoPE rows cos, sin [T, 1, D] of the positions."""
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        return self.ops.embedding(input_ids, self.embed_tokens.weight, self.norm.weight.dtype), \
            cos, sin

    def compute_logits(self, x: torch.Tensor, residual: torch.Tensor,
                       logits_indices: torch.Tensor) -> torch.Tensor:
        """The last residual add, final norm and LM head, on the rows that sample: fp32
        [len(logits_indices), vocab]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits, _ = self.ops.add_rms_norm_linear(x.index_select(0, logits_indices),
                                                 residual.index_select(0, logits_indices),
                                                 self.norm.weight, self.norm.eps, weight)
        return logits.float()

    # ---- weights --------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Missing or unused weights raise."""
        params = dict(self.named_parameters())
        done: set[str] = set()
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        unused = []
        packed: dict[str, dict[int, PackedWeight]] = {}
        """Fused weight -> its shards kept packed (their rows are concatenated at the end)."""
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
                if isinstance(tensor, PackedWeight):
                    packed.setdefault(key, {})[shard] = tensor
                    done.add(f"{key}#{shard}")
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
            if isinstance(tensor, PackedWeight):
                packed[key] = {0: tensor}
            else:
                p.copy_(tensor)
            done.add(key)
        for key, shards in packed.items():
            self._set_packed(key, [shards[i] for i in sorted(shards)])
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

    def _set_packed(self, key: str, shards: list[PackedWeight]) -> None:
        """Put packed shards (q, k, v or gate, up: same format and row length) in as the
        fused weight `key`; shards of mixed formats are dequantized into the Parameter."""
        module = self.get_submodule(key.removesuffix(".weight"))
        fmts = {(w.format, w.shape[1]) for w in shards}
        if len(fmts) > 1:
            module.weight.copy_(torch.cat([w.dequantize() for w in shards]))
            return
        rows = sum(w.shape[0] for w in shards)
        if rows != module.weight.shape[0] or shards[0].shape[1] != module.weight.shape[1]:
            raise ValueError(f"model: checkpoint does not match the architecture; {key} is "
                             f"{list(module.weight.shape)}, the file's is "
                             f"[{rows}, {shards[0].shape[1]}]")
        set_weight(module, shards[0] if len(shards) == 1 else PackedWeight(
            torch.cat([w.data for w in shards]), shards[0].format, (rows, shards[0].shape[1])))

    def quantize_int8(self) -> None:
        """quantization='int8': every linear layer's weight, the embedding and the LM head
        (one table when tied) as `int8` PackedWeights, one scale per output row."""
        for module in [*self.modules()]:
            if isinstance(module, (nn.Linear, nn.Embedding)) and \
                    not isinstance(module.__dict__.get("weight"), PackedWeight):
                set_weight(module, quantize_int8(module.weight))

    def compress_bf16(self) -> None:
        """quantization='bf16c': every bf16 linear weight, the embedding and the LM head (one
        table when tied) as `bf16c` PackedWeights holding the same numbers; a matrix the
        format does not pay for (quant.bf16c_pack) stays as it is."""
        done: dict[int, PackedWeight | None] = {}
        for module in [*self.modules()]:
            w = module.weight if isinstance(module, (nn.Linear, nn.Embedding)) else None
            if w is None or isinstance(w, PackedWeight):
                continue
            if id(w) not in done:
                done[id(w)] = bf16c_pack(w)
            if done[id(w)] is not None:
                set_weight(module, done[id(w)])

    def tile_packed_weights(self) -> None:
        """The '-a8' quantizations: every PackedWeight in its 16-row interleaved form for
        8-bit activations (a tied table once)."""
        done: dict[int, PackedWeight] = {}
        for module in [*self.modules()]:
            w = module.__dict__.get("weight")
            if isinstance(w, PackedWeight):
                if id(w) not in done:
                    done[id(w)] = w.tiled()
                set_weight(module, done[id(w)])

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
