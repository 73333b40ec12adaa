"""One decoder-only transformer for the Llama family (SmolLM2, Llama, Mistral, Qwen2, Qwen3) and Gemma 3.

Module names match the Hugging Face checkpoints, so a HF state dict loads as it is.
The forward is ragged: B rows, each with its own start position and up to T new tokens,
reading and writing a paged KV cache through each row's block table (engine/kv_cache.py).

On CPU in float32, once `pack_linears` has run, the ops between linears run on our kernels
(csrc/decode_ops.cpp) and a decode or verify step runs each layer as one C++ call
(csrc/decode_layer.cpp, the same kernels in the same order), and where every linear is on the int8
kernel so does every forward, prefill chunks too; on GPUs and in bfloat16, PyTorch ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.gguf_blocks import BlockWeight, Int8Blocks
from engine.models.linear import BlockLinear, PackedLinear, dense
from engine.kernels import MAX_ROWS


@dataclass(frozen=True)
class ModelArgs:
    arch: str  # "llama" (Llama/SmolLM2/Mistral/Qwen2/Qwen3) or "gemma3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    # Per layer: None for global attention, else the sliding window size.
    layer_windows: tuple[int | None, ...] = ()
    # Per layer: key into `rope_inv_freq` (layers of one kind share frequencies).
    layer_rope: tuple[str, ...] = ()
    rope_inv_freq: dict[str, tuple[float, ...]] = field(default_factory=dict)
    rope_scaling: dict[str, float] = field(default_factory=dict)
    attn_scale: float = 0.0
    embed_scale: float = 1.0
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + w)
    sandwich_norm: bool = False  # Gemma: extra norms after attention and MLP

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        model_type = config.model_type
        gemma = model_type in ("gemma3_text", "gemma3")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3") and not gemma:
            raise ValueError(
                f"model type {model_type!r} is not supported; supported: llama, mistral, qwen2, qwen3, gemma3_text"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        n = config.num_hidden_layers
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
        window = getattr(config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            window = None
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)

        rope_params = config.rope_parameters
        per_type = set(layer_types) <= set(rope_params) if isinstance(rope_params, dict) else False
        inv_freq, scaling = {}, {}
        for kind in sorted(set(layer_types)):
            params = rope_params[kind] if per_type else rope_params
            rope_type = params.get("rope_type", "default")
            if rope_type == "default":
                base = params["rope_theta"]
                freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
                factor = 1.0
            else:
                kwargs = {"layer_type": kind} if per_type else {}
                freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
            inv_freq[kind] = tuple(freq.tolist())
            scaling[kind] = float(factor)

        return cls(
            arch="gemma3" if gemma else "llama",
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=n,
            num_heads=num_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", False)) or model_type == "qwen2",
            qk_norm=gemma or model_type == "qwen3",
            hidden_act=getattr(config, "hidden_activation", None) or config.hidden_act,
            layer_windows=windows,
            layer_rope=tuple(layer_types),
            rope_inv_freq=inv_freq,
            rope_scaling=scaling,
            attn_scale=(config.query_pre_attn_scalar**-0.5) if gemma else head_dim**-0.5,
            embed_scale=math.sqrt(config.hidden_size) if gemma else 1.0,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norm=gemma,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))

    def forward(self, x: Tensor, cpu_kernels=None) -> Tensor:
        if cpu_kernels:  # an engine.kernels.Kernels
            flat = cpu_kernels.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, self.offset)
            return flat.view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: scale in float32, then cast
            return (h * (self.offset + self.weight.float())).type_as(x)
        return self.weight * h.type_as(x)  # Llama: cast, then scale


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, H, T, D]; cos/sin: [B, 1, T, D]; rotate-half layout as in HF checkpoints
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.attn_scale
        self.window = args.layer_windows[layer]
        self.tp_group = None  # set by engine/models/tp.py when sharded
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def fuse(self) -> None:
        """One q|k|v matrix: a single small-M GEMM costs far less than three (see decode_step.py)."""
        self.qkv_proj = _concat_linears(self.q_proj, self.k_proj, self.v_proj)
        self.q_proj = self.k_proj = self.v_proj = None

    def forward(self, x: Tensor, ctx: "ForwardContext") -> Tensor:
        B, T, _ = x.shape
        if ctx.cpu_kernels and (T <= SMALL_QUERY_ROWS or ctx.cpp_layers) and getattr(self, "qkv_proj", None) is not None:
            # one kernel from q|k|v to the attention output: norms, rotary, the cache write, attention
            qkv = self.qkv_proj(x).view(B * T, -1)
            cos, sin = ctx.rope[ctx.layer_rope[self.layer]]
            qk = self.q_norm is not None
            out = ctx.cpu_kernels.ops.decode_attention(
                qkv, ctx.positions, ctx.tables, ctx.cache.k[self.layer], ctx.cache.v[self.layer], cos, sin,
                self.q_norm.weight if qk else None, self.k_norm.weight if qk else None,
                self.q_norm.eps if qk else 0.0, self.q_norm.offset if qk else 0.0, self.num_heads, self.scale,
                self.window or 0, ctx.row_seqs)
            return self._project_out(out.view(B, T, -1))
        if getattr(self, "qkv_proj", None) is not None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        v = v.reshape(B, T, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.rope[ctx.layer_rope[self.layer]]
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        keys, values = ctx.cache.update(self.layer, ctx.tables, ctx.positions, k, v, ctx.key_len, ctx.read_blocks)
        if self.window is None:
            mask = ctx.global_mask
        else:  # keys before the step's window are masked for every query: don't compute them
            first = ctx.window_start(self.window)
            mask = ctx.window_mask(self.window)[..., first:]
            keys, values = keys[:, :, first:], values[:, :, first:]
        out = attention(q, keys, values, mask, self.scale)  # [B, H, T, D]
        return self._project_out(out.transpose(1, 2).reshape(B, T, -1))

    def _project_out(self, out: Tensor) -> Tensor:
        out = self.o_proj(out)
        if self.tp_group is not None:  # row-parallel o_proj: sum the ranks' partial outputs
            torch.distributed.all_reduce(out, group=self.tp_group)
        return out


SMALL_QUERY_ROWS = 16  # decode and verify steps; longer prefill chunks go to SDPA (except on int8: C++)


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Grouped-query attention. q [B, H, T, D]; keys, values [B, Hkv, S, D]; mask [B, 1, T, S]
    (True = visible). Query head h reads kv head h // (H / Hkv), as in transformers.

    For a few query rows, two batched matmuls beat the flash kernel, whose fixed cost per call
    is ~2.5x theirs at T=5 (a verify step) on CPU.
    """
    B, H, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    if T > SMALL_QUERY_ROWS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=H != Hkv)
    G = H // Hkv
    scores = torch.matmul(q.reshape(B, Hkv, G * T, D), keys.transpose(-1, -2)).view(B, Hkv, G, T, S)
    scores = torch.where(mask[:, :, None], scores.mul_(scale), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B, Hkv, G * T, S)
    return torch.matmul(probs, values).view(B, H, T, D)


