"""The KV cache a policy is handed, and its storage: the contract below both the engine and the policies.

`cache` holds the contract (`CacheRows`, `Step`, `Prompt`, `Replay`) and the slot store behind it;
`quantize`, `channels` and `lowrank` the compressed storage a sealed cache may use.
"""

from kvlens.kvcache.cache import CacheRows, Phase, Prompt, Replay, Slots, Step

__all__ = ["CacheRows", "Phase", "Prompt", "Replay", "Slots", "Step"]
