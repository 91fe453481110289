"""A Qwen2/Llama-family decoder that reads a Hugging Face folder (config.json + *.safetensors) and
runs over a paged KV cache.

Invariants:
* parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so a
  checkpoint loads with ``load_state_dict`` and published weights are plain HF state dicts;
* ``forward`` computes exactly the HF forward for every token (checked to <= 1e-4 against
  transformers in tests); attention for a token sees its own sequence's cached keys only;
* a malformed folder (no config, missing or mis-shaped tensor) raises ModelLoadError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .kv import KVPool
from .spec import ModelLoadError, ModelSpec, read_spec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer, self.spec = layer, spec
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.attention_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kvh * d, bias=spec.attention_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kvh * d, bias=spec.attention_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv: KVPool):
        n = x.shape[0]
        h, kvh, d = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        q = self.q_proj(x).view(n, h, d)
        k = self.k_proj(x).view(n, kvh, d)
        v = self.v_proj(x).view(n, kvh, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        kv.write(self.layer, batch.write_slots, k, v)
        # padded batch attention: [B, H, q_max, D] against [B, KVH, ctx_max, D]
        qp = q.new_zeros(batch.size, batch.q_max, h, d)
        qp[batch.q_rows, batch.q_cols] = q
        kp, vp = kv.gather(self.layer, batch.ctx_slots)  # [B, ctx_max, KVH, D]
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=batch.mask, enable_gqa=True)
        out = out.transpose(1, 2)[batch.q_rows, batch.q_cols].reshape(n, h * d)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, batch, kv):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


@dataclass
class Batch:
    """One engine step's token layout. Sequence b contributes q_len[b] new tokens at the end of its
    context of ctx_len[b] tokens, whose KV lives in the blocks of ``tables[b]``."""

    size: int
    q_max: int
    positions: torch.Tensor   # [N] absolute position of each new token
    q_rows: torch.Tensor      # [N] sequence index of each new token
    q_cols: torch.Tensor      # [N] index of each new token among its sequence's new tokens
    write_slots: torch.Tensor  # [N] KV slot each new token's K/V is written to
    ctx_slots: torch.Tensor   # [B, ctx_max] KV slots of each whole context (padding masked)
    mask: torch.Tensor        # [B, 1, q_max, ctx_max] True = attend
    last_index: torch.Tensor  # [B] row in the flat token list of each sequence's last new token

    @classmethod
    def build(cls, q_lens: list[int], ctx_lens: list[int], tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> Batch:
        b = len(q_lens)
        q, c = torch.tensor(q_lens), torch.tensor(ctx_lens)
        q_max, ctx_max = max(q_lens), max(ctx_lens)
        nb = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.long)
        grid = (bt[:, :, None] * block_size + torch.arange(block_size)).view(b, nb * block_size)
        rows = torch.repeat_interleave(torch.arange(b), q)
        starts = torch.cumsum(q, 0) - q
        cols = torch.arange(int(q.sum())) - starts[rows]
        pos = (c - q)[rows] + cols
        k, j = torch.arange(ctx_max), torch.arange(q_max)
        # query j of sequence i sits at position c - q + j and sees keys 0 .. c - q + j
        mask = k[None, None, :] <= ((c - q)[:, None] + j[None, :])[:, :, None]
        mask[:, :, 0] |= j[None, :] >= q[:, None]  # padded query rows attend to key 0 (discarded)
        tensors = (pos, rows, cols, grid[rows, pos], grid[:, :ctx_max], mask[:, None], torch.cumsum(q, 0) - 1)
        return cls(b, q_max, *(t.to(device) for t in tensors))


class DecoderLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        d = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: Batch, kv: KVPool,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (fp32) at each sequence's last new token [B, vocab], or at the flat token rows ``rows``
        [len(rows), vocab] (a speculative decode's drafted tokens)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, kv)
        x = self.model.norm(x[batch.last_index if rows is None else rows])
        return self.lm_head(x).float()


def read_safetensors(folder: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({e})") from None
    return state


def check_state(model: DecoderLM, state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The subset of ``state`` the model needs, checked for presence and shape."""
    expected = model.state_dict()
    out = {}
    for name, t in expected.items():
        if name == "lm_head.weight" and model.spec.tie_word_embeddings:
            continue
        if name not in state:
            raise ModelLoadError(f"{where}: missing tensor {name}")
        if tuple(state[name].shape) != tuple(t.shape):
            raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(state[name].shape)}, "
                                 f"expected {tuple(t.shape)}")
        out[name] = state[name]
    return out


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DecoderLM:
    spec = read_spec(folder)
    model = DecoderLM(spec)
    state = check_state(model, read_safetensors(folder), str(folder))
    model.load_state_dict(state, strict=False)
    return model.to(dtype=dtype, device=device).eval()
