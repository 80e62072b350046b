"""What clients send (issue 28), against real servers with the official `openai` client: logprobs checked against
the FP32 engine's own log-softmax (the first token comes from the prefill server, the rest from the decode
server), n choices from one prefill (the prefill server's /metrics count it), seeded choices that repeat, best_of,
penalties and logit_bias, echo. The session's real prefill + decode tritonservers (conftest `topology`, FP32 on
both sides by default) and a real frontend process; nothing is faked.
"""
import numpy as np
import pytest

from conftest import scrape, total
from test_openai import MODEL, _frontend

openai = pytest.importorskip("openai")
Q = "Name three colours."


@pytest.fixture(scope="module")
def client(topology, engine_dir):
    fe = _frontend(topology, engine_dir, topology.base_port + 81)
    yield openai.OpenAI(base_url=fe.spec.url, api_key="unused", max_retries=0, timeout=180)
    fe.stop()


@pytest.fixture(scope="module")
def fp32(engine_dir):
    from hetserve.engines.runtime import Engine

    return Engine(engine_dir, "prefill_fp32", threads=1)


def _chat_ids(tokenizer, text):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_chat_logprobs_are_the_fp32_log_softmax_on_both_sides(client, tokenizer, fp32):
    from hetserve.sampling import log_softmax

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": Q}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    prompt = _chat_ids(tokenizer, Q)
    gen = tokenizer.encode("".join(c.token for c in content))  # only to sanity-check the token strings
    assert gen
    ids = []
    for k, c in enumerate(content):
        logits, _, _ = fp32.prefill(prompt + ids)
        ref = log_softmax(logits)
        tok = int(np.argmax(ref))  # greedy: the sampled token is the argmax
        assert c.token == tokenizer.decode([tok], skip_special_tokens=False), f"token {k}"
        assert abs(c.logprob - ref[tok]) < 2e-3, f"token {k} ({'prefill' if k == 0 else 'decode'}): " \
                                                 f"{c.logprob} vs {ref[tok]}"
        top = np.argsort(-ref)[:5]
        assert [a.token for a in c.top_logprobs] == [tokenizer.decode([int(t)], skip_special_tokens=False)
                                                     for t in top]
        assert np.allclose([a.logprob for a in c.top_logprobs], ref[top], atol=2e-3)
        assert c.bytes == list(c.token.encode())
        ids.append(tok)


def test_stream_logprobs_match_the_whole_answer(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": Q}], max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs:
            streamed += ch.choices[0].logprobs.content
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in whole]


def test_completions_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) == 3 for t in lp.top_logprobs)
    assert all(max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    e = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  echo=True)
    assert e.choices[0].text == "The capital of France is" + r.choices[0].text


def test_echo_logprobs_score_the_prompt_on_the_prefill_side(client, tokenizer, fp32):
    """What lm-eval's loglikelihood tasks send: echo + logprobs; the prompt's tokens get the FP32 engine's
    logprobs (the first token none), then the answer's; streamed the same."""
    from hetserve.sampling import log_softmax

    prompt = "The quick brown fox jumps over the lazy dog because"
    ids = tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        logits, _, _ = fp32.prefill(ids[:j])
        ref = log_softmax(logits)
        assert abs(lp.token_logprobs[j] - ref[ids[j]]) < 2e-3, f"prompt token {j}"
        assert len(lp.top_logprobs[j]) == 2 and max(lp.top_logprobs[j].values()) >= lp.token_logprobs[j] - 1e-6
    assert "".join(lp.tokens[:len(ids)]) == prompt and lp.text_offset[len(ids)] == len(prompt)
    streamed = [c for ch in client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                                      echo=True, logprobs=2, stream=True)
                for c in ch.choices if c.logprobs]
    toks = [t for c in streamed for t in c.logprobs.tokens]
    vals = [v for c in streamed for v in c.logprobs.token_logprobs]
    assert toks == lp.tokens and vals[0] is None and np.allclose(vals[1:], lp.token_logprobs[1:], atol=1e-5)


def test_n_choices_come_from_one_prefill_and_repeat_with_a_seed(client, topology):
    def prefills():  # base + 2: the prefill server's metrics port
        return total(scrape(topology.base_port + 2), "hetserve_prefill_requests_total")

    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
              max_tokens=12, temperature=1.0, seed=1234, n=4)
    before = prefills()
    r = client.chat.completions.create(**kw)
    assert prefills() - before == 1  # four choices, one prefill (the KV was sent once and forked on decode)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # each choice draws its own random stream
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts
    # streamed: every choice's chunks carry its index and each ends with its finish reason
    got, reasons = {}, {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [got[i] for i in range(4)] == texts and sorted(reasons) == [0, 1, 2, 3]


def test_best_of_returns_the_most_likely_choice(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7,
                                  n=1, best_of=3, logprobs=0)
    assert len(r.choices) == 1
    allc = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0,
                                     seed=7, n=3, logprobs=0)
    best = max(allc.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert r.choices[0].text == best.text
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, best_of=1)


def test_logit_bias_and_penalties_change_the_tokens(client, tokenizer):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    first = tokenizer.encode(base.choices[0].text)[0]
    banned = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].text)[:1] != [first]
    forced = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0,
                                       logit_bias={"42": 100})
    assert tokenizer.encode(forced.choices[0].text) == [42, 42, 42] or forced.choices[0].text == \
        tokenizer.decode([42, 42, 42])
    rep = client.completions.create(model=MODEL, prompt="la la la la la la", max_tokens=12, temperature=0)
    pen = client.completions.create(model=MODEL, prompt="la la la la la la", max_tokens=12, temperature=0,
                                    frequency_penalty=2.0, presence_penalty=2.0,
                                    extra_body={"repetition_penalty": 1.5})
    assert pen.choices[0].text != rep.choices[0].text
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, presence_penalty=3.0)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"99999999": 1})


def test_triton_llm_n_choices_and_logprobs_over_grpc(topology):
    """The same on the Triton `llm` model (TensorRT-LLM's input/output names): num_return_sequences streams each
    choice's responses with its sequence_index; return_log_probs adds output_log_probs per token."""
    from hetserve.client import GenerationError, stream

    got, lps, reasons = {}, {}, {}
    for c in stream(topology.prefill_grpc, "Tell me a joke.", max_tokens=6, temperature=1.0, seed=5,
                    num_return_sequences=3, return_log_probs=True):
        got.setdefault(c.index, []).extend(c.token_ids)
        lps.setdefault(c.index, []).extend(c.logprobs or [])
        if c.finish_reason:
            reasons[c.index] = c.finish_reason
    assert sorted(got) == [0, 1, 2] and sorted(reasons) == [0, 1, 2]
    assert all(len(lps[i]) == len(got[i]) and all(v <= 0 for v in lps[i]) for i in got)
    with pytest.raises(GenerationError, match="stream=true"):
        list(stream(topology.prefill_grpc, "x", max_tokens=2, num_return_sequences=2, stream=False))
