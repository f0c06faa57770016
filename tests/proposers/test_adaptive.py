"""The adaptive k policy's decisions on a synthetic cost model: step times come from a formula, never a clock."""

from __future__ import annotations

import json
import random

import pytest

from specd.speculation.k_policy import DraftOutcome, DraftSpan, EngineLoad, StepReport, StepView
from specd.speculation.policies.adaptive import EXPLORE_K, PROBE_INTERVAL, PROBE_SHARE, AdaptiveK, choose
from specd.speculation.policies.step_cost import _REFIT_AFTER, DraftCost, ForwardCost

BUDGET = 512


def weight_bound(num_seqs: int, num_rows: int) -> float:
    """A memory-bound forward: 50 ms of weights, rows nearly free."""
    return 0.050 + 0.0001 * num_rows + 0.0002 * num_seqs


def compute_bound(num_seqs: int, num_rows: int) -> float:
    """Flat up to 8 rows, then 4 ms per row: a CPU forward past its arithmetic intensity knee."""
    return 0.030 + 0.004 * max(0, num_rows - 8) + 0.0005 * num_seqs


def _teach_cost(policy: AdaptiveK, cost, seq_counts, max_extra: int = 12, propose_s: float = 0.0) -> None:
    """Steps at every S in seq_counts and R = S .. S + max_extra, timed by `cost` (outcomes carry no drafts, so
    acceptance learns nothing from them)."""
    for _ in range(3):
        for num_seqs in seq_counts:
            for extra in range(0, max_extra + 1, 2):
                rows = num_seqs + extra
                policy.observe(StepReport(
                    [DraftOutcome(10_000 + i, 0, 0, 0) for i in range(num_seqs)], rows, 0.0,
                    cost(num_seqs, rows) + propose_s, num_seqs, True, propose_s=propose_s, num_seqs=num_seqs,
                ))


def _teach_acceptance(
    policy: AdaptiveK, seq_id: int, rate: float, steps: int = 60, k: int = 8, propose_s: float = 0.0
) -> None:
    """Drafts of k tokens, each position accepted with probability `rate` (a seeded draw, so the same every run)."""
    draw = random.Random(seq_id)
    for _ in range(steps):
        accepted = 0
        while accepted < k and draw.random() < rate:
            accepted += 1
        policy.observe(StepReport(
            [DraftOutcome(seq_id, k, accepted, 0)], 0, 0.0, propose_s, 0, False, propose_s=propose_s
        ))


def _load(num_running: int, num_waiting: int = 0) -> EngineLoad:
    return EngineLoad(num_running, num_waiting, BUDGET)


def _policy(seq_ids, k_max: int = 8) -> AdaptiveK:
    policy = AdaptiveK()
    for seq_id in seq_ids:
        policy.add(seq_id, k_max)
    return policy


def test_explores_with_one_sequence_until_the_cost_was_measured() -> None:
    # Not k_max, nor a token for every sequence: one sequence drafts 1, 0, 2 tokens, so the steps cover three row
    # counts (R = S + 1, S, S + 2) for a row or two each; the others decode plainly meanwhile.
    policy = _policy([1, 2, 3])
    ks, causes = [], []
    for _ in range(6):
        ks.append(policy.plan([1, 2, 3], _load(3)))
        causes.append(policy.last_decision.cause)
        rows = 3 + sum(ks[-1])
        policy.observe(StepReport([DraftOutcome(i, 0, 0, 0) for i in (1, 2, 3)], rows, 0.0,
                                  compute_bound(3, rows), 3, True, num_seqs=3))
        if policy.forward.at(3, 3) is not None:
            break
    assert ks == [[EXPLORE_K, 0, 0], [0, 0, 0], [EXPLORE_K + 1, 0, 0]]
    assert causes == ["explore"] * 3
    policy.plan([1, 2, 3], _load(3))
    assert policy.last_decision.cause != "explore"
    # `keep` sees only the sequences that have a draft: the first of those explores.
    fresh = _policy([1, 2])
    assert fresh.keep([DraftSpan(2, 3, 0)], StepView(2, 5, BUDGET, True)) == [EXPLORE_K]


