"""Speculation inside the engine: lossless for greedy and sampled decoding, with k varying per sequence."""

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.model.attention import ForwardBatch
from specd.model.config import ModelArchConfig
from specd.model.llama import build_model
from specd.sampling.params import SamplingParams, SpecOverride
from specd.sampling.penalties import TokenHistory, adjust_logits
from specd.speculation.draft import DraftModelProposer
from specd.speculation.eagle import EagleProposer
from specd.speculation.hybrid import HybridProposer
from specd.speculation.ngram import NgramConfig, NgramProposer
from specd.speculation.policies.goodput import PROBE_INTERVAL
from specd.speculation.proposer import Proposal, Proposer
from specd.testing import random_draft_head, tiny_hf_config_dict, tiny_hf_model, tiny_specd_model

PROMPTS = ["hello world, hello world, hello", "abcabcabcabc", "the quick brown fox jumps over the lazy dog. the quick",
           "Zebra", "x = 1; y = 2; x = 1; y ="]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_model():
    # A deliberately different model (other weights) with the same vocabulary.
    return tiny_specd_model(tiny_hf_config_dict(), seed=7, dtype=torch.float64)


def _plain(make_llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in make_llm().generate(prompts, params)]


def _spec(method, k, policy, **extra):
    return SpeculationConfig(method=method, num_speculative_tokens=k, k_policy=policy, **extra)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize(
    ("method", "policy"),
    [("ngram", "fixed"), ("ngram", "heuristic"), ("ngram", "goodput"), ("layerskip", "fixed"),
     ("layerskip", "heuristic"), ("layerskip", "confidence"), ("draft", "fixed"), ("draft", "heuristic"),
     ("draft", "confidence"), ("eagle", "fixed"), ("eagle", "heuristic"), ("eagle", "confidence"),
     ("hybrid", "fixed"), ("hybrid", "confidence"), ("ngram", "adaptive"), ("layerskip", "adaptive"),
     ("draft", "adaptive"), ("eagle", "adaptive"), ("hybrid", "adaptive")],
)
def test_greedy_lossless_every_proposer_and_policy(make_llm, tiny_model, draft_model, method, policy, k):
    plain = _plain(make_llm)
    proposer = None
    if method in ("eagle", "hybrid"):
        # A random head over 200 of the 320 tokens: drafts are sometimes right, sometimes outside the map's reach.
        proposer = EagleProposer(random_draft_head(tiny_model, 200), 8, 256)
        if method == "hybrid":  # ngram where a 2-token suffix recurs (the repetitive prompts), the head elsewhere
            proposer = HybridProposer(NgramProposer(NgramConfig(1, 4)), proposer, tiny_model.config.vocab_size, 2)
        spec = _spec("layerskip", k, policy, draft_layers=1, confidence_threshold=0.06)
    elif method == "draft":
        # 0.06: about the median top probability of these random tiny models, so confidence cuts about half.
        proposer = DraftModelProposer(draft_model, 8, 256)
        # method only enables speculation; proposer injected
        spec = _spec("layerskip", k, policy, draft_layers=1, confidence_threshold=0.06)
    else:
        spec = _spec(method, k, policy, draft_layers=1, confidence_threshold=0.06)
    llm = make_llm(spec, proposer=proposer, max_num_seqs=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    metrics = llm.get_metrics()
    assert metrics["counters"]["drafts"] > 0


@pytest.fixture(scope="module")
def tiny_int4_model():
    """The tiny Llama in the default mode: int4 projections, int8 head, bfloat16 activations (specd's native kernels
    where they build, as in production; torch's int4/int8 kernels where not)."""
    cfg = tiny_hf_config_dict()
    sd = {k: v.detach().clone() for k, v in tiny_hf_model(cfg).state_dict().items()}
    return build_model(ModelArchConfig.from_hf_dict(cfg), sd, torch.bfloat16, int4=True)


@pytest.mark.parametrize("method", ["ngram", "layerskip", "eagle", "hybrid"])
def test_greedy_lossless_in_int4_one_sequence_at_a_time(make_llm, tiny_int4_model, method):
    # int4 is not float64: exactness rests on every kernel giving a row the same bits whatever else is in the
    # forward (quantised GEMMs, the int8 head and attention). One sequence at a time that holds by construction;
    # across sequences of unequal lengths attention's padding can still flip a near-tie (bench/lossless.py).
    plain_llm = make_llm(model=tiny_int4_model, max_num_seqs=1)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, GREEDY)]
    proposer = None
    if method in ("eagle", "hybrid"):
        proposer = EagleProposer(random_draft_head(tiny_int4_model, 200), 8, 256)
        if method == "hybrid":
            proposer = HybridProposer(NgramProposer(NgramConfig(1, 4)), proposer, tiny_int4_model.config.vocab_size, 2)
    spec = _spec("layerskip" if proposer is not None else method, 4, "fixed", draft_layers=1)
    llm = make_llm(spec, model=tiny_int4_model, proposer=proposer, max_num_seqs=1)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert llm.get_metrics()["counters"]["drafts"] > 0


