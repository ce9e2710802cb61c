"""Output perturbation of a compressed cache (analysis mode, `--measure`).

CaM (Zhang et al., ICML 2024) Fig. 1(d) and Eq. 4-5. The `PerturbationMeter` observer keeps a
shadow of the uncompressed K/V history of the same run. At each decode step and layer, with the
step's own query `q` `(Hq, D)`:
- `O_full` = attention over the shadow (every position so far),
- `O_used` = the run's own output over its compressed (possibly merged) cache,
- `O_evict` = attention over the original keys and values of the positions the cache still holds
  (same decisions, no merging),
- `O_stored` = the same with those keys and values as the run's storage holds them: with quantized storage
  (`kvlens.kvcache.quantize`) `O_used` itself for a policy that never merges, else the original keys and
  values quantized and dequantized in the cache's current layout; `O_evict` without quantization, and it
  stores per (step, layer, query head) `||O_used - O_full|| / ||O_full||`, the same for `O_evict`, and the
  attention loss `1 - sum_{kept j} A_full[j]`. End to end, `kl_per_step` gives KL(p_full || p_policy) of the
  next-token distributions, p_full from one full-cache forward over the same tokens (teacher forced).

So `evict` is the error of the choice of positions, `stored - evict` what quantized storage adds to it, and
`used - stored` what merging adds. Tensor names saved in a run: `perturbation/used`, `perturbation/evict`,
`perturbation/stored`,
`perturbation/attention_loss`, `perturbation/full_norm` (`||O_full||`) `(steps - 1, L, Hq)` float32
(row k = the decode forward that fed token k and produced the logits of token k + 1), and
`perturbation/kl` `(steps,)` (entry 0 is the prefill's logits, identical for every policy, so 0).

Summaries (`summary`): a mean of per-cell relative errors overweights the cells whose `||O_full||`
is small, so the medians and the pooled ratios `sum ||O - O_full|| / sum ||O_full||` come with the
means; `merge_better_share` counts the cells where the merged output is closer to `O_full` than
the evicted one by more than 1e-4 relative (`merge_worse_share` the opposite, ties are neither), and
`merge_sign_per_layer` says per layer whether merging lowered (+1), raised (-1) or kept (0) the
pooled perturbation. `kl` averages entries 1.. only (entry 0 is the same for every policy).
Two baselines: `perturbation_evict` is the same run's counterfactual (same decisions, original
values); `base_baseline` measures a separate run of a merging policy's base eviction policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvlens.engine.attention import attention_probs, decode_rows, visible
from kvlens.engine.context import Observer
from kvlens.engine.loop import StepEvent
from kvlens.engine.models import LoadedModel
from kvlens.kvcache import AttentionSpec
from kvlens.kvcache.quantized import PackedStore
from kvlens.runs.run import Run


class PerturbationMeter(Observer):
    """Shadow full cache + per-step relative output errors of the compressed cache."""

    needs_rows = True

    def __init__(self):
        self.shadow_k: dict[
            int, torch.Tensor
        ] = {}  # layer -> (Hkv, capacity, D), the first `seen` slots held
        self.shadow_v: dict[int, torch.Tensor] = {}
        self.seen: dict[int, int] = {}  # layer -> positions in its shadow
        self.used: dict[int, list[torch.Tensor]] = {}  # layer -> [(Hq,)] per step
        self.evict: dict[int, list[torch.Tensor]] = {}
        self.stored: dict[int, list[torch.Tensor]] = {}
        self.loss: dict[int, list[torch.Tensor]] = {}
        self.full_norm: dict[int, list[torch.Tensor]] = {}
        self.merges = True  # the run's policy may change kept slots (`on_start`)

    def on_start(self, policy) -> None:
        self.merges = policy.merge_rule is not None

    def on_prefill(self, layer, query, key, value, last_rows) -> None:
        i = layer.layer
        self.shadow_k[i], self.shadow_v[i] = (_room_for(x[0].detach(), SHADOW_ROOM) for x in (key, value))
        self.seen[i] = key.shape[2]

    def _shadow(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `i`'s shadow with the step's key and value `(Hkv, 1, D)` written after its positions (in
        place, the buffers doubled when full): its keys and values `(Hkv, T, D)`, slot index = position."""
        t = self.seen[i]
        if t == self.shadow_k[i].shape[1]:
            self.shadow_k[i], self.shadow_v[i] = (_room_for(x[i], t) for x in (self.shadow_k, self.shadow_v))
        self.shadow_k[i][:, t : t + 1] = key
        self.shadow_v[i][:, t : t + 1] = value
        self.seen[i] = t + 1
        return self.shadow_k[i][:, : t + 1], self.shadow_v[i][:, : t + 1]

    def on_decode(self, layer, query, probs, out, spec: AttentionSpec) -> None:
        i = layer.layer
        # the token just fed is in the slots the cache wrote last (compression runs after the forward)
        book = layer.books[0]
        if book.fresh is not None:  # quantized storage: the token as fed, not as stored
            key, value = book.fresh
        else:
            new = layer.written[..., None].expand(-1, -1, layer.keys.shape[-1])  # (Hkv, 1, D)
            key, value = torch.gather(layer.keys[0], 1, new), torch.gather(layer.values[0], 1, new)
        k_full, v_full = self._shadow(i, key, value)  # (Hkv, T, D)
        hkv, t, d = k_full.shape
        hq = query.shape[1]
        o_used = out[0, 0].view(hkv, hq // hkv, d).float()
        store = layer.store
        packed = isinstance(store, PackedStore)
        if not packed and not self.merges and int(layer.valid.sum()) == hkv * t:
            # every position held as written (the full cache, or a budget not reached yet): O_full, O_evict
            # and O_stored are the run's own output, and no attention is lost
            self._record(i, *[torch.zeros(hq)] * 4, o_used.norm(dim=-1).flatten().cpu())
            return
        q = query[0, :, 0].view(hkv, hq // hkv, 1, d).float()  # (Hkv, G, 1, D)
        now = torch.tensor([t - 1], device=k_full.device)
        seen = visible(now, torch.arange(t, device=k_full.device), spec.window)  # (1, T): the layer's window
        a_full = attention_probs(q, k_full.float(), spec, seen)[:, :, 0]  # (Hkv, G, T)
        o_full = torch.einsum("hgt,htd->hgd", a_full, v_full.float())
        pos = layer.pos.clamp(min=0, max=t - 1)  # (Hkv, S); free slots and padding masked below
        if packed or self.merges:
            idx = pos[..., None].expand(-1, -1, d)
            k_kept, v_kept = torch.gather(k_full, 1, idx), torch.gather(v_full, 1, idx)  # (Hkv, S, D)
            kept_seen = layer.valid & visible(now, layer.pos, spec.window)[:, 0]  # (Hkv, S)
            # the run's own kernel over the same slots: where nothing was merged, O_evict is O_used exactly
            o_evict = (
                decode_rows(query, k_kept[None], v_kept[None], kept_seen, spec)[0][0, 0]
                .view(hkv, -1, d)
                .float()
            )
        else:  # nothing merged, keys and values as written: O_evict is the run's own output
            o_evict = o_used
        o_stored = o_evict
        if packed and not self.merges:  # nothing merged: the run's own output
            o_stored = o_used
        elif packed:
            pieces = store.packed  # keys and values, or keys only (channel-pruned)
            k_q, v_q = (
                pieces[name].roundtrip(layer.rows, kept, layer.valid) if name in pieces else kept
                for name, kept in (("keys", k_kept), ("values", v_kept))
            )
            o_stored = (
                decode_rows(query, k_q[None], v_q[None], kept_seen, spec)[0][0, 0].view(hkv, -1, d).float()
            )
        full_norm = o_full.norm(dim=-1)
        norm = full_norm.clamp(min=1e-30)
        kept = torch.zeros(hkv, t + 1, device=pos.device).scatter_(1, pos.masked_fill(~layer.valid, t), 1.0)[
            :, :t
        ]
        self._record(
            i,
            *(((o - o_full).norm(dim=-1) / norm).flatten().cpu() for o in (o_used, o_evict, o_stored)),
            (1 - (a_full * kept[:, None, :]).sum(-1)).flatten().cpu(),
            full_norm.flatten().cpu(),
        )

    def _record(self, layer: int, used, evict, stored, loss, full_norm) -> None:
        """One step's values `(Hq,)` of one layer."""
        for d, value in zip(
            (self.used, self.evict, self.stored, self.loss, self.full_norm),
            (used, evict, stored, loss, full_norm),
            strict=True,
        ):
            d.setdefault(layer, []).append(value)

    def latest(self) -> dict:
        """The last decode step's perturbation, mean over layers and heads (empty before the first step)."""
        if not self.used:
            return {}
        return {
            name: float(torch.stack([rows[-1] for rows in d.values()]).mean())
            for name, d in (
                ("perturbation_used", self.used),
                ("perturbation_evict", self.evict),
                ("perturbation_stored", self.stored),
            )
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """`perturbation/used|evict|attention_loss|full_norm` `(steps - 1, L, Hq)`; empty if no decode step
        ran."""
        layers = sorted(self.used)

        def stack(d):
            return torch.stack([torch.stack(d[i]) for i in layers], dim=1) if layers else torch.zeros(0, 0, 0)

        return {
            "perturbation/used": stack(self.used),
            "perturbation/evict": stack(self.evict),
            "perturbation/stored": stack(self.stored),
            "perturbation/attention_loss": stack(self.loss),
            "perturbation/full_norm": stack(self.full_norm),
        }


SHADOW_ROOM = 64  # decode steps the shadow has room for after the prompt before its buffers double


def _room_for(x: torch.Tensor, more: int) -> torch.Tensor:
    """`x` `(Hkv, T, D)` at the start of a new buffer `(Hkv, T + more, D)`."""
    out = x.new_empty(x.shape[0], x.shape[1] + more, x.shape[2])
    out[:, : x.shape[1]] = x
    return out


def full_logprobs(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Log-probabilities `(len(ids), V)` of one uncompressed forward over `ids` (the full-cache reference)."""
    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([ids], device=model.device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def kl_per_step(full: torch.Tensor, policy_logits: list[torch.Tensor]) -> torch.Tensor:
    """KL(p_full || p_policy) `(steps,)` from reference log-probs `(steps, V)` and the policy's logits."""
    logp = torch.log_softmax(torch.stack([lg.float().cpu() for lg in policy_logits]), dim=-1)
    return (full.exp() * (full - logp)).sum(-1).clamp(min=0)


def measured(model: LoadedModel, go: Callable, observers=(), on_step=None) -> Run:
    """Run `go(observers, on_step) -> Run` with a `PerturbationMeter` and add the perturbation to it.

    Adds the tensors above and the metrics of `summary`.
    """
    meter = PerturbationMeter()
    logits: list[torch.Tensor] = []

    def collect(event: StepEvent):
        logits.append(event.logits.detach())
        if event.step > 0:
            event.extra.update(meter.latest())  # for live plots
        if on_step is not None:
            on_step(event)

    run = go([*observers, meter], collect)
    ids = run.meta.prompt_tokens + run.meta.tokens
    n = len(run.meta.tokens)
    full = full_logprobs(model, ids[:-1])[len(ids) - 1 - n :]  # (n, V): predicts each produced token
    kl = kl_per_step(full, logits[:n])
    run.tensors.update(meter.tensors())
    run.tensors["perturbation/kl"] = kl
    run.meta.metrics.update(summary(run.tensors))
    return run


TIE = 1e-4  # relative: O_used (the model's attention) and O_evict (recomputed here) differ by float noise


def summary(tensors: dict[str, torch.Tensor]) -> dict:
    """Perturbation metrics of a run's `perturbation/*` tensors (None where no decode step ran).

    `perturbation_used|evict`: means over (step, layer, head) cells of the relative errors; `_median`
    their medians; `_pooled` `sum ||O - O_full|| / sum ||O_full||`; `_per_layer` the means per layer;
    `merge_better_share` / `merge_worse_share`: shares of cells where the run's own output is closer to /
    farther from `O_full` than the counterfactual eviction's by more than `TIE` (relative; float noise
    alone moves an eviction-only run's cells both ways); `merge_sign_per_layer`: per layer, +1 if the
    pooled `used` is below the pooled `evict`, -1 above, 0 within `TIE`; `attention_loss`;
    `kl`: mean KL over steps 1.. (`kl_steps` of them; step 0 is the prefill's logits, shared).
    With quantized storage the merge shares and signs compare `used` with `stored` (same storage, no merging),
    `perturbation_stored*` are reported as `evict`'s are, and `perturbation_sources` splits the pooled error:
    `selection` (pooled evict), `storage` (pooled stored - evict), `merging` (pooled used - stored).
    """
    used, evict, loss = (tensors[f"perturbation/{k}"] for k in ("used", "evict", "attention_loss"))
    stored = tensors.get("perturbation/stored")
    quantized = stored is not None and stored.shape == evict.shape and not torch.equal(stored, evict)
    versus = stored if quantized else evict  # merging's counterfactual: the same choice, stored the same way
    norm = tensors.get("perturbation/full_norm")
    kl = tensors["perturbation/kl"][1:]
    some = bool(used.numel())

    def mean(t):
        return float(t.mean()) if t.numel() else None

    def pooled(t):
        return float(_pooled(t, norm)) if some and norm is not None else None

    def median(t):
        return float(t.median()) if some else None

    def per_layer(t):
        return t.mean(dim=(0, 2)).tolist() if t.numel() else []

    out = {
        "perturbation_used": mean(used),
        "perturbation_evict": mean(evict),
        "perturbation_used_median": median(used),
        "perturbation_evict_median": median(evict),
        "perturbation_used_pooled": pooled(used),
        "perturbation_evict_pooled": pooled(evict),
        "merge_better_share": mean((used < versus - TIE * versus).float()),
        "merge_worse_share": mean((used > versus + TIE * versus).float()),
        "merge_sign_per_layer": [],
        "attention_loss": mean(loss),
        "kl": mean(kl),
        "kl_steps": int(kl.numel()),
        "perturbation_used_per_layer": per_layer(used),
        "perturbation_evict_per_layer": per_layer(evict),
    }
    if some and norm is not None:
        gain = _pooled(versus, norm, (0, 2)) - _pooled(used, norm, (0, 2))
        out["merge_sign_per_layer"] = (
            torch.where(gain.abs() <= TIE * _pooled(versus, norm, (0, 2)), 0, torch.sign(gain)).int().tolist()
        )
    if quantized:
        out.update(
            {
                "perturbation_stored": mean(stored),
                "perturbation_stored_median": median(stored),
                "perturbation_stored_pooled": pooled(stored),
                "perturbation_stored_per_layer": per_layer(stored),
            }
        )
        if some and norm is not None:
            out["perturbation_sources"] = sources(tensors)
    return out


def sources(tensors: dict[str, torch.Tensor]) -> dict | None:
    """The pooled output error of the cache used split by source: `selection` (pooled evict: the choice of
    positions), `storage` (pooled stored - evict: what quantized or low-rank storage adds) and `merging`
    (pooled used - stored); None where no decode step ran or the tensors are missing."""
    names = ("evict", "stored", "used", "full_norm")
    if not all(f"perturbation/{k}" in tensors for k in names) or not tensors["perturbation/used"].numel():
        return None
    *parts, norm = (tensors[f"perturbation/{k}"] for k in names)
    e, q, u = (float(_pooled(t, norm)) for t in parts)
    return {"selection": e, "storage": q - e, "merging": u - q}


def _pooled(t: torch.Tensor, norm: torch.Tensor, dims=None) -> torch.Tensor:
    """`sum ||O - O_full|| / sum ||O_full||` of relative errors `t` weighted by `norm` (over `dims`, or
    all)."""
    return (t * norm).sum(dims) / norm.sum(dims).clamp(min=1e-30)


def baseline_policy(policy) -> tuple[str, dict] | None:
    """`(name, params)` of a merging policy's base eviction policy (CaM's `base`), None if it has none."""
    from kvlens.policies import Policy

    nested = [
        v for v in (getattr(policy, f.name) for f in dataclasses.fields(policy)) if isinstance(v, Policy)
    ]
    return (
        (nested[0].name, nested[0].params()) if policy.merge_rule is not None and len(nested) == 1 else None
    )


BASELINE_KEYS = ("ppl", "perturbation_used", "perturbation_used_median", "perturbation_used_pooled", "kl")


def base_baseline(policy, run_base: Callable[[str, dict], Run]) -> dict:
    """The second baseline: `base_*` metrics of a separate measured run of the base eviction policy.

    `run_base(name, params)` runs it measured, on the same text, budget and settings; `{}` for a
    policy with no base."""
    base = baseline_policy(policy)
    if base is None:
        return {}
    m = run_base(*base).metrics
    return {"base_policy": base[0], **{f"base_{k}": m[k] for k in BASELINE_KEYS}}
