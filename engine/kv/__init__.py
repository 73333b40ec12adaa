"""Paged KV cache bookkeeping on the scheduler side: block pool (block_pool.py) and the per-model
cache manager (cache_manager.py). The tensors themselves live on the workers (engine/kv_cache.py)."""
