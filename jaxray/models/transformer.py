"""The learning path's byte-level decoder (lab 7) in Flax NNX: token plus learned position embeddings
(no gather or scatter in a training step), ``num_layers`` pre-norm blocks (``causal_attention``; GELU
feed-forward of 4 x D), a final LayerNorm and a bias-free LM head. Params are float32; ``dtype`` is the
compute dtype; logits come back float32. Training's forward may rematerialise each block (``remat``),
scan the blocks (``scan_layers``) and, given a key, drop out where nanoGPT does (``model.dropout``);
the params stay one module per layer."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxray.config import ModelConfig
from jaxray.models.attention import SPLASH_MULTIPLE
from jaxray.models.axes import constrain
from jaxray.models.kv_cache import (
    KVCache,
    cached_attention,
    decode_rows,
    span_attention,
    write_cache,
    write_span,
)
from jaxray.models.splash import splash_attention

# Query rows per block of the XLA causal attention, by platform (lab-7's step, T 256): 64 cut it most
# on a CPU; on a TPU v5e 128 (float32 5.33 ms against 6.80 with 64 and 5.93 dense, 2026-12-07).
ATTENTION_BLOCKS = {"tpu": 128}
ATTENTION_BLOCK = 64


def attention_block() -> int:
    """The blocked attention's query rows per block on this process's default backend."""
    return ATTENTION_BLOCKS.get(jax.default_backend(), ATTENTION_BLOCK)


# jax.checkpoint policies of ``model.remat`` (None: no remat).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def dropout(x: jax.Array, key: jax.Array | None, rate: float) -> jax.Array:
    """Inverted dropout: each element of ``x`` zeroed with probability ``round(256 rate) / 256`` (one
    random byte an element: a quarter of ``bernoulli``'s random bits, the step's largest cost on a
    TPU), the rest scaled by 1 / (1 - that), in ``x``'s dtype; ``x`` itself for ``key`` None or
    ``rate`` 0 (evaluation)."""
    if key is None or not rate:
        return x
    dropped = round(rate * 256)
    keep = jax.random.bits(key, x.shape, jnp.uint8) >= dropped
    return jnp.where(keep, x * jnp.asarray(256 / (256 - dropped), x.dtype), jnp.zeros((), x.dtype))


def causal_attention(query, key, value, implementation=None, dropout_key=None, dropout_rate=0.0, **_):
    """q, k, v [B, T, H, K] -> [B, T, H, K]; causal. ``implementation``: "cudnn", "dense" (XLA's
    ``dot_product_attention``), "splash" (``jaxray.models.splash``; dense where T is not a multiple of
    128, e.g. a prompt bucket), else ``blocked_causal_attention``. With ``dropout_key`` the attention
    weights are dropped at ``dropout_rate`` by ``blocked_causal_attention`` (one block for "cudnn" and
    "dense", whose kernels take no key); splash's kernel keeps its weights (the residual and
    embedding dropout still apply). Mask/dropout arguments from ``nnx.MultiHeadAttention`` are ignored."""
    dropping = dropout_key is not None and dropout_rate > 0
    if implementation == "splash" and query.shape[1] % SPLASH_MULTIPLE == 0:
        return splash_attention(query, key, value)
    if dropping:
        block = None if implementation in (None, "xla") else query.shape[1]  # None: attention_block()
        return blocked_causal_attention(query, key, value, block, dropout_key, dropout_rate)
    if implementation in ("cudnn", "dense", "splash"):
        how = "cudnn" if implementation == "cudnn" else "xla"
        return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation=how)
    return blocked_causal_attention(query, key, value)


def blocked_causal_attention(
    query, key, value, block: int | None = None, dropout_key=None, dropout_rate: float = 0.0
):
    """Exact causal softmax attention, q, k, v [B, T, H, K] -> [B, T, H, K], skipping the masked upper
    triangle: query rows [i*block, (i+1)*block) attend to keys [0, (i+1)*block) only; equals
    ``jax.nn.dot_product_attention(is_causal=True)`` up to rounding. Scores and softmax are float32.
    ``block`` None: ``attention_block()``. ``dropout_key``: the weights of block i dropped at
    ``dropout_rate`` (key folded with i)."""
    t, k_dim, block = query.shape[1], query.shape[-1], block or attention_block()
    query = query * jnp.asarray(1.0 / math.sqrt(k_dim), query.dtype)
    outputs = []
    for i, start in enumerate(range(0, t, block)):
        stop = min(start + block, t)
        scores = jnp.einsum(
            "bqhk,bshk->bhqs", query[:, start:stop], key[:, :stop], preferred_element_type=jnp.float32
        )  # [B, H, rows, stop]
        visible = jnp.arange(start, stop)[:, None] >= jnp.arange(stop)[None, :]
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
        if dropout_key is not None:
            probs = dropout(probs, jax.random.fold_in(dropout_key, i), dropout_rate)
        outputs.append(jnp.einsum("bhqs,bshk->bqhk", probs, value[:, :stop]))
    return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=1)


def embed_tokens(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int32 -> [B, T, D] in ``embed.dtype`` through a one-hot matmul, not a gather:
    a gather's gradient is a scatter-add that serialises in bf16 on NVIDIA GPUs (openxla/xla#26371,
    openxla/xla#46225). ``HIGHEST`` precision keeps the float32 lookup exact (no TF32 rounding)."""
    table = embed.embedding[...].astype(embed.dtype)  # [V, D]
    one_hot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)  # [B, T, V]
    return jnp.dot(one_hot, table, precision=jax.lax.Precision.HIGHEST)


