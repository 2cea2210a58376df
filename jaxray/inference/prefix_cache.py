"""Automatic prefix caching (as vLLM's): the KV entries of prompt prefixes kept in blocks and reused.

A prompt window is cut into blocks of ``block`` tokens; block j's key is the SHA-256 chain of blocks
0..j, so it stands for the whole prefix. ``PrefixCache`` maps keys to slots of a fixed device pool
(``kv_decode.store_blocks``/``start_cached``), evicting the least recently used. Positions count from
the window's start, so a prefix's entries are the same in every prompt holding it."""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from jaxray.config import ModelConfig
from jaxray.inference.settings import EngineSettings


class PrefixCache:
    """Keys of cached blocks -> pool slots, least recently used first. Counts (as vLLM's
    ``prefix_cache_queries``/``_hits``) the prompt tokens looked up (``queries``), those reused
    (``hits``) and the requests that reused some (``hit_requests``). Only the engine's thread writes."""

    def __init__(self, slots: int, block: int):
        if slots < 1 or block < 1:
            raise ValueError(f"a prefix cache needs at least one slot and block size, got {slots}, {block}")
        self.block, self.slots = block, slots
        self._slot: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(slots - 1, -1, -1))
        self.queries = self.hits = self.hit_requests = 0

    def keys(self, tokens: np.ndarray) -> list[bytes]:
        """The key of each whole block of ``tokens`` [n] int32 (n // block keys)."""
        keys, digest = [], b""
        for j in range(len(tokens) // self.block):
            block = np.ascontiguousarray(tokens[j * self.block : (j + 1) * self.block], np.int32)
            digest = hashlib.sha256(digest + block.tobytes()).digest()
            keys.append(digest)
        return keys

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The slots of the longest cached run of ``keys`` from the first, marked as just used."""
        found = []
        for key in keys:
            if key not in self._slot:
                break
            found.append(self._slot[key])
        for key in reversed(keys[: len(found)]):  # the first block most recent: evicted last
            self._slot.move_to_end(key)
        return found

    def count(self, prompt_tokens: int, hit_blocks: int) -> None:
        """Record one request of ``prompt_tokens`` that reused ``hit_blocks`` blocks (0: none)."""
        self.queries += prompt_tokens
        self.hits += hit_blocks * self.block
        self.hit_requests += hit_blocks > 0

    def count_prompt(self, tokens: np.ndarray) -> int:
        """The tokens of the prompt window ``tokens`` [n] int32 cached now (whole blocks, at least one
        left to compute), its lookup counted."""
        hit = min(len(self.lookup(self.keys(tokens))), (len(tokens) - 1) // self.block)
        self.count(len(tokens), hit)
        return hit * self.block

    def claim(self, keys: list[bytes], taken: set[bytes]) -> list[tuple[int, int]]:
        """[(block index, slot)] for the blocks of ``keys`` not cached yet, evicting the least recently
        used keys but never one of ``taken`` (this batch's; updated); stops when every slot is taken."""
        claimed = []
        for j, key in enumerate(keys):
            if key in self._slot:
                continue
            if not self._free:
                oldest = next((k for k in self._slot if k not in taken), None)
                if oldest is None:
                    break
                self._free.append(self._slot.pop(oldest))
            self._slot[key] = slot = self._free.pop()
            taken.add(key)
            claimed.append((j, slot))
        return claimed

    def info(self) -> dict:
        """JSON-able figures: pool blocks, tokens per block, blocks in use, the counts."""
        return {
            "blocks": self.slots,
            "block_tokens": self.block,
            "blocks_used": len(self._slot),
            "query_tokens": self.queries,
            "hit_tokens": self.hits,
            "hit_requests": self.hit_requests,
        }


def check_prefix_block(settings: EngineSettings, max_seq_len: int) -> None:
    """ValueError naming prefix_block when the prefix cache is asked for (``prefix_cache_mib`` > 0, or
    ``prefill_chunk``, which needs it) and a block is not below max_seq_len."""
    if (settings.prefix_cache_mib or settings.prefill_chunk) and settings.prefix_block >= max_seq_len:
        raise ValueError(f"prefix_block must be below max_seq_len {max_seq_len}, got {settings.prefix_block}")


AUTO_SHARE = 0.10  # of an accelerator's free memory, the default prefix cache (vLLM's is on by default)
AUTO_CPU_MIB = 64  # the default on a CPU: 0.44x-0.28x the TTFT of random prompts (docs/benchmarks.md)


def auto_mib(device: jax.Device) -> int:
    """The default ``prefix_cache_mib`` on ``device``: ``AUTO_SHARE`` of its free memory from
    ``memory_stats`` (accelerators), else ``AUTO_CPU_MIB`` or 1/16 of the host's free memory if less."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return max(1, int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * AUTO_SHARE) >> 20)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # no such sysconf name here
        return AUTO_CPU_MIB
    return max(1, min(AUTO_CPU_MIB, free // 16 >> 20))


def block_shape(config: ModelConfig, block: int) -> tuple[int, int, int, int]:
    """(L, H, Bk, 2K): the KV entries of one prefix block of ``block`` tokens (``KVCache``'s layout)."""
    return (config.num_layers, config.num_heads, block, 2 * config.head_dim)


def new_pool(
    config: ModelConfig, settings: EngineSettings, mib: int, dtype: str
) -> tuple[PrefixCache, jax.Array]:
    """(PrefixCache, its pool [slots, F] of zeros in ``dtype``, the KV cache's; F the entries of
    ``block_shape``, flat) in ``mib`` MiB. ValueError naming the setting when a block is too long,
    none fits or the device lacks room."""
    block = settings.prefix_block
    check_prefix_block(settings.model_copy(update={"prefix_cache_mib": mib}), config.max_seq_len)
    entries = math.prod(block_shape(config, block))
    slots = mib * 2**20 // (entries * jnp.dtype(dtype).itemsize)
    if slots < 1:
        raise ValueError(f"prefix_cache_mib {mib} holds no block of {block} tokens of this model")
    try:
        return PrefixCache(slots, block), jnp.zeros((slots, entries), dtype)
    except Exception as err:  # jaxlib's allocation error: no public class to name
        raise ValueError(
            f"prefix_cache_mib {mib}: its pool does not fit on {jax.devices()[0]}: {err}"
        ) from None


def fit_hits(
    chains: list[int], lengths: np.ndarray, buckets: tuple[int, ...], block: int, size: int
) -> tuple[list[int], int]:
    """(blocks each prompt reuses, the bucket its rest is prefilled in): up to its cached run of
    ``chains`` blocks, leaving at least one of its ``lengths`` tokens to prefill (its logits sample the
    first new token) and room for the bucket within ``size`` (``write_span``)."""
    hits = [min(chain, (int(n) - 1) // block) for chain, n in zip(chains, lengths)]
    while True:
        rest = max(int(n) - hit * block for n, hit in zip(lengths, hits))
        bucket = next(b for b in buckets if b >= rest)
        fitted = [min(hit, (size - bucket) // block) for hit in hits]
        if fitted == hits:
            return hits, bucket
        hits = fitted


def plan_prefill(
    cache: PrefixCache, tokens: np.ndarray, lengths: np.ndarray, counted: list[bool], buckets: tuple[int, ...]
) -> tuple[list[list[bytes]], int, tuple[np.ndarray, ...] | None]:
    """For prompt windows ``tokens`` [B, S] int32, ``lengths`` [B] (the first ``len(counted)`` rows
    real): (each row's block keys, the bucket to prefill in, ``start_cached``'s (table [B, nb], hits
    [B], rest [B, bucket], rest lengths [B]), or None when no row reuses a block). Counts the
    lookups ``counted`` says."""
    size, requests = tokens.shape[1], len(counted)
    nb = size // cache.block
    keys = [cache.keys(tokens[i, : lengths[i]])[:nb] for i in range(requests)]
    chains = [cache.lookup(k) for k in keys]
    hits, bucket = fit_hits([len(c) for c in chains], lengths[:requests], buckets, cache.block, size)
    for hit, n, count in zip(hits, lengths, counted):
        if count:
            cache.count(int(n), hit)
    if not any(hits):
        return keys, bucket, None
    table, starts = np.zeros((len(tokens), nb), np.int32), np.zeros(len(tokens), np.int32)
    rest = np.zeros((len(tokens), bucket), np.int32)
    for i, (chain, hit) in enumerate(zip(chains, hits)):
        table[i, :hit], starts[i] = chain[:hit], hit
        rest[i, : lengths[i] - hit * cache.block] = tokens[i, hit * cache.block : lengths[i]]
    return keys, bucket, (table, starts, rest, lengths - starts * cache.block)


def store_plan(
    cache: PrefixCache, keys: list[list[bytes]], rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``store_blocks``'s (rows, blocks, slots) [``rows``] int32 for the blocks of ``keys`` (per batch
    row) not cached yet, padded with slot ``cache.slots`` (written nowhere); None if there are none."""
    taken: set[bytes] = set()
    claimed = [(i, j, slot) for i, row in enumerate(keys) for j, slot in cache.claim(row, taken)]
    if not claimed:
        return None
    plan = np.zeros((3, rows), np.int32)
    plan[2] = cache.slots
    plan[:, : len(claimed)] = np.asarray(claimed[:rows], np.int32).T
    return plan[0], plan[1], plan[2]
