"""In-process speculative decoding: chain drafting verified by the target, greedy or sampled.

Owns the target side (a transformers causal LM with a `DynamicCache` that is
cropped after every rejection, so a generation costs one forward per verify
step, not a re-run of the prefix), verification, and the accounting the
report needs: acceptance length, acceptance per draft position, tokens/s.
Proposers (what to draft) live in `proposers.py`; prompt sets in `prompts.py`.

Verification at temperature 0 commits the target's argmax; at temperature T > 0
it is SGLang's default rule for a chain draft (`tree_speculative_sampling_target_only`,
sgl-kernel `speculative_sampling.cuh`, used by `eagle_utils.eagle_sample` in 0.5.23
unless `--speculative-use-rejection-sampling`): the target's probabilities are
`softmax(logits / T)`; the draft is treated as one-hot, so draft j is accepted when
its coin u_j <= q_j(x_j) / threshold_acc or q_j(x_j) >= threshold_single (both 1.0
by default: accept with probability q(x)); at the first rejection the next token
is sampled from relu(q - p), i.e. q with the rejected token removed and
renormalised; after a fully accepted chain, from q of the last position. That
rule is lossless (the output is distributed as plain sampling from the target);
thresholds below 1 are not, and are there to measure what SGLang's relaxed
acceptance would report.

Counting follows SGLang: a verify step feeds the last committed token plus up
to `num_steps` drafts (`num_draft_tokens = num_steps + 1` with topk 1), commits
the accepted drafts plus the target's own next token (the bonus), and
acceptance length = tokens committed by verify steps / verify steps. SGLang's
per-request `completion_tokens / spec_verify_ct` also counts the one token the
prefill produces, so it reads at most `1 / spec_verify_ct` higher.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers.cache_utils import DynamicCache

from eagle3_dagster.bench.report import LengthBands, attach_speedups, band_entry, make_row
from eagle3_dagster.progress import ProgressMeter

# Timed rounds per method: enough for a median and a spread on a shared CPU (one back-to-back pair of
# single runs was seen to flip the ranking).
DEFAULT_ROUNDS = 3


@dataclass(frozen=True)
class SpecConfig:
    """SGLang's (num_steps, topk, num_draft_tokens); only chains (topk 1) are simulated."""

    num_steps: int
    topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"spec config {self.label}: num_steps must be >= 1")
        if self.topk != 1:
            raise ValueError(f"spec config {self.label}: the in-process engine drafts chains only (topk 1)")
        if self.num_draft_tokens not in (None, self.num_steps + 1):
            # SGLang forces num_draft_tokens = num_steps + 1 when topk == 1; say so instead of silently differing.
            raise ValueError(f"spec config {self.label}: with topk 1 num_draft_tokens must be num_steps + 1")

    @property
    def label(self) -> str:
        return f"{self.num_steps},{self.topk},{self.num_draft_tokens or self.num_steps + 1}"

    @classmethod
    def parse(cls, value: Sequence[int] | str) -> "SpecConfig":
        parts = [int(p) for p in value.split(",")] if isinstance(value, str) else [int(p) for p in value]
        return cls(*parts)


class Proposer(Protocol):
    """Drafts up to k tokens continuing `tokens` (every committed token: prompt + generated so far).

    `new_aux_1T3H` holds the target's aux hidden states (the `aux_layers`, concatenated) for the
    positions verified since the previous call, i.e. positions `len(tokens)-1-T .. len(tokens)-2`;
    it is None when `aux_layers` is empty.
    """

    name: str
    aux_layers: tuple[int, ...]

    def reset(self) -> None: ...

    def propose(self, tokens: Sequence[int], new_aux_1T3H: torch.Tensor | None, k: int) -> list[int]: ...


class TargetRunner:
    """The target with a KV cache that can be rolled back: the verifier of every method."""

    def __init__(self, model: torch.nn.Module, aux_layers: Sequence[int] = ()) -> None:
        self.model = model.eval()
        self.aux_layers = tuple(aux_layers)
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)  # type: ignore[arg-type]  # a transformers model: its PreTrainedConfig

    def __len__(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: Sequence[int]) -> tuple[list[int], torch.Tensor | None]:
        """Append `ids` to the cache; the target's greedy next token after each, and their aux states."""
        logits_TV, aux = self.forward_logits(ids)
        return logits_TV.argmax(-1).tolist(), aux

    @torch.inference_mode()
    def forward_logits(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `ids` to the cache; the target's next-token logits after each [T, V] (float32), and aux states."""
        if self.cache is None:
            self.reset()
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids, cache=self.cache, use_cache=True, output_hidden_states=bool(self.aux_layers)
        )
        aux = None
        if self.aux_layers:
            # Canonical numbering: hidden_states[i] is the state entering layer i (eagle3_dagster/layers.py).
            aux = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1).float()
        return out.logits[0].float(), aux

    def crop(self, length: int) -> None:
        """Forget every cached position from `length` on (rejected drafts)."""
        # transformers 5 takes a negative count of tokens to drop; a positive value is an error there.
        excess = len(self) - length
        if excess > 0 and self.cache is not None:
            self.cache.crop(-excess)