def test_probes_cost_at_most_their_share_of_the_step() -> None:
    def linear(num_seqs: int, num_rows: int) -> float:
        return 0.030 + 0.005 * num_rows  # every row costs: a probe at 8 sequences is 1/14 of the step

    for cost, num_seqs in [(weight_bound, 1), (linear, 8)]:
        policy = _policy(range(num_seqs))
        _teach_acceptance(policy, 0, 0.0)  # its drafts are never accepted: only probes verify any
        _teach_cost(policy, cost, [num_seqs])
        policy.plan(list(range(num_seqs)), _load(num_seqs))
        step = cost(num_seqs, num_seqs)
        per_row = cost(num_seqs, num_seqs + 1) - step
        # num_seqs sequences probing once per interval add num_seqs * per_row / interval seconds to a step.
        assert num_seqs * per_row / policy.probe_interval <= PROBE_SHARE * step * 1.05
        assert policy.probe_interval >= PROBE_INTERVAL
        idle = policy.probe_interval
        for _ in range(idle - 1):
            policy.observe(StepReport([DraftOutcome(0, 0, 0, 0)], 0, 0.0, 0.0, 0, False))
        assert policy.keep([DraftSpan(0, 4, 0)], StepView(num_seqs, num_seqs + 4, BUDGET, True))[0] == 0
        policy.observe(StepReport([DraftOutcome(0, 0, 0, 0)], 0, 0.0, 0.0, 0, False))
        assert policy.keep([DraftSpan(0, 4, 0)], StepView(num_seqs, num_seqs + 4, BUDGET, True))[0] == 1
    assert policy.probe_interval > 2 * PROBE_INTERVAL  # rows are dear at 8 sequences: probes are rarer


def test_cheap_verification_keeps_drafts_at_every_batch_size() -> None:
    policy = _policy(range(16))
    _teach_cost(policy, weight_bound, [1, 2, 4, 8, 16])
    for seq_id in range(16):
        _teach_acceptance(policy, seq_id, 0.6)
    assert min(policy.plan([0], _load(1))) >= 4
    ks = policy.plan(list(range(16)), _load(16))
    assert min(ks) >= 4 and policy.last_decision.cause == "draft"


def test_costly_verification_falls_to_zero_and_recovers_when_the_load_drops() -> None:
    policy = _policy(range(16))
    _teach_cost(policy, compute_bound, [1, 2, 4, 8, 16])
    for seq_id in range(16):
        _teach_acceptance(policy, seq_id, 0.6)
    alone = policy.plan([0], _load(1))
    assert alone[0] >= 3  # 8 rows are free, so a lone request drafts up to the knee
    assert policy.plan(list(range(16)), _load(16)) == [0] * 16  # every row costs: plain decoding wins
    assert policy.last_decision.cause == "cost"
    assert policy.plan([0], _load(1)) == alone  # the load left: drafting comes back at once


def test_the_price_follows_the_measured_cost_when_it_changes() -> None:
    policy = _policy(range(8))
    for seq_id in range(8):
        _teach_acceptance(policy, seq_id, 0.6)
    _teach_cost(policy, compute_bound, [8])
    assert policy.plan(list(range(8)), _load(8)) == [0] * 8
    for _ in range(10):  # the machine got faster at verifying (e.g. another tenant left)
        _teach_cost(policy, weight_bound, [8])
    assert min(policy.plan(list(range(8)), _load(8))) > 0


def test_per_sequence_acceptance_is_respected() -> None:
    policy = _policy(range(8))
    _teach_cost(policy, lambda s, r: 0.030 + 0.0012 * r, [4, 8])
    for seq_id in range(4):
        _teach_acceptance(policy, seq_id, 1.0)  # copies its context: every draft accepted
    for seq_id in range(4, 8):
        _teach_acceptance(policy, seq_id, 0.0)  # never accepted
    ks = policy.plan(list(range(8)), _load(8))
    assert min(ks[:4]) >= 4 and ks[4:] == [0, 0, 0, 0]