def test_self_draft_accepts_everything(make_llm, tiny_model):
    for params in (GREEDY, SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)):
        proposer = DraftModelProposer(tiny_model, 8, 256)
        llm = make_llm(_spec("layerskip", 4, "fixed"), proposer=proposer)
        out = llm.generate(PROMPTS[:3], params)
        for o in out:
            s = o.spec_stats
            assert s.drafts > 0
            assert s.accepted_tokens == s.draft_tokens


class RandomProposer(Proposer):
    """Adversarial: proposes random tokens, so the target rejects almost all of them."""

    name = "random"

    def __init__(self, vocab: int) -> None:
        self.rng = random.Random(0)
        self.vocab = vocab

    def propose(self, seqs, num_draft_tokens):
        return Proposal([[self.rng.randrange(self.vocab) for _ in range(k)] for k in num_draft_tokens], None)

    def release(self, seq_id):
        pass


def test_adversarial_draft_accepts_almost_nothing_and_stays_correct(make_llm):
    llm = make_llm(_spec("ngram", 5, "fixed"), proposer=RandomProposer(320), max_num_seqs=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _plain(make_llm)
    m = llm.get_metrics()["counters"]
    assert m["draft_tokens"] > 500
    assert m["accepted_tokens"] / m["draft_tokens"] < 0.05


def test_k_zero_and_k_max_in_the_same_step(make_llm, tiny_model):
    proposer = DraftModelProposer(tiny_model, 8, 256)
    llm = make_llm(_spec("layerskip", 5, "fixed"), proposer=proposer, max_num_seqs=4)
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, spec_detail=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, spec_detail=True,
                       speculation=SpecOverride(enabled=False)),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, spec_detail=True,
                       speculation=SpecOverride(num_speculative_tokens=2)),
    ]
    outs = llm.generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in outs] == _plain(make_llm, PROMPTS[:3], params[0])
    ks = [{step.k for step in o.spec_stats.steps} for o in outs]
    assert 5 in ks[0] and ks[1] == {0} and max(ks[2]) == 2
    assert outs[1].spec_stats.drafts == 0


def _fresh_kv(model, tokens, num_layers=None):
    cache = model.make_cache(1, 256, num_layers=num_layers)
    slot = cache.allocate()
    cache.reserve(len(tokens))
    model(ForwardBatch.build([tokens], [slot], [0], [[len(tokens) - 1]]), cache, num_layers=num_layers)
    return cache, slot