@dataclass
class Generation:
    """One prompt's generation under one method."""

    prompt_tokens: int
    output_ids: list[int]
    wall_s: float
    verify_ct: int = 0
    verify_tokens: int = 0  # tokens committed by verify steps (accepted drafts + bonus)
    accepted_by_position: list[int] = field(default_factory=list)  # verify steps whose draft k was accepted
    proposed_by_position: list[int] = field(default_factory=list)  # verify steps that proposed draft k
    draft_s: float = 0.0  # time spent in the proposer
    num_drafted: int = 0  # tokens it proposed


def sampling_probs(logits_TV: torch.Tensor, temperature: float) -> torch.Tensor:
    """SGLang's `sampling_softmax`: softmax(logits / T) in float32 (no top-k / top-p: their defaults)."""
    if temperature <= 0:
        raise ValueError(f"sampling needs a temperature > 0, got {temperature}")
    return torch.softmax(logits_TV.float() / temperature, dim=-1)


def sample_from(weights_V: torch.Tensor, coin: float) -> int:
    """Inverse-CDF draw from unnormalised non-negative weights with a coin in [0, 1), as flashinfer samples:
    the first id whose running sum exceeds coin * total; the last id of positive weight if rounding runs past."""
    total = weights_V.sum()
    cdf = torch.cumsum(weights_V, 0)
    hit = torch.nonzero(cdf > coin * total)
    if len(hit):
        return int(hit[0])
    positive = torch.nonzero(weights_V > 0)
    return int(positive[-1]) if len(positive) else len(weights_V) - 1


VerifyRule = Callable[[torch.Tensor, Sequence[int], torch.Tensor, float], tuple[int, int]]


