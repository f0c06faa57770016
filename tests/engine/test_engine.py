"""Engine core: continuous batching, chunked prefill, sampling controls, stop rules, errors, abort."""

import pytest

from specd.errors import InvalidParameterError, PromptTooLongError, QueueFullError
from specd.sampling.params import SamplingParams

PROMPTS = ["hello world, hello world", "abc", "the quick brown fox jumps over", "x" * 40, "Zebra"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_batch_equals_each_alone(make_llm):
    llm = make_llm(max_num_seqs=4)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    alone = [make_llm().generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone
    assert all(len(t) == 24 for t in together)


def test_chunked_prefill_matches_and_does_not_stall_decodes(make_llm):
    long_prompt = "a long prompt " * 12  # ~170 tokens with the byte tokenizer
    ref = make_llm().generate([long_prompt, "hi"], GREEDY)
    llm = make_llm(max_num_batched_tokens=16)
    out = llm.generate([long_prompt, "hi"], GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    # Start a decode, then a long prompt: the decode must get a token every step while the prompt is chunked.
    llm = make_llm(max_num_batched_tokens=16)
    short = llm.add_request("hi", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    llm.step()  # prefill of the short prompt (+ its first token)
    llm.add_request(long_prompt, GREEDY)
    for _ in range(5):
        deltas = {d.request_id: d for d in llm.step()}
        assert len(deltas[short].new_token_ids) == 1


def test_seed_reproduces_regardless_of_batch(make_llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = make_llm().generate(["abc"], params)[0].outputs[0].token_ids
    mixed = make_llm(max_num_seqs=4).generate(
        ["zzz", "abc", "hello"], [SamplingParams(max_tokens=16, temperature=1.0), params,
                                 SamplingParams(max_tokens=7, temperature=0.7, seed=9)]
    )[1].outputs[0].token_ids
    assert alone == mixed
    other = make_llm().generate(["abc"], SamplingParams(max_tokens=16, temperature=1.0, seed=4321))
    assert other[0].outputs[0].token_ids != alone


def test_max_tokens_and_stop_rules(make_llm):
    llm = make_llm()
    out = llm.generate(["abc"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    full = llm.generate(["abc"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].outputs[0]
    # Stop token id: the first occurrence of the 6th generated token ends generation there.
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate(["abc"], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == full.token_ids[: first + 1]
    # Stop string: cut the text before it.
    stop_str = full.text[8:11]
    assert stop_str
    out = llm.generate(["abc"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_str]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == full.text[: full.text.index(stop_str)]
    assert stop_str not in out.outputs[0].text
    incl = llm.generate(["abc"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_str],
                                               include_stop_str_in_output=True))[0]
    assert incl.outputs[0].text == full.text[: full.text.index(stop_str) + len(stop_str)]


def test_eos_finishes_with_stop(make_llm, tokenizer):
    llm = make_llm()
    full = llm.generate(["abc"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].outputs[0]
    # Make the 4th generated token an EOS by stop_token_ids-equivalent engine eos set.
    eos = full.token_ids[3]
    llm.engine.eos_token_ids = frozenset({eos})
    out = llm.generate(["abc"], SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    assert out.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]


def test_logprobs(make_llm):
    llm = make_llm()
    out = llm.generate(["abc"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 4
    for tok, lp in zip(out.outputs[0].token_ids, lps):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the top-1 token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.logprob <= 0


def test_too_long_prompt_and_invalid_values(make_llm):
    llm = make_llm(max_model_len=32)
    with pytest.raises(PromptTooLongError) as e:
        llm.generate(["y" * 40], GREEDY)
    assert e.value.field == "prompt" and "max_model_len" in str(e.value)
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens"), ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"),
                          ({"logprobs": 99}, "logprobs"), ({"stop": [""]}, "stop"),
                          ({"max_tokens": "3"}, "max_tokens")]:
        with pytest.raises(InvalidParameterError) as e:
            SamplingParams(**kwargs)
        assert e.value.field == field
    with pytest.raises(InvalidParameterError) as e:
        llm.generate(prompt_token_ids=[[1, 2, 10**6]], sampling_params=GREEDY)
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(InvalidParameterError):
        llm.generate([""], GREEDY)
    # The engine still works after the errors.
    assert llm.generate(["ok"], SamplingParams(max_tokens=3, temperature=0.0))[0].outputs[0].token_ids


def test_generate_failing_on_a_later_prompt_queues_nothing(make_llm):
    llm = make_llm(max_model_len=32)
    with pytest.raises(PromptTooLongError):
        llm.generate(["ok", "y" * 40], GREEDY)
    assert llm.engine.num_waiting == 0 and llm.engine.num_running == 0
    # The next call is not slowed by, nor gets the output of, the abandoned first prompt.
    out = llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2
    assert not llm.engine.has_unfinished()


def test_queue_limit(make_llm):
    llm = make_llm(max_num_seqs=1, max_waiting=2)
    assert llm.engine.queue_room() == 3  # one takes the free slot at the next step, two may wait
    for prompt in "abc":
        llm.add_request(prompt, GREEDY)
    with pytest.raises(QueueFullError):
        llm.add_request("d", GREEDY)
    llm.step()  # "a" runs now; "b" and "c" wait: still full
    with pytest.raises(QueueFullError):
        llm.add_request("d", GREEDY)


def test_abort_frees_kv_and_others_continue(make_llm):
    llm = make_llm(max_num_seqs=4)
    a = llm.add_request("abc", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    b = llm.add_request("hello", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    llm.step()
    llm.step()
    assert llm.engine.cache.num_used_slots == 2
    assert llm.abort(a)
    assert llm.engine.cache.num_used_slots == 1
    finals = {}
    while llm.engine.has_unfinished():
        for d in llm.step():
            if d.finished:
                finals[d.request_id] = d
    assert finals[a].finish_reason == "abort"
    assert finals[b].finish_reason == "length" and finals[b].num_output_tokens == 8
    assert llm.engine.cache.num_used_slots == 0
    assert not llm.abort("unknown")


def test_streaming_deltas_concatenate_to_output(make_llm):
    llm = make_llm()
    ref = llm.generate(["stream me"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    deltas = list(llm.stream("stream me", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    assert "".join(d.new_text for d in deltas) == ref.text
    assert [t for d in deltas for t in d.new_token_ids] == ref.token_ids
    assert deltas[-1].finished and deltas[-1].timings is not None and deltas[-1].timings.ttft_s is not None


def test_chat_uses_template(make_llm, tokenizer):
    llm = make_llm()
    msgs = [{"role": "user", "content": "hi there"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt == tokenizer.apply_chat_template(msgs)
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    with pytest.raises(InvalidParameterError):
        llm.chat([{"role": 3, "content": "x"}])



class _FailingDetokenizer:
    def push(self, ids):
        raise RuntimeError("detokenizer broke")

    def flush(self):
        return ""


def test_step_failure_keeps_the_final_delta_of_a_request_that_already_finished(make_llm):
    llm = make_llm(max_num_seqs=2)
    done = llm.add_request("abc", SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    bad = llm.add_request("hello", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    llm.engine._seqs[bad].detokenizer = _FailingDetokenizer()  # fails after `done` was committed
    finals = {d.request_id: d for d in llm.step() if d.finished}
    assert finals[done].finish_reason == "length" and finals[done].num_output_tokens == 1
    assert finals[done].spec_stats is not None
    assert finals[bad].finish_reason == "error" and "detokenizer broke" in (finals[bad].error or "")
    assert llm.engine.cache.num_used_slots == 0 and not llm.engine.has_unfinished()


def test_tight_token_budget_shrinks_k_instead_of_starving_sequences(make_llm, tiny_model):
    from specd.config import SpeculationConfig
    from specd.speculation.draft import DraftModelProposer

    # 4 sequences, k = 4, budget 6: prompts still get prefilled while others speculate, and once all decode,
    # every sequence gets a token each step.
    llm = make_llm(SpeculationConfig(method="layerskip", num_speculative_tokens=4), max_num_seqs=4,
                   max_num_batched_tokens=6, proposer=DraftModelProposer(tiny_model, 4, 256))
    ids = [llm.add_request(p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)) for p in PROMPTS[:4]]
    for _ in range(60):
        if not (llm.engine.scheduler.waiting or any(s.is_prefilling for s in llm.engine.scheduler.running)):
            break
        llm.step()
    assert not any(s.is_prefilling for s in llm.engine.scheduler.running)
    for _ in range(3):
        got = {d.request_id for d in llm.step() if d.new_token_ids}
        assert set(ids) <= got


def test_budget_must_cover_every_running_sequence():
    from specd.config import EngineConfig

    with pytest.raises(InvalidParameterError) as e:
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    assert e.value.field == "max_num_batched_tokens"


def test_generate_takes_prompts_or_token_ids_not_both(make_llm):
    with pytest.raises(InvalidParameterError) as e:
        make_llm().generate(["a"], GREEDY, prompt_token_ids=[[5, 6]])
    assert e.value.field == "prompts"
