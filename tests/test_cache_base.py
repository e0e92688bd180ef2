"""The KV cache's transformers base, deferred (`kv_cache.TransformersBase`, issue #33 item 3): the engine and its
cache import no transformers, and once transformers is imported the caches answer its `Cache` API with its own
implementation (the forward-path tests in test_engine / test_hybrid / test_exactness run them through models)."""

from __future__ import annotations

import subprocess
import sys

import torch

PROBE = """
import sys
import sinkchat.core.engine, sinkchat.core.gauge
from sinkchat.core.kv_cache import SinkKVCache
c = SinkKVCache(2, 8, None)
assert not hasattr(c, "get_seq_length") and not hasattr(c.layers[0], "supports_early_init")
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""


def test_the_engine_and_its_cache_import_no_transformers():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_a_sink_cache_is_transformers_cache_api():
    from transformers.cache_utils import Cache, CacheLayerMixin

    from sinkchat.core.kv_cache import SinkKVCache

    c = SinkKVCache(2, 8, None)
    assert all(isinstance(layer, CacheLayerMixin) for layer in c.layers)
    assert c.get_seq_length() == 0 and c.is_initialized is False and len(c) == 2 and c.is_sliding == [False, False]
    k = torch.randn(1, 2, 3, 4)  # [B, H_kv, q, D]
    keys, values = c.update(k, k + 1, 1)  # transformers' Cache.update -> the layer's own update
    assert torch.equal(keys, k) and torch.equal(values, k + 1)
    assert c.get_seq_length(1) == 3 and c.get_mask_sizes(2, 1) == Cache.get_mask_sizes(c, 2, 1) == (5, 0)
    assert c.get_query_offset(1) == 3 and c.is_compileable is False and c.layers[1].supports_early_init
    try:
        c.no_such_attribute
    except AttributeError as e:
        assert "no_such_attribute" in str(e)
    else:
        raise AssertionError("an unknown attribute must raise AttributeError")


def test_a_hybrid_cache_is_a_transformers_cache():
    """transformers' masks take the first full-attention layer's sizes only from an `isinstance(cache, Cache)`."""
    from transformers.cache_utils import Cache
    from transformers.masking_utils import find_first_full_attention_index

    from sinkchat.core.hybrid_cache import HybridKVCache, WindowLayer, _transformers_hybrid

    c = _transformers_hybrid()(["sliding", "full", "sliding"], 16, [None, None, None], 4)
    assert isinstance(c, Cache) and isinstance(c, HybridKVCache) and isinstance(c.layers[0], WindowLayer)
    assert find_first_full_attention_index(c) == 1 and c.is_sliding == [True, False, True]
