"""What kvlens supports of a loaded model, found out before any run: exact, or refused with one sentence.

`inspect_model` reads the config for what no attention call shows (cross-attention, latent KV
compression) and then runs one probe forward of two tokens through kvlens' attention function
with a fresh `KVCache`, recording what every layer asks for (`AttentionSpec`: scale, soft-cap,
sliding window). `read_call` refuses any argument it does not understand during that probe;
every layer must attend through the function exactly once with its own KV cache, and a layer
that `config.layer_types` calls sliding must pass its window. Nothing is keyed on model names:
two models that pass the same arguments are treated the same.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field

import torch

from kvlens.engine.attention import CONTEXT_KWARG, plain_forward
from kvlens.errors import KvlensError
from kvlens.kvcache import AttentionSpec
from kvlens.kvcache.cache import KVCache

PROBE_TOKENS = 2
ATTENTION_LAYER_TYPES = (
    "full_attention",
    "sliding_attention",
)  # `config.layer_types` entries kvlens computes


@dataclass
class Support:
    """A model as kvlens sees it. `refusal` is None when every layer is computed exactly."""

    model_class: str
    positions: str  # "rotary", "rotary on 25% of each head" or "no rotary embedding"
    scaling: list[float] = field(default_factory=list)  # per layer
    sliding: dict[int, int] = field(default_factory=dict)  # layer -> window
    softcap: dict[int, float] = field(default_factory=dict)  # layer -> cap
    refusal: str | None = None

    @property
    def verdict(self) -> str:
        return "exact" if self.refusal is None else "refused"

    def require(self) -> None:
        """Raise the refusal sentence, if any."""
        if self.refusal is not None:
            raise KvlensError(self.refusal)

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


class _Probe:
    """Stands in for a `RunContext` during the probe forward: records each layer's spec."""

    def __init__(self):
        self.specs: dict[int, list[AttentionSpec]] = {}

    def attend(self, layer_idx: int, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        self.specs.setdefault(layer_idx, []).append(spec)
        return plain_forward(query, key, value, spec)


def _positions(model: torch.nn.Module) -> str:
    if not any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules()):
        return "no rotary embedding"
    rope = getattr(model.config, "rope_parameters", None) or {}
    share = rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0
    return "rotary" if share >= 1.0 else f"rotary on {share:.0%} of each head"


def rotary_of(model: torch.nn.Module, support: Support):
    """`positions (n,) -> (cos, sin)` `(n, D)` of the model's one rotary embedding on every layer (what
    `Prompt.rotary` hands policies that reason about future queries), or None: no RoPE, partial RoPE, or
    several rotary embeddings (e.g. Gemma 3's local and global ones)."""
    rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if (
        support.positions != "rotary"
        or len(rotaries) != 1
        or "layer_type" in inspect.signature(rotaries[0].forward).parameters
    ):  # one module serving several layer types (Gemma 3) is several
        return None
    rope = rotaries[0]

    def cos_sin(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
        cos, sin = rope(probe, positions[None])
        return cos[0], sin[0]

    return cos_sin


def _config_refusal(config) -> str | None:
    """Features an attention call does not reveal, named by their generic config fields."""
    for i, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind not in ATTENTION_LAYER_TYPES:
            return (
                f"Layer {i} is a {kind.replace('_', ' ')} layer, which kvlens does not support (it computes "
                f"full and sliding-window softmax attention only)."
            )
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        return (
            "The model has cross-attention layers (encoder-decoder or add_cross_attention), which kvlens "
            "does not support."
        )
    if getattr(config, "kv_lora_rank", None):
        return (
            f"The model uses multi-latent attention (kv_lora_rank={config.kv_lora_rank}): its "
            "cache is a latent, "
            f"not per-head keys and values, which kvlens does not support."
        )
    return None


def _probe(model: torch.nn.Module, layers: int) -> tuple[dict[int, list[AttentionSpec]], KVCache]:
    """One forward of `PROBE_TOKENS` tokens: each layer's specs, and the cache the layers filled."""
    probe = _Probe()
    cache = KVCache(layers)
    dev = next(model.parameters()).device
    positions = torch.arange(PROBE_TOKENS, device=dev)
    with torch.inference_mode(), cache.feeding(positions):
        model(
            input_ids=torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=dev),
            position_ids=positions[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **{CONTEXT_KWARG: probe},
        )
    return probe.specs, cache


def _probe_refusal(config, layers: int, specs: dict[int, list[AttentionSpec]], cache: KVCache) -> str | None:
    """What the probe forward showed that kvlens cannot follow: the first such layer's sentence, or None."""
    missing = [i for i in range(layers) if i not in specs]
    if missing:
        return (
            f"Layer {missing[0]}'s attention never reaches kvlens with its run context (the layer bypasses "
            f"transformers' attention interface, drops its keyword arguments, or is not an attention layer), "
            f"so kvlens cannot run this model."
        )
    twice = [i for i, s in specs.items() if len(s) != 1]
    if twice:
        return (
            f"Layer {twice[0]} attends {len(specs[twice[0]])} times per token, which kvlens does not support."
        )
    shared = [i for i in range(layers) if cache.layers[i].n_slots != PROBE_TOKENS]
    if shared:
        return (
            f"Layer {shared[0]} does not keep its own keys and values in the KV cache (shared or "
            "no KV cache), "
            f"which kvlens does not support."
        )
    types = getattr(config, "layer_types", None) or []
    unwindowed = [
        i for i, kind in enumerate(types) if kind == "sliding_attention" and specs[i][0].window is None
    ]
    if unwindowed:
        return (
            f"Layer {unwindowed[0]} is a sliding-window layer that passes no window to its "
            "attention function "
            f"(only to its mask), so kvlens cannot apply it."
        )
    return None


def inspect_model(model: torch.nn.Module) -> Support:
    """Probe a model loaded with `attn_implementation="kvlens"` (eval mode) and say what kvlens supports of
    it."""
    layers = model.config.num_hidden_layers
    support = Support(model_class=type(model).__name__, positions=_positions(model))
    support.refusal = _config_refusal(model.config)
    if support.refusal is not None:
        return support
    try:
        specs, cache = _probe(model, layers)
    except KvlensError as err:
        support.refusal = str(err)
        return support
    except Exception as err:  # noqa: BLE001 - any failure of the probe is a refusal, said in one sentence
        support.refusal = (
            f"The model's forward fails with kvlens' KV cache ({type(err).__name__}: "
            f"{(str(err) or 'no message').splitlines()[0][:160]}), so kvlens cannot run it."
        )
        return support
    support.refusal = _probe_refusal(model.config, layers, specs, cache)
    if support.refusal is not None:
        return support
    for i in range(layers):
        spec = specs[i][0]
        support.scaling.append(spec.scaling)
        if spec.window is not None:
            support.sliding[i] = spec.window
        if spec.softcap is not None:
            support.softcap[i] = spec.softcap
    return support