def _concat_linears(*layers: nn.Module) -> nn.Module:
    """One layer whose output rows are those of `layers` in order: blocks if every part is blocks,
    else float32."""
    bias = nn.Parameter(torch.cat([l.bias for l in layers]), requires_grad=False) if layers[0].bias is not None else None
    if all(isinstance(l, BlockLinear) for l in layers):
        return BlockLinear(BlockWeight.cat([l.blocks for l in layers]), bias)
    fused = nn.Linear(layers[0].in_features, sum(l.out_features for l in layers), bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([dense(l).weight for l in layers]), requires_grad=False)
    fused.bias = bias
    return fused


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.tp_group = None
        self.gelu = args.hidden_act != "silu"
        if args.hidden_act == "silu":
            self.act = F.silu
        elif args.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
            self.act = lambda t: F.gelu(t, approximate="tanh")
        else:
            raise ValueError(f"activation {args.hidden_act!r} is not supported")

    def fuse(self) -> None:
        self.gate_up_proj = _concat_linears(self.gate_proj, self.up_proj)
        self.gate_proj = self.up_proj = None

    def forward(self, x: Tensor, cpu_kernels=None) -> Tensor:
        if cpu_kernels and getattr(self, "gate_up_proj", None) is not None:
            gate_up = self.gate_up_proj(x)
            hidden = cpu_kernels.ops.gated_act(gate_up.view(-1, gate_up.shape[-1]), self.gelu)
            out = self.down_proj(hidden.view(*x.shape[:-1], -1))
        else:
            if getattr(self, "gate_up_proj", None) is not None:
                gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            out = self.down_proj(self.act(gate) * up)
        if self.tp_group is not None:  # row-parallel down_proj
            torch.distributed.all_reduce(out, group=self.tp_group)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.sandwich = args.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.kernel = None  # this layer as one C++ call (csrc/decode_layer.cpp): Transformer.build_decode_layers

    def forward(self, x: Tensor, ctx: "ForwardContext") -> Tensor:
        if self.kernel is not None and ctx.cpp_layers:
            # the same kernels as the per-op path below, in the same order: bit-identical, one call
            B, T, _ = x.shape
            i = self.self_attn.layer
            cos, sin = ctx.rope[ctx.layer_rope[i]]
            out = self.kernel.forward(x.reshape(B * T, -1).contiguous(), ctx.positions, ctx.tables,
                                      ctx.cache.k[i], ctx.cache.v[i], cos, sin, ctx.row_seqs)
            return out.view(B, T, -1)
        k = ctx.cpu_kernels
        if self.sandwich:  # Gemma: norm around each sub-block, residual outside
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x, k), ctx), k)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x, k), k), k)
        x = x + self.self_attn(self.input_layernorm(x, k), ctx)
        return x + self.mlp(self.post_attention_layernorm(x, k), k)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)