def verify_target_only(
    probs_KV: torch.Tensor,
    drafts: Sequence[int],
    coins_K: torch.Tensor,
    final_coin: float,
    *,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> tuple[int, int]:
    """SGLang's chain verification at T > 0: (drafts accepted, the token committed after them).

    `probs_KV[j]` is the target's distribution after the last committed token (j = 0) and after
    draft j-1; `coins_K[j]` is draft j's acceptance coin, `final_coin` the one for the last draw.
    """
    threshold_acc = max(threshold_acc, 1e-9)  # the kernel's launcher caps it the same way
    for j, x in enumerate(drafts):
        q = float(probs_KV[j, x])
        if float(coins_K[j]) <= q / threshold_acc or q >= threshold_single:
            continue
        residual = probs_KV[j].clone()
        residual[x] = 0.0  # relu(q - p) with the one-hot draft's p[x] = q[x]
        return j, sample_from(residual, final_coin)
    return len(drafts), sample_from(probs_KV[len(drafts)], final_coin)


def _cut_at_eos(tokens: list[int], eos_ids: Collection[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens, False


def generate_greedy(
    target: TargetRunner, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Collection[int] = ()
) -> Generation:
    """The reference: plain greedy decoding, one cached forward per token."""
    start = time.perf_counter()
    target.reset()
    greedy, _ = target.forward(prompt_ids)
    out = [greedy[-1]]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        greedy, _ = target.forward(out[-1:])
        out.append(greedy[-1])
    return Generation(prompt_tokens=len(prompt_ids), output_ids=out, wall_s=time.perf_counter() - start)


def generate_sampled(
    target: TargetRunner,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    *,
    temperature: float,
    generator: torch.Generator,
) -> Generation:
    """The reference at T > 0: plain sampling from softmax(logits / T), one cached forward per token."""
    start = time.perf_counter()
    target.reset()
    logits, _ = target.forward_logits(prompt_ids)
    out: list[int] = []
    while True:
        coin = float(torch.rand((), generator=generator))
        out.append(sample_from(sampling_probs(logits[-1:], temperature)[0], coin))
        if len(out) >= max_new_tokens or out[-1] in eos_ids:
            break
        logits, _ = target.forward_logits(out[-1:])
    return Generation(prompt_tokens=len(prompt_ids), output_ids=out, wall_s=time.perf_counter() - start)


def generate_speculative(
    target: TargetRunner,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    spec: SpecConfig,
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    verify: VerifyRule = verify_target_only,
) -> Generation:
    """Speculative decoding. Greedy (T = 0): the output is the target's own greedy output, token for token.
    Sampled (T > 0): `verify` decides each step with coins from `generator` (SGLang's lossless rule by
    default; tests pass lossy ones to show that the losslessness check can fail)."""
    sampled = temperature > 0
    if sampled and generator is None:
        raise ValueError("speculative sampling needs a torch.Generator for its coins")
    if tuple(proposer.aux_layers) != target.aux_layers and proposer.aux_layers:
        raise ValueError(
            f"proposer {proposer.name} needs aux layers {proposer.aux_layers}, target runner captures "
            f"{target.aux_layers}"
        )
    k_max = spec.num_steps
    start = time.perf_counter()
    target.reset()
    proposer.reset()
    tokens = list(prompt_ids)
    if sampled:
        logits, aux = target.forward_logits(tokens)
        coin = float(torch.rand((), generator=generator))
        tokens.append(sample_from(sampling_probs(logits[-1:], temperature)[0], coin))
    else:
        greedy, aux = target.forward(tokens)
        tokens.append(greedy[-1])
    gen = Generation(
        prompt_tokens=len(prompt_ids),
        output_ids=[],
        wall_s=0.0,
        accepted_by_position=[0] * k_max,
        proposed_by_position=[0] * k_max,
    )
    finished = tokens[-1] in eos_ids
    while not finished and len(tokens) - len(prompt_ids) < max_new_tokens:
        remaining = max_new_tokens - (len(tokens) - len(prompt_ids))
        # Never draft past max_new_tokens: a verify step commits at most drafts + 1 tokens.
        k = min(k_max, remaining - 1)
        t_draft = time.perf_counter()
        drafts = proposer.propose(tokens, aux if proposer.aux_layers else None, k)[:k] if k > 0 else []
        gen.draft_s += time.perf_counter() - t_draft
        gen.num_drafted += len(drafts)
        base = len(tokens) - 1  # position of the last committed token, the first one the target has not seen
        if sampled:
            logits, aux_all = target.forward_logits([tokens[-1], *drafts])
            coins = torch.rand(len(drafts) + 1, generator=generator)
            final_coin = float(torch.rand((), generator=generator))
            num_accepted, next_token = verify(sampling_probs(logits, temperature), drafts, coins, final_coin)
        else:
            greedy, aux_all = target.forward([tokens[-1], *drafts])
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == greedy[num_accepted]:
                num_accepted += 1
            next_token = greedy[num_accepted]
        committed = drafts[:num_accepted] + [next_token]
        committed, finished = _cut_at_eos(committed, eos_ids)
        target.crop(base + 1 + num_accepted)
        aux = aux_all[:, : num_accepted + 1] if aux_all is not None else None
        tokens.extend(committed)
        gen.verify_ct += 1
        gen.verify_tokens += len(committed)
        for j in range(len(drafts)):
            gen.proposed_by_position[j] += 1
        for j in range(min(num_accepted, len(committed))):
            gen.accepted_by_position[j] += 1
    gen.output_ids = tokens[len(prompt_ids) :]
    gen.wall_s = time.perf_counter() - start
    return gen


class OutputMismatchError(AssertionError):
    """Speculative output differs from the target's greedy output: a bug, never a tuning matter."""


def check_identical(method: str, prompt_id: str, reference: Sequence[int], got: Sequence[int]) -> None:
    if list(reference) == list(got):
        return
    pos = next((i for i, (a, b) in enumerate(zip(reference, got)) if a != b), min(len(reference), len(got)))
    raise OutputMismatchError(
        f"{method} on prompt {prompt_id!r}: output differs from the target's greedy decoding at generated token "
        f"{pos} (greedy {list(reference[pos : pos + 4])}, speculative {list(got[pos : pos + 4])}; lengths "
        f"{len(reference)} vs {len(got)})"
    )


def summarize(
    set_name: str,
    method: str,
    spec: SpecConfig | None,
    gens: Sequence[Generation],
    round_walls: Sequence[float] = (),
    bands: LengthBands | None = None,
) -> dict:
    """One result row (the shape `report.make_row` defines) from a set's generations (acceptance: one round).

    `round_walls` are the set's wall seconds in each timed round (the row's wall is their median);
    `bands` adds acceptance per prompt-length band.
    """
    k = spec.num_steps if spec else 0

    def counts(part: Sequence[Generation]) -> dict:
        return dict(
            num_prompts=len(part),
            verify_ct=sum(g.verify_ct for g in part),
            verify_tokens=sum(g.verify_tokens for g in part),
            accepted_by_position=[sum(g.accepted_by_position[j] for g in part) for j in range(k)],
        )

    extra: dict = {}
    if round_walls:
        extra["wall_s_rounds"] = list(round_walls)
    if bands is not None:
        extra["bands"] = [
            band_entry(
                bands, i, **counts([g for g in gens if bands.index(g.prompt_tokens) == i]), has_spec=spec is not None
            )
            for i in range(len(bands.labels))
        ]
    drafted = sum(g.num_drafted for g in gens)
    if drafted:
        extra["draft_s_per_token"] = sum(g.draft_s for g in gens) / drafted
    whole = counts(gens)
    return make_row(
        set_name,
        method,
        spec.label if spec else None,
        num_prompts=whole["num_prompts"],
        prompt_tokens=sum(g.prompt_tokens for g in gens),
        completion_tokens=sum(len(g.output_ids) for g in gens),
        wall_s=statistics.median(round_walls) if round_walls else sum(g.wall_s for g in gens),
        verify_ct=whole["verify_ct"],
        verify_tokens=whole["verify_tokens"],
        accepted_by_position=whole["accepted_by_position"],
        **extra,
    )


def run_inprocess_benchmark(
    model: torch.nn.Module,
    prompt_sets: Mapping[str, Sequence[tuple[str, Sequence[int]]]],
    proposers: Mapping[str, Proposer],
    spec_configs: Sequence[SpecConfig],
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    check: bool = True,
    log: Callable[[str], None] = lambda _msg: None,
    rounds: int = DEFAULT_ROUNDS,
    bands: LengthBands | None = None,
    temperatures: Sequence[float] = (0.0,),
    seed: int = 0,
    sampled_proposers: Collection[str] | None = None,
    timed_proposers: Collection[str] | None = None,
) -> list[dict]:
    """Every set under no speculation and every (proposer, spec config), at each temperature; rows carry
    speed-ups over no speculation at the same temperature.

    `prompt_sets` maps a set name to (prompt id, chat-templated token ids). Timing: every method
    is warmed up once (untimed), then each of `rounds` rounds runs every method over the whole set,
    no_spec first in round 0 (it is the reference output) and the order rotated in later rounds,
    so drift in machine load spreads over all methods; rows give the median round and the spread
    (`report.attach_speedups`). Outputs are deterministic (greedy), so acceptance is counted in round
    0 and every later round must reproduce it. With `check`, each speculative output is asserted
    identical to the no-speculation output of the same prompt.

    At a temperature T > 0 every method samples (`generate_sampled`, `generate_speculative` with
    SGLang's rule) with coins from a generator seeded per (seed, set, prompt, T), the same in every
    round, so later rounds reproduce round 0 exactly; outputs differ between methods (each spends
    coins its own way) and are distributed alike, which tests/unit/test_spec_sampling.py checks.
    `sampled_proposers` names the proposers measured at T > 0 (default all). `timed_proposers` names those
    timed over every round (default all); the others run in round 0 only, for their acceptance (a control
    whose speed nobody compares, such as an untrained drafter, which is also the slowest method to run), and
    their rows carry the one round's speed (`timed_rounds: 1`).
    """
    if rounds < 1:
        raise ValueError(f"in-process benchmark: rounds must be >= 1, got {rounds}")
    if not temperatures or any(t < 0 for t in temperatures):
        raise ValueError(f"in-process benchmark: temperatures must be >= 0, got {list(temperatures)}")
    rows: list[dict] = []
    for temperature in dict.fromkeys(float(t) for t in temperatures):
        chosen = (
            proposers
            if not temperature or sampled_proposers is None
            else {k: v for k, v in proposers.items() if k in sampled_proposers}
        )
        once = set() if timed_proposers is None else set(chosen) - set(timed_proposers)
        rows += _run_at_temperature(
            model,
            prompt_sets,
            chosen,
            spec_configs,
            max_new_tokens,
            eos_ids,
            check,
            log,
            rounds,
            bands,
            temperature,
            seed,
            once,
        )
    return attach_speedups(rows)


def _coins(seed: int, set_index: int, prompt_index: int, temperature: float) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, set_index, prompt_index, round(temperature * 1e6))) % 2**63)