def embed_positions(embed: nnx.Embed, length: int) -> jax.Array:
    """Positions 0..length-1 -> [length, D] in ``embed.dtype``: a slice of the table, whose gradient
    is a pad, not the scatter a gather of ``arange(length)`` would give."""
    return embed.embedding[...][:length].astype(embed.dtype)


GPT2_STD = 0.02  # GPT-2's (Radford et al. 2019) and nanoGPT's model.py initializer scale


def initializers(cfg: ModelConfig) -> dict | None:
    """``model.init``'s initializers: None for Flax's defaults; for ``gpt2`` {"kernel": normal(0.02)
    for weights and embeddings, "out": normal(0.02 / sqrt(2 L)) for each residual branch's output
    projection} (nanoGPT's ``_init_weights`` and its ``c_proj`` scaling). Biases stay zero."""
    if cfg.init == "flax":
        return None
    out_std = GPT2_STD / math.sqrt(2 * cfg.num_layers)
    return {"kernel": nnx.initializers.normal(GPT2_STD), "out": nnx.initializers.normal(out_std)}


class Block(nnx.Module):
    """Pre-norm block: x + attn(ln(x)), then x + ffn(ln(x)). x [B, T, D]. Projections are called one
    by one so the full forward and the KV-cache decode share them."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        ffn_dim: int,
        dtype,
        attention_fn,
        rngs: nnx.Rngs,
        rate: float = 0,
        inits: dict | None = None,
    ):
        """``inits``: ``{"kernel", "out"}`` initializers (``initializers``; None: Flax's defaults)."""
        kernel = {} if inits is None else {"kernel_init": inits["kernel"]}
        out = {} if inits is None else {"kernel_init": inits["out"]}
        dense = functools.partial(nnx.Linear, dtype=dtype, rngs=rngs)
        self.dropout_rate = rate
        self.ln1 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=d_model,
            decode=False,
            dtype=dtype,
            attention_fn=attention_fn,
            keep_rngs=False,
            rngs=rngs,
            **kernel,
            **({} if inits is None else {"out_kernel_init": inits["out"]}),
        )
        self.ln2 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.fc_up = dense(d_model, ffn_dim, **kernel)
        self.fc_down = dense(ffn_dim, d_model, **out)

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        return self.forward(x, rng)[0]

    def forward(self, x: jax.Array, rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Causal self-attention over all T positions: x [B, T, D] -> (x, kv [B, H, T, 2K], ``KVCache``'s
        layer). ``rng``: a key for training's dropout (attention weights, both residual branches)."""
        query, key, value = self._qkv(x)
        rngs = (None,) * 3 if rng is None else tuple(jax.random.split(rng, 3))
        with jax.named_scope("attention"):  # names the profile (jaxray.bench.profile) groups by
            attended = self.attn.attention_fn(
                query, key, value, dropout_key=rngs[0], dropout_rate=self.dropout_rate
            )
        x = self._finish(x, attended, rngs[1:])
        return x, jnp.concatenate([key, value], axis=-1).transpose(0, 2, 1, 3)

    def decode_step(self, x, positions: jax.Array, kv, length: int | None = None):
        """One new position per row: x [B, R, D] at ``positions`` [B] (row 0 the token's; R > 1:
        ``decode_rows``' zero rows); kv [B, H, S, 2K] this layer's cache; attention reads its first
        ``length`` entries (static; None: all S), so every position must be below it. Returns
        (x [B, R, D], kv with this step's entries written)."""
        query, key, value = self._qkv(x)
        kv = write_cache(kv, positions, jnp.concatenate([key[:, 0], value[:, 0]], axis=-1))
        return self._finish(x, cached_attention(query, kv[:, :, :length], positions)), kv

    def extend(self, x: jax.Array, starts: jax.Array, kv: jax.Array):
        """T new positions per row: x [B, T, D] at ``starts`` [B] + 0..T-1; kv [B, H, S, 2K] this
        layer's cache. Returns (x [B, T, D], kv with the span's entries written)."""
        query, key, value = self._qkv(x)
        kv = write_span(kv, starts, jnp.concatenate([key, value], axis=-1))
        return self._finish(x, span_attention(query, kv, starts)), kv

    def _qkv(self, x):
        with jax.named_scope("norm"):
            h = self.ln1(x)
        heads = (self.attn.query(h), self.attn.key(h), self.attn.value(h))  # each [B, T, H, K]
        return tuple(constrain(t, "batch", None, "heads", None) for t in heads)

    def _finish(self, x, attended, rngs=(None, None)):
        """Both residual branches, each dropped out with its key of ``rngs`` (None: not)."""
        x = constrain(x + dropout(self.attn.out(attended), rngs[0], self.dropout_rate), "batch", None, None)
        with jax.named_scope("norm"):
            normed = self.ln2(x)
        hidden = constrain(jax.nn.gelu(self.fc_up(normed)), "batch", None, "mlp")  # [B, T, F]
        return constrain(x + dropout(self.fc_down(hidden), rngs[1], self.dropout_rate), "batch", None, None)


class Transformer(nnx.Module):
    """tokens [B, T] int32 (T <= max_seq_len) -> logits [B, T, V] float32 for ``cfg`` (a ModelConfig;
    ``attention``: an implementation, ``AttentionChoice``'s); ``prefill``, ``decode_step`` and
    ``extend`` run it with a KV cache."""

    def __init__(self, cfg: ModelConfig, attention: str | None = None, *, rngs: nnx.Rngs):
        dtype, d_model = jnp.dtype(cfg.dtype), cfg.width
        attention_fn = functools.partial(causal_attention, implementation=attention)
        self.max_seq_len = cfg.max_seq_len
        self.remat, self.scan_layers, self.dropout_rate = cfg.remat, cfg.scan_layers, cfg.dropout
        inits = initializers(cfg)
        embed = functools.partial(nnx.Embed, dtype=dtype, rngs=rngs)
        embed = embed if inits is None else functools.partial(embed, embedding_init=inits["kernel"])
        self.token_embed = embed(cfg.vocab_size, d_model)
        self.pos_embed = embed(cfg.max_seq_len, d_model)
        self.blocks = nnx.List(
            [
                Block(d_model, cfg.num_heads, cfg.ffn_dim, dtype, attention_fn, rngs, cfg.dropout, inits)
                for _ in range(cfg.num_layers)
            ]
        )
        self.final_norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        # Tied: the logits are the final features times the token embedding's transpose.
        kernel = {} if inits is None else {"kernel_init": inits["kernel"]}
        head = nnx.Linear(d_model, cfg.vocab_size, use_bias=False, dtype=dtype, rngs=rngs, **kernel)
        self.lm_head = None if cfg.tie_embeddings else head

    def __call__(self, tokens: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """Training's forward (remat, scan_layers); ``dropout_key``: training's dropout masks (None:
        none, as in evaluation and every inference path)."""
        if dropout_key is None or not self.dropout_rate:
            return self._logits(self._layers(self._embed(tokens)))
        embed_key, layers_key = jax.random.split(dropout_key)
        x = dropout(self._embed(tokens), embed_key, self.dropout_rate)
        return self._logits(self._layers(x, jax.random.split(layers_key, len(self.blocks))))

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> [B, T, D], no gather (``embed_tokens``)."""
        with jax.named_scope("embed"):
            x = embed_tokens(self.token_embed, tokens) + embed_positions(self.pos_embed, tokens.shape[1])
        return constrain(x, "batch", None, None)

    def _layers(self, x: jax.Array, keys: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] through every block: a Python loop, or one ``lax.scan`` over the blocks' params
        stacked on a leading layer axis (one copy of them per step; the body compiles once).
        ``keys``: [L] dropout keys, one a block (None: no dropout)."""
        policy = REMAT_POLICIES[self.remat]
        keys = [None] * len(self.blocks) if keys is None else keys
        if policy is None and not self.scan_layers:
            for block, key in zip(self.blocks, keys):
                x = block(x, key)
            return x
        parts = [nnx.split(block) for block in self.blocks]  # the blocks share one graphdef
        graphdef, states = parts[0][0], [state for _, state in parts]

        def run(state, x, key):
            return nnx.merge(graphdef, state)(x, key)

        if policy is not None:
            run = jax.checkpoint(run, policy=policy, prevent_cse=not self.scan_layers)
        if self.scan_layers:
            stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *states)
            if keys[0] is None:
                return jax.lax.scan(lambda x, state: (run(state, x, None), None), x, stacked)[0]
            return jax.lax.scan(lambda x, sk: (run(sk[0], x, sk[1]), None), x, (stacked, keys))[0]
        for state, key in zip(states, keys):
            x = run(state, x, key)
        return x

    def prefill(self, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
        """tokens [B, T] int32 -> (logits [B, T, V] float32, cache): per layer kv [B, H, T, 2K] in the
        compute dtype (``KVCache``)."""
        x, cache = self._embed(tokens), []
        for block in self.blocks:
            x, kv = block.forward(x)
            cache.append(kv)
        return self._logits(x), tuple(cache)

    def decode_step(
        self, tokens: jax.Array, positions: jax.Array, cache: KVCache, length: int | None = None
    ) -> tuple[jax.Array, KVCache]:
        """One token per row: tokens [B] int32 at ``positions`` [B] int32 (< S, and < ``length``);
        ``cache`` per layer kv [B, H, S, 2K] with S = max_seq_len, of which attention reads the first
        ``length`` entries (static; None: all). Returns (logits [B, V] float32, cache with this step's
        entries written). Inference only: its gathers have no gradient to scatter."""
        x = self.token_embed(tokens[:, None]) + self.pos_embed(positions[:, None])  # [B, 1, D]
        rows = decode_rows(tokens.shape[0], jax.default_backend())
        x = jnp.pad(x, ((0, 0), (0, rows - 1), (0, 0)))  # [B, R, D]
        step = functools.partial(Block.decode_step, length=length)
        logits, cache = self._through_cache(x, cache, step, positions)
        return logits[:, 0], cache

    def extend(self, tokens: jax.Array, starts: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """T tokens per row after a cached prefix: tokens [B, T] int32 at positions ``starts`` [B]
        int32 + 0..T-1 (``starts[b] + T <= S``); ``cache`` as ``decode_step``'s, holding row b's
        entries 0..starts[b]-1. Returns (logits [B, T, V] float32, cache with the span written)."""
        positions = starts[:, None] + jnp.arange(tokens.shape[1])[None, :]  # [B, T]
        x = self.token_embed(tokens) + self.pos_embed(positions)  # [B, T, D]
        return self._through_cache(x, cache, Block.extend, starts)

    def _through_cache(self, x, cache: KVCache, step, where) -> tuple[jax.Array, KVCache]:
        """x through every block's ``step(block, x, where, kv)`` -> (logits, new cache)."""
        new_cache = []
        for block, kv in zip(self.blocks, cache):
            x, kv = step(block, x, where, kv)
            new_cache.append(kv)
        return self._logits(x), tuple(new_cache)

    def _logits(self, x):
        features = self.final_norm(x)
        if self.lm_head is None:
            return self.token_embed.attend(features).astype(jnp.float32)
        return self.lm_head(features).astype(jnp.float32)
