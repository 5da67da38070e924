"""The baseline blocks every later chapter swaps pieces into: RMSNorm, rotary positions, softmax attention, SwiGLU."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    "x / rms(x) * weight, computed in fp32 so bf16 activations do not lose the normalisation."
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq_len: int, dim: int, theta: float = 10000.0, device=None, offset: int = 0):
    "cos/sin tables (seq_len, dim/2) for rotary embeddings, in fp32, starting at position `offset`."
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    pos = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    "Rotate pairs (x[..., :d/2], x[..., d/2:]) of x (B, H, T, d) by the position angles."
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, None], sin[None, None]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    "Multi-head softmax attention with RoPE through PyTorch SDPA (flash attention on GPU): the skeleton's mixer."
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.n_heads, self.head_dim, self.theta = cfg.n_heads, cfg.head_dim, cfg.rope_theta
        inner = cfg.n_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.d_model, bias=False)
        self.o_proj.is_residual_out = True

    def forward(self, x, cache=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = rope_tables(T, self.head_dim, self.theta, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    "Dense gated MLP: W_down(silu(W_gate x) * W_up x). Layers below `first_dense` use the d_ff_dense width."
    def __init__(self, cfg, layer: int, d_ff: int = None):
        super().__init__()
        d_ff = d_ff or (cfg.d_ff_dense if layer < cfg.first_dense else cfg.d_ff)
        self.gate_up = nn.Linear(cfg.d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, cfg.d_model, bias=False)
        self.down.is_residual_out = True

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