def test_k_varies_per_sequence_within_each_k_max() -> None:
    policy = AdaptiveK()
    for seq_id, k_max in [(1, 1), (2, 3), (3, 8)]:
        policy.add(seq_id, k_max)
        _teach_acceptance(policy, seq_id, 1.0)
    _teach_cost(policy, weight_bound, [1, 2, 3])
    assert policy.plan([1, 2, 3], _load(3)) == [1, 3, 8]
    # keep sees the draft as made: a shorter draft is kept whole when it pays.
    assert policy.keep([DraftSpan(2, 2, 0), DraftSpan(3, 5, 0)], StepView(3, 3 + 7, BUDGET, True)) == [2, 5]


def test_a_costly_draft_model_drafts_fewer_positions() -> None:
    free = _policy([1])
    costly = _policy([1])
    for policy, per_position in [(free, 0.0), (costly, 0.02)]:  # a draft forward of 20 ms per position
        _teach_acceptance(policy, 1, 0.75, propose_s=8 * per_position)
        _teach_cost(policy, weight_bound, [1])
    k_free, k_costly = free.plan([1], _load(1))[0], costly.plan([1], _load(1))[0]
    assert k_costly < k_free


def test_keep_cuts_a_weak_bucket_and_a_cut_sequence_probes() -> None:
    policy = _policy([1, 2])
    _teach_cost(policy, compute_bound, [2])
    for _ in range(30):
        policy.observe(StepReport([DraftOutcome(1, 4, 4, 5), DraftOutcome(2, 4, 0, 1)], 0, 0.0, 0.0, 0, False))
    kept = policy.keep([DraftSpan(1, 4, 5), DraftSpan(2, 4, 1)], StepView(2, 10, BUDGET, True))
    assert kept[0] >= 3 and kept[1] == 0
    for _ in range(PROBE_INTERVAL):
        policy.observe(StepReport([DraftOutcome(2, 0, 0, 0)], 0, 0.0, 0.0, 0, False))
    assert policy.keep([DraftSpan(2, 4, 1)], StepView(2, 6, BUDGET, True)) == [1]
    # `keep` cut it for its cost: those steps count as "cost", like a plan of 0, not as "cut" (nothing to draft)
    assert policy.snapshot()["zero_k_sequence_steps"] == {"cost": PROBE_INTERVAL, "cut": 0}  # type: ignore[index]


def _teach_buckets(policy: AdaptiveK) -> None:
    """Drafts of bucket 1 (short matches) mostly fail, the rarer bucket 6 ones are copied whole: the bucket-blind
    mean is poor."""
    for step in range(120):
        strong = step % 6 == 0
        policy.observe(StepReport([DraftOutcome(1, 4, 4 if strong else 0, 6 if strong else 1)], 0, 0.0, 0.0, 0,
                                  False))


def test_free_drafts_are_planned_for_the_best_bucket_and_cut_by_keep() -> None:
    # Prompt lookup costs nothing: `plan` asks for what the best bucket earns and `keep`, which knows the draft's
    # bucket, cuts the weak ones. A costly proposer's plan follows the bucket-blind mean instead (here: k = 0).
    free, costly = AdaptiveK(free_drafts=True), AdaptiveK(free_drafts=False)
    for policy in (free, costly):
        policy.add(1, 8)
        _teach_cost(policy, lambda s, r: 0.010 + 0.002 * r, [1], max_extra=16)  # a row: ~1/6 of a plain step
        _teach_buckets(policy)
    assert costly.plan([1], _load(1)) == [0]
    assert costly.last_decision is not None and costly.last_decision.cause == "cost"
    assert free.plan([1], _load(1))[0] >= 4
    assert free.keep([DraftSpan(1, 8, 6)], StepView(1, 9, BUDGET, True))[0] >= 4
    assert free.keep([DraftSpan(1, 8, 1)], StepView(1, 9, BUDGET, True)) == [0]
    # Where a row costs as much as a plain step, even the best bucket does not pay: plan falls to 0.
    free.forward = ForwardCost()
    _teach_cost(free, lambda s, r: 0.001 + 0.030 * r, [1], max_extra=16)
    assert free.plan([1], _load(1)) == [0]