def test_rollback_leaves_state_equal_to_fresh_prefill(make_llm, tiny_model, draft_model):
    proposer = DraftModelProposer(draft_model, 8, 256)
    llm = make_llm(_spec("layerskip", 4, "heuristic"), proposer=proposer, max_num_seqs=4)
    for p in PROMPTS[:3]:
        llm.add_request(p, SamplingParams(max_tokens=200, temperature=0.8, seed=5, ignore_eos=True))
    for _ in range(12):
        llm.step()
    m = llm.get_metrics()["counters"]
    assert 0 < m["accepted_tokens"] < m["draft_tokens"]  # a mix of accepts and rejects happened
    engine = llm.engine
    for seq in engine.scheduler.running:
        tokens = seq.token_ids
        assert seq.num_computed == len(tokens) - 1
        n = seq.num_computed
        assert engine.cache.seq_lens[seq.slot] == n
        ref, rslot = _fresh_kv(tiny_model, tokens[:n])
        for layer in range(tiny_model.config.num_layers):
            torch.testing.assert_close(engine.cache.keys[layer][seq.slot, :, :n], ref.keys[layer][rslot, :, :n])
            torch.testing.assert_close(engine.cache.values[layer][seq.slot, :, :n], ref.values[layer][rslot, :, :n])
        # The draft model's cache, for the prefix it says it holds, equals a fresh prefill of those tokens.
        cached = proposer._cached[seq.seq_id]
        dslot = proposer._slots[seq.seq_id]
        c = len(cached)
        dref, dslot_ref = _fresh_kv(draft_model, cached)
        for layer in range(draft_model.config.num_layers):
            torch.testing.assert_close(proposer.cache.keys[layer][dslot, :, :c], dref.keys[layer][dslot_ref, :, :c])


def test_stop_inside_accepted_run_truncates(make_llm, tiny_model):
    plain = _plain(make_llm, PROMPTS[:1])[0]
    stop_id = plain[9]
    expected = plain[: plain.index(stop_id) + 1]
    proposer = DraftModelProposer(tiny_model, 8, 256)  # accepts everything: stop falls inside a run
    llm = make_llm(_spec("layerskip", 6, "fixed"), proposer=proposer)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_id],
                                                   spec_detail=True))[0]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "stop"
    last = out.spec_stats.steps[-1]
    assert last.emitted < last.accepted + 1  # the verifier accepted more than was emitted
    assert out.spec_stats.emitted_tokens < out.spec_stats.accepted_tokens + out.spec_stats.drafts


# ------------------------------------------------------------------ sampled losslessness (chi-square)
VOCAB = 8


@pytest.fixture(scope="module")
def tiny_vocab_models():
    cfg = tiny_hf_config_dict(vocab_size=VOCAB)
    target = tiny_specd_model(cfg, seed=11, dtype=torch.float64)
    draft = tiny_specd_model(cfg, seed=12, dtype=torch.float64)
    return target, draft


def _exact_dist_of_tokens_2_and_3(model, prompt, temperature):
    """P(t2, t3) = sum_t1 p(t1) p(t2 | t1) p(t3 | t1, t2), computed exactly from the target's logits."""

    def probs(tokens):
        c = model.make_cache(1, 64)
        s = c.allocate()
        c.reserve(len(tokens))
        logits = model(ForwardBatch.build([tokens], [s], [0], [[len(tokens) - 1]]), c)[0]
        return torch.softmax(logits / temperature, -1).numpy()

    p1 = probs(prompt)
    joint = np.zeros((VOCAB, VOCAB))
    for t1 in range(VOCAB):
        p2 = probs([*prompt, t1])
        for t2 in range(VOCAB):
            joint[t2] += p1[t1] * p2[t2] * probs([*prompt, t1, t2])
    return joint.reshape(-1)


SAMPLED_COMBOS = [
    ("ngram", "fixed"), ("ngram", "heuristic"), ("ngram", "goodput"),
    ("draft", "fixed"), ("draft", "heuristic"), ("draft", "confidence"),
    ("layerskip", "fixed"), ("layerskip", "heuristic"), ("layerskip", "confidence"),
    ("eagle", "fixed"), ("eagle", "confidence"), ("hybrid", "fixed"),
    ("ngram", "adaptive"), ("draft", "adaptive"), ("eagle", "adaptive"),
    ("broken-residual", "fixed"),
]


