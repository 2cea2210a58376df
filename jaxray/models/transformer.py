"""The learning path's byte-level decoder (lab 7) in Flax NNX.

Token plus learned position embeddings, ``num_layers`` pre-norm blocks (causal multi-head attention
through ``jax.nn.dot_product_attention``, GELU feed-forward of 4 x D), a final LayerNorm and a
bias-free LM head. Params are float32; ``dtype`` is the compute dtype; logits come back float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def causal_attention(query, key, value, implementation=None, **_):
    """q, k, v [B, T, H, K] -> [B, T, H, K]; causal; XLA or cuDNN per ``implementation`` (None: JAX picks).

    ``nnx.MultiHeadAttention`` passes mask/dropout arguments this model does not use; they are ignored.
    """
    return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation=implementation)


class Block(nnx.Module):
    """Pre-norm block: x + attn(ln(x)), then x + ffn(ln(x)). x [B, T, D]."""

    def __init__(self, d_model: int, num_heads: int, ffn_dim: int, dtype, attention_fn, rngs: nnx.Rngs):
        dense = functools.partial(nnx.Linear, dtype=dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=num_heads, in_features=d_model, decode=False, dtype=dtype,
                                           attention_fn=attention_fn, keep_rngs=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.fc_up = dense(d_model, ffn_dim)
        self.fc_down = dense(ffn_dim, d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_down(jax.nn.gelu(self.fc_up(self.ln2(x))))


class Transformer(nnx.Module):
    """tokens [B, T] int32 (T <= max_seq_len) -> logits [B, T, V] float32."""

    def __init__(self, vocab_size: int, d_model: int, num_heads: int, num_layers: int, ffn_dim: int,
                 max_seq_len: int, dtype=jnp.float32, attention: str | None = None, *, rngs: nnx.Rngs):
        attention_fn = functools.partial(causal_attention, implementation=attention)
        self.max_seq_len = max_seq_len
        self.token_embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(max_seq_len, d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, num_heads, ffn_dim, dtype, attention_fn, rngs)
                                for _ in range(num_layers)])
        self.final_norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.lm_head = nnx.Linear(d_model, vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        _, t = tokens.shape
        x = self.token_embed(tokens) + self.pos_embed(jnp.arange(t))  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)