def test_the_registry_tells_adaptive_whether_drafts_are_free() -> None:
    from specd.config import SpeculationConfig
    from specd.speculation.registry import PROPOSERS, build_k_policies

    policies = {name: build_k_policies(SpeculationConfig(), entry.traits)["adaptive"]
                for name, entry in PROPOSERS.items()}
    assert {name: policy.free_drafts for name, policy in policies.items()} == {  # type: ignore[attr-defined]
        "ngram": True, "draft": False, "layerskip": False, "eagle": False, "hybrid": False}


def test_budget_caps_the_drafts_and_snapshot_is_json() -> None:
    policy = _policy(range(4))
    _teach_cost(policy, weight_bound, [4])
    for seq_id in range(4):
        _teach_acceptance(policy, seq_id, 1.0)
    ks = policy.plan(list(range(4)), EngineLoad(4, 0, 4 + 10))
    assert sum(ks) <= 10
    json.dumps(policy.snapshot())


def test_forward_cost_fit_is_robust_and_reads_the_local_slope() -> None:
    cost = ForwardCost()
    assert cost.at(4, 4) is None
    for _ in range(6):
        for rows in range(4, 40):
            cost.observe(4, rows, compute_bound(4, rows))
    cost.observe(4, 30, 10.0)  # one descheduled step: clipped, not believed
    steep, flat = cost.at(4, 30), cost.at(4, 6)
    assert steep is not None and flat is not None
    assert steep.seconds_per_row == pytest.approx(0.004, rel=0.15)
    assert flat.seconds_per_row < 0.7 * steep.seconds_per_row  # blended with the knee within a bandwidth
    draft = DraftCost()
    assert draft.per_position(2) == 0.0
    for positions in (2, 4, 8):
        draft.observe(2, positions, 0.01 * positions)
    assert draft.per_position(2) == pytest.approx(0.01)


def test_choose_prefers_plain_decoding_unless_drafting_wins_by_the_margin() -> None:
    cost = ForwardCost()
    for num_seqs in (1, 2, 3):
        for rows in range(num_seqs, num_seqs + 10):
            cost.observe(num_seqs, rows, 0.010 * rows)  # strictly per row: a draft token never pays
    decision = choose([[0.99, 0.98]], 1, 1, BUDGET, cost, 0.0)
    assert decision.k == [0] and decision.cause == "cost"


def test_drafts_take_only_the_rows_the_step_s_prompt_chunks_leave_free() -> None:
    """Drafts that pay get the budget's rows the prompts being prefilled do not need, and never displace a prompt
    token: that would keep the prompt's sequence out of the decoding batch a step longer."""
    budget = 64
    policy = _policy(range(8))
    for seq_id in range(8):
        _teach_acceptance(policy, seq_id, 1.0)
    _teach_cost(policy, weight_bound, [8, 9, 10])
    assert sum(policy.plan(list(range(8)), EngineLoad(8, 0, budget))) == budget - 8  # decode only: all 56 free
    # Two sequences prefilling 40 tokens between them: 16 rows are left, and the scheduler gives drafts at most half
    # of the room while prompts are pending.
    ks = policy.plan(list(range(8)), EngineLoad(10, 0, budget, num_prefilling=2, num_prompt_tokens=40))
    assert sum(ks) == budget - 8 - 40
    ks = policy.plan(list(range(8)), EngineLoad(10, 0, budget, num_prefilling=2, num_prompt_tokens=4))
    assert sum(ks) == (budget - 8) // 2
    # A backlog that fills the budget: no draft at all.
    assert policy.plan(list(range(8)), EngineLoad(16, 4, budget, num_prefilling=8, num_prompt_tokens=900)) == [0] * 8


def test_a_fit_is_reused_for_a_few_steps_then_redone() -> None:
    """The local fit runs several times a step: it is kept for _REFIT_AFTER observed steps, then redone, so a
    changed cost reaches the policy within that many steps."""
    cost = ForwardCost()
    for _ in range(4):
        for rows in range(4, 16):
            cost.observe(4, rows, weight_bound(4, rows))
    first = cost.at(4, 8)
    assert first is not None
    for step in range(_REFIT_AFTER):
        assert cost.at(4, 8) is first  # reused: no fit in between
        cost.observe(4, 4 + step, 10 * compute_bound(4, 4 + step))  # the machine slowed down
    later = cost.at(4, 8)
    assert later is not None and later.seconds > first.seconds  # refitted on what was observed since