@pytest.mark.parametrize(("method", "policy"), SAMPLED_COMBOS)
def test_sampled_speculation_matches_target_distribution(tiny_vocab_models, method, policy, monkeypatch):
    """Every proposer x k policy that supports sampling, chi-square at significance 0.001. The "broken-residual"
    case samples corrections from p instead of norm(max(0, p - q)) and must be caught by the same test: proof
    that the test has power. The confidence threshold (0.3; 0.632 for the eagle head, whose top probabilities lie in
    0.62-0.64 here) cuts the draft at about half of the contexts here, so both the cut and the uncut paths are
    exercised."""
    if method == "broken-residual":
        from specd.sampling import rejection

        monkeypatch.setattr(rejection, "_correction_probs", lambda target, draft: target)
    target, draft = tiny_vocab_models
    prompt = [1, 5, 3, 6]
    temperature = 0.9
    expected = _exact_dist_of_tokens_2_and_3(target, prompt, temperature)
    # Sanity: the draft really is a different distribution.
    assert not np.allclose(_exact_dist_of_tokens_2_and_3(draft, prompt, temperature), expected, atol=0.02)
    threshold = (0.632 if method == "eagle" else 0.3) if policy == "confidence" else None
    proposer = None  # ngram: built from the config
    if method == "layerskip":
        proposer = DraftModelProposer(target, 64, 64, num_layers=1)
    elif method in ("draft", "broken-residual"):
        proposer = DraftModelProposer(draft, 64, 64)
    elif method == "eagle":  # a random head whose draft vocabulary leaves out 2 of the 8 tokens (q = 0 there)
        proposer = EagleProposer(random_draft_head(target, 6, seed=4), 64, 64)
    elif method == "hybrid":  # ngram drafts after a token seen in the prompt (1, 5, 3), the head's after 0, 2, 4, 6, 7
        proposer = HybridProposer(NgramProposer(NgramConfig(1, 4)), EagleProposer(random_draft_head(target, 6, seed=4),
                                  64, 64), VOCAB, 1)
    spec_method = "ngram" if method == "ngram" else "layerskip"  # layerskip only enables speculation: injected
    cfg = EngineConfig(
        speculation=SpeculationConfig(method=spec_method, num_speculative_tokens=3, draft_layers=1, k_policy=policy,
                                      confidence_threshold=threshold or 0.5),
        max_num_seqs=64, max_model_len=64,
    )
    llm = LLM.from_model(target, None, cfg, proposer=proposer)
    if policy == "goodput":
        planner = llm.engine.speculator.k_policies["goodput"].planner
        assert planner is not None  # free verification: the plan keeps the drafts it has
        monkeypatch.setattr(planner, "marginal_seconds", lambda base_tokens, max_extra: 0.0)
    # Token 1 comes from the prefill step; tokens 2 and 3 from a speculative step (k = 1: d_1 verified, then
    # the correction or the bonus), so their joint distribution is what speculation must preserve.
    # A fourth token gives each request a decode step after the cold one that follows its prefill: only such steps
    # teach `adaptive` what a row costs (StepReport.teaches_cost), and until then it drafts with one sequence.
    n = 4000
    params = [SamplingParams(max_tokens=4, temperature=temperature, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    counts = np.zeros(VOCAB * VOCAB)
    for o in outs:
        _, t2, t3, _ = o.outputs[0].token_ids
        counts[t2 * VOCAB + t3] += 1
    m = llm.get_metrics()["counters"]
    assert 0 < m["accepted_tokens"] < m["draft_tokens"]  # both branches of the rule were exercised
    if policy == "confidence":  # some drafts were cut before their first token, some were not
        # (a draft the threshold stops before its first token is an empty proposal: k = 0 for "no_match")
        assert m["drafts"] > 0 and m["nonspec_by_cause"]["no_match"] > 0
    exp = expected * n
    keep = exp >= 5  # pool rare cells so the chi-square approximation holds
    obs_k = np.append(counts[keep], counts[~keep].sum())
    exp_k = np.append(exp[keep], exp[~keep].sum())
    _, pvalue = chisquare(obs_k, exp_k)
    if method == "broken-residual":
        assert pvalue < 0.001, f"the test failed to catch a wrong residual (p={pvalue:.2e})"
    else:
        assert pvalue > 0.001, f"speculative samples differ from the target distribution (p={pvalue:.2e})"


class SecondChoiceProposer(Proposer):
    """Drafts, for each sequence, the target's own second most likely next token at temperature 1, and records
    p(d) for it: with sharpened logits that probability is tiny but nonzero, the case a "max == 1.0 means
    greedy" rule gets wrong."""

    name = "second-choice"

    def __init__(self, target) -> None:
        self.target = target
        self.p_of_draft: list[float] = []

    def propose(self, seqs, num_draft_tokens):
        drafts = []
        for view, k in zip(seqs, num_draft_tokens):
            if k == 0:
                drafts.append([])
                continue
            tokens = list(view.token_ids)
            cache = self.target.make_cache(1, 256)
            slot = cache.allocate()
            cache.reserve(len(tokens))
            logits = self.target(ForwardBatch.build([tokens], [slot], [0], [[len(tokens) - 1]]), cache)[0]
            p = torch.softmax(logits.float(), -1)
            second = int(p.topk(2).indices[1])
            self.p_of_draft.append(float(p[second]))
            drafts.append([second])
        return Proposal(drafts, None)

    def release(self, seq_id):
        pass


def test_saturated_rows_are_not_treated_as_greedy(make_llm):
    """Sampled requests on a model whose softmax saturates to 1.0 in float32: a draft with p(d) ~ 1e-9 must be
    accepted with probability p(d), not always."""
    model = tiny_specd_model(tiny_hf_config_dict(), seed=5, dtype=torch.float32)
    with torch.no_grad():
        model.norm.weight.mul_(30.0)  # sharpen every distribution
    proposer = SecondChoiceProposer(model)
    llm = make_llm(_spec("ngram", 1, "fixed"), model=model, proposer=proposer, max_num_seqs=4)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    llm.generate(["hello world"] * 8, params)
    m = llm.get_metrics()["counters"]
    p = np.array(proposer.p_of_draft)
    assert m["draft_tokens"] == len(p) > 50
    # The case that matters is common here: drafts whose target probability is tiny but nonzero.
    assert ((p > 0) & (p < 1e-6)).sum() > 20
    expected = p.sum()  # q is one-hot at the draft, so each draft is accepted with probability p(d)
    assert m["accepted_tokens"] <= expected + 4 * np.sqrt(expected) + 3


def test_out_of_range_draft_ids_are_refused_naming_the_proposer(make_llm):
    class MinusOne(Proposer):
        name = "minus-one"

        def propose(self, seqs, num_draft_tokens):
            return Proposal([[-1] * k for k in num_draft_tokens], None)

        def release(self, seq_id):
            pass

    llm = make_llm(_spec("ngram", 2, "fixed"), proposer=MinusOne())
    out = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "error"
    assert "MinusOne" in out.extra["error"] and "outside [0, 320)" in out.extra["error"]


@pytest.mark.parametrize("slope_s", [0.0, 1.0])
def test_goodput_verifies_only_drafts_that_pay_and_stays_lossless(make_llm, monkeypatch, slope_s):
    plain = _plain(make_llm)
    llm = make_llm(_spec("ngram", 6, "goodput"), max_num_seqs=4)
    planner = llm.engine.speculator.k_policies["goodput"].planner
    assert planner is not None
    # Free verification keeps every draft; a second per extra token (vs ms-scale steps) makes none pay.
    monkeypatch.setattr(planner, "marginal_seconds", lambda base_tokens, max_extra: slope_s)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    metrics = llm.get_metrics()
    estimates = metrics["goodput_policy"]
    assert estimates["rate_tokens_per_s"] > 0
    if slope_s == 0.0:
        assert metrics["counters"]["drafts"] > 0 and estimates["accept_prob_by_bucket_and_position"]
    else:
        # Only the probes (one token after PROBE_INTERVAL steps cut to nothing) are verified.
        assert metrics["counters"]["draft_tokens"] == metrics["counters"]["drafts"]
        assert metrics["counters"]["drafts"] <= metrics["counters"]["steps"] * len(PROMPTS) // PROBE_INTERVAL


def test_goodput_override_needs_an_ngram_engine(make_llm):
    llm = make_llm(_spec("layerskip", 3, "fixed", draft_layers=1))
    params = SamplingParams(max_tokens=4, speculation=SpecOverride(k_policy="goodput"))
    with pytest.raises(Exception, match=r"speculation\.k_policy"):
        llm.generate(["hello"], params)
    ngram = make_llm(_spec("ngram", 3, "fixed"))
    out = ngram.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                 speculation=SpecOverride(k_policy="goodput")))
    assert [o.outputs[0].token_ids for o in out] == _plain(make_llm)
    assert ngram.get_metrics()["counters"]["drafts"] > 0


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_float32_packed_model_speculation_matches_plain_up_to_near_ties(make_llm, monkeypatch, policy):
    # float32 runs on oneDNN's packed weights, where 1 + k verification rows may round differently from one
    # decode row: every output must equal plain decoding, or first differ where plain's top two are tied.
    model = tiny_specd_model(tiny_hf_config_dict(), seed=3, dtype=torch.float32)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = make_llm(model=model).generate(PROMPTS, params)
    spec_llm = make_llm(_spec("ngram", 6, policy), model=model, max_num_seqs=4)
    if policy == "goodput":
        # goodput prices drafts from measured step times; on a loaded CI machine it may price every draft out
        # (it did once), and then no multi-row verification would be tested. Free verification keeps them.
        planner = spec_llm.engine.speculator.k_policies["goodput"].planner
        assert planner is not None
        monkeypatch.setattr(planner, "marginal_seconds", lambda base_tokens, max_extra: 0.0)
    spec = spec_llm.generate(PROMPTS, params)
    assert spec_llm.get_metrics()["counters"]["accepted_tokens"] > 0  # multi-row verification really ran
    matched = 0
    for p, s in zip(plain, spec):
        a, b = p.outputs[0].token_ids, s.outputs[0].token_ids
        if a == b:
            matched += 1
            continue
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top = p.outputs[0].logprobs[first].top
        assert abs(top[0][1] - top[1][1]) < 1e-3, (first, top)
    assert matched >= len(PROMPTS) - 1


