"""One prompt to explain (a task sample with a policy and ratio, or a recorded run's prompt), and its two
caches.

A sample is the task protocol's (`kvlens.experiments.bench.tasks`): its context is compressed once, its
(first) question is appended, and what is scored is the full cache's own greedy answer. A run's prompt is
compressed once by the run's policy at the run's budget (its step-0 compression); what is scored is the run's
text when it was teacher-forced, else the full cache's own greedy continuation of the same length.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from kvlens.engine.batch_answer import Kept, answer_many
from kvlens.engine.models import LoadedModel
from kvlens.engine.shared_prefill import QUIET, SharedPrefill, prepare, slots_for, split_prompt
from kvlens.errors import KvlensError
from kvlens.experiments.bench import ruler, tasks
from kvlens.experiments.bench.common import PolicySpec
from kvlens.explain.patch import Pair, compare
from kvlens.policies import make_policy, resolve_budget
from kvlens.runs.run import load_run


@dataclass
class Case:
    """What to explain: `context` ids (compressed), `question` ids (fed after it, uncompressed), the policy
    and its budget (slots per KV head; None for a policy that keeps what its own rule keeps: CORM, kvzap's
    threshold mode), the sample (tasks) or the tokens to score (`text`: a run's)."""

    model: LoadedModel
    context: list[int]
    question: list[int]
    policy: PolicySpec
    budget: int | None
    about: dict  # JSON-able: where the case comes from
    sample: ruler.Sample | None = None
    needles: list[tuple[int, int]] = field(default_factory=list)  # the needle's token spans in the context
    text: list[int] | None = None
    max_new_tokens: int = 64


def file_sample(path: str, index: int) -> ruler.Sample:
    """Sample `index` of a samples file (`kvlens bench tasks --dump-samples`)."""
    samples = ruler.read_samples(path)
    if not 0 <= index < len(samples):
        raise KvlensError(
            f"Sample index {index} is out of range: {path} has {len(samples)} samples (0 to "
            f"{len(samples) - 1})."
        )
    return samples[index]


def sample_case(
    model: LoadedModel,
    sample: ruler.Sample,
    policy: str,
    ratio: float | None,
    chat: bool = True,
    about: dict | None = None,
    rounding: str = "kvpress",
) -> Case:
    """A task sample under `policy` at compression ratio `ratio` (its kept count rounded as `rounding`,
    `slots_for`; None, and ignored, for a budget-free policy); `about`: where the sample comes from."""
    spec = PolicySpec.parse(policy)
    made = make_policy(spec.name, dict(spec.params))
    if made.budget_free:
        ratio = None
    elif ratio is None:
        raise KvlensError(
            f"Policy {spec.label} compresses to a budget; give its compression ratio (--ratio)."
        )
    elif not 0 < ratio < 1:
        raise KvlensError(f"A compression ratio is the share of the context removed, in (0, 1); got {ratio}.")
    context, question = split_prompt(model, sample.context, sample.questions[0], chat)
    slots = None if ratio is None else slots_for(ratio, len(context), rounding)
    budget = resolve_budget(made, slots, len(context), len(context) + len(question) + sample.max_new_tokens)
    needles = tasks.context_token_spans(model, sample.context, ruler.needle_spans(sample), chat)
    about = {"source": "sample", **(about or {}), "task": sample.task, "policy": spec.label, "ratio": ratio}
    return Case(model, context, question, spec, budget, about, sample, needles, None, sample.max_new_tokens)


def run_case(model: LoadedModel, directory: str) -> Case:
    """A recorded run's prompt under its policy and budget (the run must have its decision log)."""
    run = load_run(directory)
    if run.decisions.empty:
        raise KvlensError(
            f"The run at {directory} has no decisions (recorded without a decision log, or its policy "
            "removed nothing); explain needs them."
        )
    meta = run.meta
    budget = meta.budget.slots
    tokens = list(meta.tokens)
    if len(tokens) < 2:
        raise KvlensError(
            f"The run at {directory} has fewer than 2 tokens after its prompt; nothing to score."
        )
    spec = PolicySpec(meta.policy.name, tuple(sorted(meta.policy.params.items())))
    about = {
        "source": "run",
        "run": str(directory),
        "policy": spec.name,
        "budget": budget,
        "mode": meta.mode,
    }
    return Case(
        model,
        list(meta.prompt_tokens),
        [],
        spec,
        budget,
        about,
        text=tokens if meta.mode == "teacher" else None,
        max_new_tokens=len(tokens),
    )


def answered(case: Case):
    """`done(row, tokens)` for `answer_many`: the tokens hold every expected string of the sample's
    question."""
    decode, expected = case.model.tokenizer.decode, case.sample.answers[0]
    return lambda _row, tokens: ruler.score(decode(tokens, skip_special_tokens=True), expected) == 1


@dataclass
class Built:
    """A case's two caches (`pair`), the tokens fed after the context (`ids`, question then answer), how many
    of them are scored (`scored`: the answer's) and, for a sample whose full answer is right, how many answer
    tokens must be reproduced for the answer to be right (`right_upto`)."""

    case: Case
    pair: Pair
    ids: list[int]
    scored: int
    right_upto: int | None
    answers: dict
    seconds: float

    @property
    def start(self) -> int:
        return len(self.case.context)


def build(case: Case, shared: SharedPrefill | None = None) -> Built:
    """Prefill the context once (or take `shared`, a prefill of it for the case's policy among others),
    compress it, and find the full cache's answer (or take the run's text). The full cache is the prompt's as
    the policy's own prefill computed it (`SharedPrefill.prompt_cache`), so the two caches differ by the
    policy's decisions only."""
    t = time.perf_counter()
    model, context = case.model, case.context
    policy = make_policy(case.policy.name, dict(case.policy.params))
    extra = len(case.question) + case.max_new_tokens
    shared = shared or SharedPrefill(model, context, [policy])
    layers, logits = shared.prompt_cache(policy)
    comp, _ = prepare(
        model, policy, context, case.budget, extra, shared, dataclasses.replace(QUIET, log_decisions=True)
    )
    frame = comp.log.frame()
    frame = frame[(frame["action"] == "merge") & (frame["step"] == 0)]
    merges = list(
        zip(
            frame["layer"].tolist(),
            frame["kv_head"].tolist(),
            frame["position"].tolist(),
            [list(t) for t in frame["targets"]],
            strict=True,
        )
    )
    pair = compare(Kept.of(model, layers), Kept(comp), merges)
    decode = model.tokenizer.decode
    if case.sample is None:
        target = case.text or answer_many([pair.full], [], len(context), case.max_new_tokens, [logits])[0][0]
        if len(target) < 2:
            raise KvlensError("The full cache's continuation is one token; nothing to score after it.")
        return Built(
            case, pair, target, len(target) - 1, None, {"full": decode(target)}, time.perf_counter() - t
        )
    found = answered(case)

    (full_answer, _), (comp_answer, _) = answer_many(
        [pair.full, pair.compressed], case.question, len(context), case.max_new_tokens, done=found
    )
    right_upto = next((k for k in range(1, len(full_answer) + 1) if found(0, full_answer[:k])), None)
    answers = {
        "expected": list(case.sample.answers[0]),
        "full": decode(full_answer, skip_special_tokens=True),
        "compressed": decode(comp_answer, skip_special_tokens=True),
        "full_right": right_upto is not None,
        "compressed_right": found(0, comp_answer),
    }
    return Built(
        case,
        pair,
        case.question + full_answer,
        len(full_answer),
        right_upto,
        answers,
        time.perf_counter() - t,
    )