def test_values_of_many_sequences_match_one_at_a_time() -> None:
    policy = _policy([1, 2, 3], k_max=6)
    _teach_acceptance(policy, 1, 0.9)
    _teach_acceptance(policy, 2, 0.2, k=3)  # its own counts reach position 3 only
    many = policy.acceptance.values_of([1, 2, 3], -1, [6, 6, 2])
    assert many == [policy.acceptance.values(seq_id, -1, n) for seq_id, n in [(1, 6), (2, 6), (3, 2)]]
    assert many[0][0] > many[2][0] > many[1][0]  # own counts, shrunk towards the engine-wide value
    assert policy.acceptance.prob(2, -1, 5) == pytest.approx(many[1][5] / many[1][4])


def test_steps_with_prompt_chunks_do_not_teach_the_price_of_a_draft_row() -> None:
    """A prompt row can cost a fraction of a verified row (an int4 model's dense prompt rows on AMX): steps that carried
    prompt chunks would make rows look cheap, and the policy would draft past saturation."""
    policy = _policy(range(16))
    _teach_cost(policy, compute_bound, [1, 2, 4, 8, 16])
    for seq_id in range(16):
        _teach_acceptance(policy, seq_id, 0.6)
    assert policy.plan(list(range(16)), _load(16)) == [0] * 16
    for _ in range(20):  # prefill steps: hundreds of rows at a twentieth of a verified row's cost each
        for rows in (100, 200, 300):
            policy.observe(StepReport([DraftOutcome(i, 0, 0, 0) for i in range(16)], 16 + rows, 0.0,
                                      compute_bound(16, 16) + 0.0002 * rows, 16, False, num_seqs=17))
    assert policy.plan(list(range(16)), _load(16)) == [0] * 16
    # keep prices the drafts of a step with a prompt chunk as the same drafts in a decode step
    drafts = [DraftSpan(i, 4, 0) for i in range(16)]
    with_chunk = policy.keep(drafts, StepView(17, 16 + 64 + 100, BUDGET, False))
    assert with_chunk == policy.keep(drafts, StepView(17, 17 + 64, BUDGET, True)) == [0] * 16
    cheap = _policy(range(16))
    _teach_cost(cheap, weight_bound, [1, 2, 4, 8, 16, 17])
    for seq_id in range(16):
        _teach_acceptance(cheap, seq_id, 0.6)
    assert min(cheap.keep(drafts, StepView(17, 16 + 64 + 100, BUDGET, False))) >= 3  # rows that pay are kept


def test_a_lone_sequence_leaves_exploration() -> None:
    """One client, closed loop: every step has one sequence, and only decode steps teach the cost. With one fixed
    explore k its steps had two row counts, too few for a fit, and the policy explored (k = 1) forever."""
    policy = _policy([1])
    for seq_id in (1,):
        _teach_acceptance(policy, seq_id, 0.8)
    causes = []
    for _ in range(8):
        k = policy.plan([1], _load(1))[0]
        causes.append(policy.last_decision.cause)
        rows = 1 + k
        policy.observe(StepReport([DraftOutcome(1, 0, 0, 0)], rows, 0.0, weight_bound(1, rows), 1, True, num_seqs=1))
    assert causes[0] == "explore" and causes[-1] == "draft"
    assert policy.plan([1], _load(1))[0] >= 4  # rows nearly free and 0.8 acceptance: long drafts


def test_a_cut_bucket_learns_from_the_next_tokens_it_would_have_matched() -> None:
    # Bucket 1 failed early and `keep` cuts it; its cut drafts' next tokens then match the target's (the drafts
    # turned good), which is enough to keep it again -- no verified draft needed.
    policy = AdaptiveK(free_drafts=True)
    policy.add(1, 8)
    _teach_cost(policy, lambda s, r: 0.010 + 0.002 * r, [1], max_extra=16)
    for _ in range(20):
        policy.observe(StepReport([DraftOutcome(1, 2, 0, 1)], 0, 0.0, 0.0, 0, False))
    assert policy.keep([DraftSpan(1, 8, 1)], StepView(1, 9, BUDGET, True)) == [0]
    for _ in range(60):
        policy.observe(StepReport([DraftOutcome(1, 0, 0, 1, next_matched=True)], 0, 0.0, 0.0, 0, False))
    assert policy.keep([DraftSpan(1, 8, 1)], StepView(1, 9, BUDGET, True))[0] >= 1
    # A miss after accepted drafts counts at the position past them.
    before = policy.acceptance.prob(1, 1, 2)
    policy.observe(StepReport([DraftOutcome(1, 2, 2, 1, next_matched=False)], 0, 0.0, 0.0, 0, False))
    assert policy.acceptance.prob(1, 1, 2) < before