# ------------------------------------------------------------------ penalties and logit_bias under speculation
def _injected_proposer(method, draft_model, tiny_model):
    """The proposer a test injects for `method` (None: built from the config), as in the greedy suite above."""
    if method == "draft":
        return DraftModelProposer(draft_model, 8, 256)
    if method in ("eagle", "hybrid"):
        eagle = EagleProposer(random_draft_head(tiny_model, 200), 8, 256)
        if method == "eagle":
            return eagle
        return HybridProposer(NgramProposer(NgramConfig(1, 4)), eagle, tiny_model.config.vocab_size, 2)
    return None


PENALISED = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, presence_penalty=0.8),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=0.6),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.4),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={5: 3.0, 17: -100.0}),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, presence_penalty=-0.5, frequency_penalty=0.2,
                   repetition_penalty=0.9, logit_bias={42: 1.5}),
]


@pytest.mark.parametrize("method", ["ngram", "layerskip", "draft", "eagle", "hybrid"])
def test_greedy_with_penalties_equals_plain_decoding_with_penalties(make_llm, draft_model, tiny_model, method):
    prompts = PROMPTS[: len(PENALISED)]
    plain = make_llm().generate(prompts, PENALISED)
    baseline = [o.outputs[0].token_ids for o in make_llm().generate(prompts, GREEDY)]
    # The penalties really change the output, or this test would prove nothing.
    assert sum(o.outputs[0].token_ids != b for o, b in zip(plain, baseline)) >= 3
    proposer = _injected_proposer(method, draft_model, tiny_model)
    spec = _spec(method if proposer is None else "layerskip", 4, "fixed", draft_layers=1)
    llm = make_llm(spec, proposer=proposer, max_num_seqs=4)
    outs = llm.generate(prompts, PENALISED)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["counters"]["accepted_tokens"] > 0


