"""radreport-tiny in PyTorch: the reference for training and for ONNX parity.

The math here is the contract that `edgekit.export` reproduces in ONNX. Keep them in step: any change here needs
the same change there, and the parity tests say so when they drift.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgekit.export.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(position_ids, head_dim: int, theta: float):
    """cos/sin of shape (batch, seq, head_dim), HF LLaMA convention (frequencies repeated, not interleaved)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # (b, s, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        d = c.vision_hidden
        self.h, self.hd = c.vision_heads, c.vision_head_dim
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.h, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        y = att.softmax(-1) @ v
        return self.out_proj(y.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.vision_hidden, c.vision_mlp)
        self.fc2 = nn.Linear(c.vision_mlp, c.vision_hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # exact (erf) GELU


class VisionLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.vision_hidden, eps=c.vision_ln_eps)
        self.self_attn = VisionAttention(c)
        self.layer_norm2 = nn.LayerNorm(c.vision_hidden, eps=c.vision_ln_eps)
        self.mlp = VisionMLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(1, c.vision_hidden, kernel_size=c.patch_size, stride=c.patch_size)
        self.position_embedding = nn.Embedding(c.grid * c.grid, c.vision_hidden)

    def forward(self, x):  # x: (N, 1, H, W)
        y = self.patch_embedding(x).flatten(2).transpose(1, 2)  # (N, grid*grid, D), row-major patches
        return y + self.position_embedding.weight[None]


class VisionModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embeddings = VisionEmbeddings(c)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.vision_layers))
        self.post_layernorm = nn.LayerNorm(c.vision_hidden, eps=c.vision_ln_eps)

    def forward(self, x):
        x = self.embeddings(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Connector(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(2 * c.vision_hidden, c.hidden)
        self.fc2 = nn.Linear(c.hidden, c.hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        hd = c.head_dim
        self.q_proj = nn.Linear(c.hidden, c.heads * hd, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.heads * hd, c.hidden, bias=False)
        self.head_gate: torch.Tensor | None = None  # (heads,) training-only gates (head_gates.py), folded on save

    def forward(self, x, cos, sin, mask, past=None):
        c, (b, s, _) = self.c, x.shape
        hd = c.head_dim
        q = self.q_proj(x).view(b, s, c.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.kv_heads, hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        rep = c.heads // c.kv_heads
        kk = k.repeat_interleave(rep, dim=1)
        vv = v.repeat_interleave(rep, dim=1)
        att = (q @ kk.transpose(-1, -2)) / math.sqrt(hd) + mask
        y = att.softmax(-1) @ vv
        if self.head_gate is not None:
            y = y * self.head_gate[None, :, None, None]
        return self.o_proj(y.transpose(1, 2).reshape(b, s, c.heads * hd)), present


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, c.rms_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.rms_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask, past=None):
        a, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present


class Decoder(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.rms_eps)


def causal_mask(attention_mask, q_len: int):
    """Additive mask (b, 1, q, kv): a query at absolute position p sees keys <= p that the attention_mask keeps."""
    b, kv = attention_mask.shape
    past = kv - q_len
    qpos = torch.arange(q_len)[:, None] + past
    kpos = torch.arange(kv)[None, :]
    allowed = (kpos <= qpos)[None, None] & attention_mask[:, None, None, :].bool()
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


class RadReportTiny(nn.Module):
    """Vision encoder + connector + decoder. Parameter names are the safetensors/ONNX initializer names."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.vision_model = VisionModel(c)
        self.connector = Connector(c)
        self.model = Decoder(c)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)

    def encode_images(self, pixel_values):
        """pixel_values (b, t, 1, H, W), normalised to [-1, 1] -> image features (b, num_image_tokens, hidden)."""
        c = self.config
        b, t = pixel_values.shape[:2]
        x = self.vision_model(pixel_values.reshape(b * t, 1, c.image_size, c.image_size))
        x = x.view(b, t, c.grid * c.grid, c.vision_hidden)
        mean = x.mean(1)
        std = torch.sqrt(((x - mean[:, None]) ** 2).mean(1) + 1e-6)
        x = torch.cat([mean, std], dim=-1)  # (b, grid*grid, 2D)
        g, s = c.grid, c.pool_stride
        x = x.view(b, g // s, s, g // s, s, 2 * c.vision_hidden).mean(dim=(2, 4))
        return self.connector(x.reshape(b, (g // s) ** 2, 2 * c.vision_hidden))

    def decode(self, inputs_embeds, attention_mask, position_ids, past=None):
        """One decoder call serving prefill (past None or empty) and decode. Returns logits and the new cache."""
        c = self.config
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta)
        mask = causal_mask(attention_mask, inputs_embeds.shape[1])
        x, presents = inputs_embeds, []
        for i, layer in enumerate(self.model.layers):
            x, pres = layer(x, cos, sin, mask, None if past is None else past[i])
            presents.append(pres)
        return self.lm_head(self.model.norm(x)), presents

    def forward(self, pixel_values, input_ids, attention_mask=None):
        """Teacher-forced logits for training: image tokens first, then the text tokens."""
        img = self.encode_images(pixel_values)
        x = torch.cat([img, self.model.embed_tokens(input_ids)], dim=1)
        b, s = x.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(b, s, dtype=torch.long)
        else:
            attention_mask = torch.cat([torch.ones(b, img.shape[1], dtype=attention_mask.dtype), attention_mask], 1)
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits, _ = self.decode(x, attention_mask, pos)
        return logits[:, img.shape[1] :]