def test_the_first_step_after_a_prompt_chunk_does_not_teach_the_cost() -> None:
    # A fresh engine explores R = S + 1, S, S + 2 right after the prompt's prefill; that first decode step runs
    # cold (an engine step 3.7x a warm one on the default int4 model). Fed to the cost model at R = S + 1 it
    # prices rows far too high. Marked after_prompt, it is left out, as prompt steps are.
    def decode_s(rows: int) -> float:  # the default int4 model at one sequence: 9 ms, 0.9 ms per extra row
        return 0.009 + 0.0009 * (rows - 1)

    def run(mark: bool) -> AdaptiveK:
        policy = _policy([1])
        policy.observe(StepReport([DraftOutcome(1, 0, 0, 0)], 200, 0.0, 0.5, 1, False, num_seqs=1))  # the prefill
        for step in range(40):
            exploring = policy.forward.at(1, 1) is None
            rows = 1 + policy.plan([1], _load(1))[0] if exploring else 1  # explore, then decode plainly
            seconds = decode_s(rows) * (3.7 if step == 0 else 1.0)
            policy.observe(StepReport([DraftOutcome(1, rows - 1, 0, 0)], rows, 0.0, seconds, 1, True, num_seqs=1,
                                      after_prompt=mark and step == 0))
        return policy

    marked, unmarked = run(True), run(False)
    assert marked.forward.at(1, 1).seconds_per_row == pytest.approx(0.0009, rel=0.05)
    assert unmarked.forward.at(1, 1).seconds_per_row > 3 * 0.0009  # what the cold step did unmarked
    assert not StepReport([], 2, 0.0, 0.1, 1, True, after_prompt=True).teaches_cost
    assert not StepReport([], 2, 0.0, 0.1, 1, False).teaches_cost
    assert StepReport([], 2, 0.0, 0.1, 1, True).teaches_cost


@pytest.mark.parametrize("free_drafts", [False, True])
def test_plan_s_shortcut_when_drafts_are_priced_out_decides_as_choose_does(free_drafts: bool) -> None:
    """`plan` reads only each sequence's first position when even the best one cannot pay for its row; that must be
    exactly `choose`'s decision on the full values, on every side of the line (cheap rows, costly rows, between)."""
    draw = random.Random(7)
    for trial in range(40):
        num_seqs = draw.choice([1, 2, 4, 8, 16])
        policy = AdaptiveK(free_drafts=free_drafts)
        seq_ids = list(range(num_seqs))
        for seq_id in seq_ids:
            policy.add(seq_id, draw.choice([0, 1, 3, 8]))
            _teach_acceptance(policy, seq_id, draw.random(), steps=draw.randint(1, 30))
        per_row = draw.choice([0.0001, 0.001, 0.003, 0.01])
        _teach_cost(policy, lambda s, r, per_row=per_row: 0.02 + per_row * r + 0.0002 * s, [num_seqs, num_seqs + 1])
        draft_per_position = policy.draft.per_position(num_seqs)
        lengths = [policy._k_max[sid] for sid in seq_ids]
        full = choose(policy._plan_values(seq_ids, lengths), num_seqs, num_seqs, num_seqs + BUDGET, policy.forward,
                      draft_per_position)
        shortcut = policy._priced_out(seq_ids, lengths, num_seqs, draft_per_position)
        if shortcut is not None:
            assert shortcut == full and full.k == [0] * num_seqs, trial
        if full.cause == "draft":
            assert shortcut is None, trial
        planned = policy.plan(seq_ids, _load(num_seqs))
        assert planned == full.k and policy.last_decision == full, trial