def test_logit_bias_of_minus_100_bans_a_token_under_speculation(make_llm):
    plain = make_llm().generate(PROMPTS, GREEDY)
    banned = plain[0].outputs[0].token_ids[3]
    llm = make_llm(_spec("ngram", 4, "fixed"), max_num_seqs=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={banned: -100.0})
    outs = llm.generate(PROMPTS, params)
    assert all(banned not in o.outputs[0].token_ids for o in outs)


def test_logit_bias_token_outside_the_vocabulary_is_refused(make_llm):
    with pytest.raises(Exception, match="logit_bias"):
        make_llm().generate(["hi"], SamplingParams(max_tokens=2, logit_bias={10_000: 1.0}))


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_speculation_with_penalties_matches_penalised_target(tiny_vocab_models, method):
    """Chi-square like the test above, with presence/frequency/repetition penalties and a bias: the joint of
    tokens 2 and 3 must equal plain penalised sampling, computed exactly."""
    target, draft = tiny_vocab_models
    prompt = [1, 5, 3, 6]
    temperature = 0.9
    base = dict(max_tokens=3, temperature=temperature, ignore_eos=True, presence_penalty=0.9, frequency_penalty=0.5,
                repetition_penalty=1.3, logit_bias={2: 1.0})

    def probs(tokens):
        c = target.make_cache(1, 64)
        s = c.allocate()
        c.reserve(len(tokens))
        logits = target(ForwardBatch.build([tokens], [s], [0], [[len(tokens) - 1]]), c)
        adjusted = adjust_logits(logits, [SamplingParams(**base)], [1],
                                 [TokenHistory(prompt, tokens[len(prompt):])], [[]])
        return torch.softmax(adjusted[0].double() / temperature, -1).numpy()

    p1 = probs(prompt)
    joint = np.zeros((VOCAB, VOCAB))
    for t1 in range(VOCAB):
        p2 = probs([*prompt, t1])
        for t2 in range(VOCAB):
            joint[t2] += p1[t1] * p2[t2] * probs([*prompt, t1, t2])
    expected = joint.reshape(-1)
    proposer = DraftModelProposer(draft, 64, 64) if method == "draft" else None
    cfg = EngineConfig(speculation=SpeculationConfig(method="ngram" if method == "ngram" else "layerskip",
                                                     num_speculative_tokens=3, draft_layers=1),
                       max_num_seqs=64, max_model_len=64)
    llm = LLM.from_model(target, None, cfg, proposer=proposer)
    n = 4000
    outs = llm.generate(prompt_token_ids=[prompt] * n,
                        sampling_params=[SamplingParams(seed=i, **base) for i in range(n)])
    counts = np.zeros(VOCAB * VOCAB)
    for o in outs:
        _, t2, t3 = o.outputs[0].token_ids
        counts[t2 * VOCAB + t3] += 1
    m = llm.get_metrics()["counters"]
    assert 0 < m["accepted_tokens"] < m["draft_tokens"]
    exp = expected * n
    keep = exp >= 5
    _, pvalue = chisquare(np.append(counts[keep], counts[~keep].sum()), np.append(exp[keep], exp[~keep].sum()))
    assert pvalue > 0.001, f"penalised speculative samples differ from penalised sampling (p={pvalue:.2e})"