class ForwardContext:
    """What every layer of one forward call shares: block tables, positions, masks, rotary tables."""

    def __init__(self, args: ModelArgs, cache, tables: Tensor, positions: Tensor, dtype: torch.dtype,
                 cpu_kernels=None, static: bool = False):
        self.cache, self.tables, self.positions = cache, tables, positions  # tables [B, blocks], positions [B, T]
        # static: no host read of a tensor's value (a compiled step's graph): the keys span the tables'
        # whole width, the masks hide what lies past each query, sliding windows included
        self.static = static
        self.cpu_kernels = cpu_kernels  # the engine.kernels.Kernels this forward runs its ops on, or None
        self.cpp_layers = False  # each layer as its C++ call, where built (decode and verify steps; any step on int8)
        self.row_seqs: Tensor | None = None  # ragged rows: each token's row of `tables` (positions [1, N])
        self.layer_rope = args.layer_rope
        self._global_mask: Tensor | None = None
        self._window_masks: dict[int, Tensor] = {}
        self._lowest: int | None = None
        self._key_len: int | None = None
        self._read_blocks: Tensor | None = None
        self.rope = {}
        for kind, freq in args.rope_inv_freq.items():
            inv = torch.tensor(freq, dtype=torch.float32, device=positions.device)
            angles = positions[..., None].float() * inv  # [B, T, D/2]
            emb = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D]
            s = args.rope_scaling[kind]
            self.rope[kind] = ((emb.cos() * s).to(dtype), (emb.sin() * s).to(dtype))

    # read_blocks, key_len and the masks: on first use (the C++ decode layers need none of them); plain
    # attributes, not functools.cached_property, whose lock torch.compile can't trace
    @property
    def read_blocks(self) -> Tensor:
        if self._read_blocks is None:
            self._read_blocks = self.cache.read_blocks(self.tables, self.key_len)
        return self._read_blocks

    @property
    def key_len(self) -> int:
        if self._key_len is None:
            self._key_len = (self.tables.shape[1] * self.cache.block_size if self.static
                             else int(self.positions.max()) + 1)
        return self._key_len

    @property
    def global_mask(self) -> Tensor:
        if self._global_mask is None:
            key_pos = torch.arange(self.key_len, device=self.positions.device)
            # [B, 1, T, S]: a query sees keys at or before its own position
            self.causal_delta = self.positions[:, None, :, None] - key_pos[None, None, None, :]
            self._global_mask = self.causal_delta >= 0
        return self._global_mask

    def window_start(self, window: int) -> int:
        """The first key position any query of this forward sees through a sliding window (a long
        prompt's later chunks attend to a window's keys in these layers, not to the whole prefix)."""
        if self.static:
            return 0
        if self._lowest is None:
            self._lowest = int(self.positions.min())
        return max(0, self._lowest - window + 1)

    def window_mask(self, window: int) -> Tensor:
        if window not in self._window_masks:
            self._window_masks[window] = self.global_mask & (self.causal_delta < window)
        return self._window_masks[window]


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # engine/kernels for norms, attention and activations: set by pack_linears where there are kernels
        # (CPU, float32, projections fused); cpu_kernels False turns them off (kernels stays)
        self.kernels = None
        self.cpu_kernels = False
        # every linear of every C++ layer on the int8 kernel, which takes any number of rows: every
        # forward (prefill chunks too) runs the layers in C++, so a token's keys and values don't depend
        # on the chunk it came in (build_decode_layers)
        self.layers_take_any_rows = False

    def fuse_projections(self) -> None:
        """Merge q/k/v and gate/up weights for inference (after any sharding, before packing)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @property
    def decode_layers(self) -> list | None:
        """Each layer's C++ DecodeLayer, or None where they aren't built (or turned off)."""
        kernels = [layer.kernel for layer in self.model.layers]
        return kernels if all(k is not None for k in kernels) else None

    @decode_layers.setter
    def decode_layers(self, kernels: list | None) -> None:
        for i, layer in enumerate(self.model.layers):
            layer.kernel = None if kernels is None else kernels[i]

    def build_decode_layers(self) -> bool:
        """Give each layer its C++ DecodeLayer (the whole layer of a decode or verify step in one
        call, bit-identical to the per-op kernel path), where that path runs: projections fused, CPU
        kernels on, not tensor-parallel (the layers all-reduce between ops). Call after packing."""
        self.decode_layers = None
        self.layers_take_any_rows = False
        layers = self.model.layers
        if not self.cpu_kernels or self.kernels is None or any(l.self_attn.tp_group is not None or getattr(l.self_attn, "qkv_proj", None) is None
                                       or getattr(l.mlp, "gate_up_proj", None) is None for l in layers):
            return False
        built, any_rows = [], True
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            cpp = self.kernels.decode_layer(attn.num_heads, attn.scale, attn.window or 0,
                                                   layer.input_layernorm.eps, layer.input_layernorm.offset, mlp.gelu)
            for which, linear_layer in enumerate((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                if isinstance(linear_layer, BlockLinear) and isinstance(linear_layer.blocks, Int8Blocks):
                    blocks = linear_layer.blocks
                    cpp.set_int8_linear(which, blocks.u, blocks.dm, blocks.lo, blocks.rows, blocks.max_code, linear_layer.bias)
                    continue
                any_rows = False  # the kernels below take at most MAX_ROWS rows
                if isinstance(linear_layer, BlockLinear):
                    blocks = linear_layer.blocks
                    cpp.set_linear(which, blocks.q, blocks.scale_offset, blocks.zero, blocks.rows, None, linear_layer.bias)
                elif isinstance(linear_layer, PackedLinear) and linear_layer.skinny:
                    cpp.set_linear(which, None, None, 0, 0, linear_layer.weight.detach(), linear_layer.bias)
                else:
                    return False
            names = ["input_layernorm", "post_attention_layernorm"]
            if layer.sandwich:
                names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            qk = (attn.q_norm.weight.detach(), attn.k_norm.weight.detach()) if attn.q_norm is not None else (None, None)
            cpp.set_norms([getattr(layer, n).weight.detach() for n in names], *qk)
            built.append(cpp)
        self.decode_layers = built
        self.layers_take_any_rows = any_rows
        return True

    def forward(self, tokens: Tensor, positions: Tensor, cache, tables: Tensor,
                logit_index: Tensor | None = None, row_seqs: Tensor | None = None, static: bool = False) -> Tensor:
        """tokens, positions: [B, T]; tables: [B, blocks] each row's block table (covering its
        positions); logit_index: [B, L] rows of T to return logits for. Ragged rows (where
        layers_take_any_rows): tokens, positions [1, N], the sequences' tokens one after another,
        row_seqs [N] each token's row of tables [S, blocks].

        static: the forward of a compiled step (engine/models/compiled_step.py): keys over the tables'
        whole width, no host read, PyTorch ops only.

        Returns float32 logits [B, L, V] (L = T when logit_index is None).
        """
        m = self.model
        x = m.embed_tokens(tokens)
        if self.args.embed_scale != 1.0:
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        on = (self.cpu_kernels and self.kernels is not None and x.device.type == "cpu" and x.dtype == torch.float32
              and not static)
        kernels = self.kernels if on else None
        ctx = ForwardContext(self.args, cache, tables.contiguous(), positions.contiguous(), x.dtype, kernels, static)
        B, T = tokens.shape
        ctx.cpp_layers = on and (self.layers_take_any_rows or T <= SMALL_QUERY_ROWS and B * T <= MAX_ROWS)
        if row_seqs is not None:
            if not (ctx.cpp_layers and self.layers_take_any_rows):
                raise ValueError("ragged rows need every layer in C++ on the int8 kernel")
            ctx.row_seqs = row_seqs.contiguous()
        for layer in m.layers:
            x = layer(x, ctx)
        if logit_index is not None:
            if logit_index.shape[1] == 0:  # a prefill: only the cache was wanted
                return x.new_empty(B, 0, self.args.vocab_size, dtype=torch.float32)
            x = torch.gather(x, 1, logit_index[..., None].expand(-1, -1, x.shape[-1]))
        return self.lm_head(m.norm(x, kernels)).float()
