"""The KV cache a policy is handed, and its storage: the layer below both the engine and the policies.

`contract` holds what a policy is written against (`CacheRows`, `Step`, `Prompt`, `Replay`) and `scores` the
attention math it shares with the engine; `store` (`SlotStore`), `views` (`SlotRows`, the rows a policy is
handed), `tokens` (appending) and `cache` (`KVCache`, the model's `past_key_values`) the cache itself;
`paged` (`PagedStore`) the pages of a layer whose heads keep different counts; `quantized` (`PackedStore`)
the compressed storage a sealed cache may use, each kind a `packed.PackedStates`: `quantize` and `kivi`
(KIVI), `lowrank` and `rank` (low rank), `channels` (pruned key channels). Policies import only from this
package's top.
"""

from kvlens.kvcache.contract import HIDDEN, LOSSY, O_GRAM, SCORER, CacheRows, Phase, Prompt, Replay, Step
from kvlens.kvcache.scores import AttentionSpec, group_mean, layer_logits, softmax_weights
from kvlens.kvcache.store import padded_index, padded_slots, without

__all__ = [
    "HIDDEN",
    "LOSSY",
    "O_GRAM",
    "SCORER",
    "AttentionSpec",
    "CacheRows",
    "Phase",
    "Prompt",
    "Replay",
    "Step",
    "group_mean",
    "padded_index",
    "padded_slots",
    "layer_logits",
    "softmax_weights",
    "without",
]