@pytest.mark.parametrize("per_row_s", [0.0, 1.0])
def test_adaptive_decides_k_before_a_model_proposer_drafts_and_stays_lossless(make_llm, monkeypatch, per_row_s):
    from specd.speculation.policies.step_cost import LocalCost

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # < PROBE_INTERVAL steps: no probes
    plain = _plain(make_llm, params=params)
    llm = make_llm(_spec("layerskip", 4, "adaptive", draft_layers=1), max_num_seqs=4)
    policy = llm.engine.speculator.k_policies["adaptive"]
    # Free verification: drafting pays; a second per extra row (vs ms-scale steps): plain decoding wins.
    monkeypatch.setattr(policy.forward, "at", lambda num_seqs, num_rows: LocalCost(0.01, per_row_s))
    # The measured draft forwards would be priced too (ms-scale next to the 10 ms step above): made free here.
    monkeypatch.setattr(policy.draft, "per_position", lambda num_drafting: 0.0)
    proposer = llm.engine.speculator.proposer
    asked: list[int] = []
    propose = proposer.propose

    def counting(seqs, num_draft_tokens):
        asked.extend(num_draft_tokens)
        return propose(seqs, num_draft_tokens)

    monkeypatch.setattr(proposer, "propose", counting)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    estimates = llm.get_metrics()["adaptive_policy"]
    if per_row_s:
        assert asked == [] and estimates["last_cause"] == "cost"  # the draft model was never run
        assert estimates["zero_k_sequence_steps"]["cost"] > 0
    else:
        assert asked and max(asked) == 4 and estimates["last_cause"] == "draft"