def _run_at_temperature(
    model,
    prompt_sets,
    proposers,
    spec_configs,
    max_new_tokens,
    eos_ids,
    check,
    log,
    rounds,
    bands,
    temperature: float,
    seed: int,
    once: Collection[str] = (),
) -> list[dict]:
    runners: dict[tuple[int, ...], TargetRunner] = {}
    sampled = temperature > 0

    def runner(aux: tuple[int, ...]) -> TargetRunner:
        return runners.setdefault(aux, TargetRunner(model, aux))

    methods: list[tuple[str, Proposer | None, SpecConfig | None]] = [("no_spec", None, None)]
    methods += [(name, p, spec) for name, p in proposers.items() for spec in spec_configs]
    runs = [1 if name in once else rounds for name, _, _ in methods]  # rounds each method runs

    def run(
        method: tuple[str, Proposer | None, SpecConfig | None],
        ids: Sequence[int],
        max_new: int,
        coins: torch.Generator | None = None,
    ) -> Generation:
        _, proposer, spec = method
        if sampled:
            coins = coins or torch.Generator().manual_seed(seed)
            if proposer is None:
                return generate_sampled(runner(()), ids, max_new, eos_ids, temperature=temperature, generator=coins)
            assert spec is not None  # a method with a proposer has its configuration
            return generate_speculative(
                runner(tuple(proposer.aux_layers)),
                proposer,
                ids,
                spec,
                max_new,
                eos_ids,
                temperature=temperature,
                generator=coins,
            )
        if proposer is None:
            return generate_greedy(runner(()), ids, max_new, eos_ids)
        assert spec is not None
        return generate_speculative(runner(tuple(proposer.aux_layers)), proposer, ids, spec, max_new, eos_ids)

    # Warm-up of every method: one-off allocation, kernel selection and first-call paths stay out of timings.
    first = min((p for prompts in prompt_sets.values() for _, p in prompts), key=len, default=None)
    if first is not None:
        for method in methods:
            run(method, first, min(max_new_tokens, 8))
    rows: list[dict] = []
    at = f" at temperature {temperature:g}" if sampled else ""
    for set_index, (set_name, prompts) in enumerate(prompt_sets.items()):
        gens: dict[int, list[Generation]] = {}
        walls: dict[int, list[float]] = {i: [] for i in range(len(methods))}
        meter = ProgressMeter(log, f"{set_name}{at}", "generations", sum(runs) * len(prompts))
        done = 0
        for r in range(rounds):
            order = list(range(len(methods)))
            if r:
                shift = r % len(methods)
                order = order[shift:] + order[:shift]
            for i in (i for i in order if r < runs[i]):
                name, _, spec = methods[i]
                label = f"{name} {spec.label}" if spec else name
                round_gens: list[Generation] = []
                for prompt_index, (prompt_id, ids) in enumerate(prompts):
                    coins = _coins(seed, set_index, prompt_index, temperature) if sampled else None
                    gen = run(methods[i], ids, max_new_tokens, coins)
                    reference = gens[0][len(round_gens)].output_ids if 0 in gens and not sampled else None
                    if reference is not None and (check or i == 0):
                        check_identical(label, f"{set_name}/{prompt_id}", reference, gen.output_ids)
                    elif sampled and i in gens and gen.output_ids != gens[i][len(round_gens)].output_ids:
                        raise OutputMismatchError(
                            f"{set_name}/{prompt_id}: {label}{at} sampled differently in "
                            f"round {r} than in round 0 with the same coins"
                        )
                    round_gens.append(gen)
                    done += 1
                    meter(done)
                walls[i].append(sum(g.wall_s for g in round_gens))
                if r == 0:
                    gens[i] = round_gens
                elif i and [g.verify_tokens for g in round_gens] != [g.verify_tokens for g in gens[i]]:
                    raise OutputMismatchError(f"{set_name}: {label} accepted differently in round {r} than in round 0")
        for i, (name, _, spec) in enumerate(methods):
            rows.append(
                summarize(set_name, name, spec, gens[i], walls[i], bands)
                | {"temperature": temperature, "timed_rounds": runs[i]}
            )
            r_ = rows[-1]
            acc = f", acceptance length {r_['acceptance_length']:.3f}" if r_["acceptance_length"] else ""
            timing = f"median of {runs[i]}" if runs[i] > 1 else "one round"
            log(f"{set_name}{at}: {name} {spec.label if spec else ''} {r_['tokens_per_s']:.1f} tok/s ({timing}){acc}")
    return rows
