"""The learning path's byte-level decoder (lab 7) in Flax NNX.

Token plus learned position embeddings, ``num_layers`` pre-norm blocks (causal multi-head attention:
block-skipping XLA attention or cuDNN's, GELU feed-forward of 4 x D), a final LayerNorm and a
bias-free LM head. Params are float32; ``dtype`` is the compute dtype; logits come back float32.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx


# Query rows per block of the XLA causal attention: 64 cut the lab's step time most on CPU (T = 256).
ATTENTION_BLOCK = 64


def causal_attention(query, key, value, implementation=None, **_):
    """q, k, v [B, T, H, K] -> [B, T, H, K]; causal; cuDNN when ``implementation == "cudnn"``, else
    ``blocked_causal_attention`` (XLA).

    ``nnx.MultiHeadAttention`` passes mask/dropout arguments this model does not use; they are ignored.
    """
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation="cudnn")
    return blocked_causal_attention(query, key, value)


def blocked_causal_attention(query, key, value, block: int = ATTENTION_BLOCK):
    """Exact causal softmax attention that skips the masked upper triangle block by block.

    q, k, v: [B, T, H, K] -> [B, T, H, K]. Query rows [i*block, (i+1)*block) attend to keys
    [0, (i+1)*block) only: the keys after a block's last row are masked for every row of the block,
    so their scores are never computed. Each row's softmax still spans all of its visible keys
    (not an online softmax), so the result equals ``jax.nn.dot_product_attention(is_causal=True)``
    up to float rounding while doing about (n + 1) / 2n of its score and value work for n blocks.
    Scores and softmax are float32 whatever the input dtype, as in JAX's XLA implementation.
    """
    t, k_dim = query.shape[1], query.shape[-1]
    query = query * jnp.asarray(1.0 / math.sqrt(k_dim), query.dtype)
    outputs = []
    for start in range(0, t, block):
        stop = min(start + block, t)
        scores = jnp.einsum("bqhk,bshk->bhqs", query[:, start:stop], key[:, :stop],
                            preferred_element_type=jnp.float32)  # [B, H, rows, stop]
        visible = jnp.arange(start, stop)[:, None] >= jnp.arange(stop)[None, :]
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
        outputs.append(jnp.einsum("bhqs,bshk->bqhk", probs, value[:, :stop]))
    return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=1)


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