class OracleProposer(Proposer):
    """Proposes the plain greedy continuation itself (every draft would be accepted), or a wrong token at each
    position when `wrong` (none would)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong: bool) -> None:
        self.continuations = continuations
        self.wrong = wrong

    def propose(self, seqs, num_draft_tokens):
        drafts = []
        for seq, k in zip(seqs, num_draft_tokens, strict=True):
            prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
            done = len(seq.token_ids) - seq.num_prompt_tokens
            draft = self.continuations[prompt][done : done + k]
            drafts.append([(t + 1) % 320 for t in draft] if self.wrong else draft)
        return Proposal(drafts, None)

    def release(self, seq_id):
        pass


@pytest.mark.parametrize("wrong", [False, True])
def test_a_cut_draft_reports_whether_its_next_token_matched_and_the_metrics_ignore_it(make_llm, monkeypatch,
                                                                                     tokenizer, wrong):
    # Each draft is cut to half: where every kept token was accepted, the step's own next token is compared with
    # the cut one (greedy: equal exactly when verifying it would have accepted it). The metrics count only what
    # was verified.
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = _plain(make_llm, PROMPTS[:3], params)
    prompts = [tuple(tokenizer.encode(p)) for p in PROMPTS[:3]]
    llm = make_llm(_spec("ngram", 4, "fixed"), proposer=OracleProposer(dict(zip(prompts, plain)), wrong),
                   max_num_seqs=4)
    policy = llm.engine.speculator.k_policies["fixed"]
    monkeypatch.setattr(policy, "keep", lambda drafts, step: [d.num_tokens // 2 for d in drafts])
    reports = []
    observe = llm.engine.speculator.observe
    monkeypatch.setattr(llm.engine.speculator, "observe", lambda report: (reports.append(report), observe(report)))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)] == plain
    outcomes = [o for r in reports for o in r.outcomes]
    seen = [o for o in outcomes if o.next_matched is not None]
    assert seen and all(o.num_accepted == o.num_drafted for o in seen)
    assert {o.next_matched for o in seen} == {not wrong}
    counters = llm.get_metrics()["counters"]
    assert counters["draft_tokens"] == sum(o.num_drafted for o in outcomes)
    assert counters["accepted_tokens"] == sum(o.num_accepted for o in outcomes)


def test_the_engine_marks_the_first_step_after_a_prompt_chunk(make_llm, monkeypatch):
    # That step runs cold (the prompt path filled the caches), so it must not teach a k policy what a row costs.
    llm = make_llm(_spec("ngram", 4, "adaptive"))
    reports = []
    observe = llm.engine.speculator.observe
    monkeypatch.setattr(llm.engine.speculator, "observe", lambda report: (reports.append(report), observe(report)))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:2], params)  # both prompts prefill in the first step, then both decode
    assert [(r.decode_only, r.after_prompt, r.teaches_cost) for r in reports[:3]] == [
        (False, True, False), (True, True, False), (True, False, True)]
    assert reports[3:] and not any(r.after_prompt for r in reports[3:])
    reports.clear()
    llm.generate(PROMPTS[2:3], params)  # a later request: its prefill, then a cold first decode step again
    assert [(r.decode_only, r.after_prompt) for r in reports[:3]] == [(False, False), (True, True), (True, False)]
