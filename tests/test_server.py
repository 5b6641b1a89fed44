"""Real-server tests: sgl_spec.launch_server (exact mode) against stock sglang."""

from __future__ import annotations

import inspect

import openai
import pytest
import requests

# The largest top1-top2 logprob gap at which a greedy flip counts as a near tie (two
# bf16 ulps); the benchmarks' agreement figures use the same threshold.
from sgl_spec.bench.agreement import NEAR_TIE_NATS, first_divergence

pytestmark = pytest.mark.server

QUESTION = "What is the capital of France?"


def chatml(user: str, system: str | None = None) -> str:
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return text + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _doc(module_name: str, chars: int) -> str:
    module = __import__(module_name)
    return inspect.getdoc(module)[:chars]


# Five prompts of different lengths (roughly 20 to 1500 tokens).
PROMPTS = [
    chatml(QUESTION),
    chatml("List three primary colors."),
    chatml("Summarize this text in one sentence:\n" + _doc("textwrap", 600)),
    chatml("What does this module do?\n" + _doc("argparse", 2500)),
    chatml("Name one function described here.\n" + _doc("json", 5000)),
]


def generate(url: str, text, max_new_tokens: int = 24, **extra) -> list[dict]:
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        **extra,
    }
    resp = requests.post(url + "/generate", json=body, timeout=300)
    resp.raise_for_status()
    out = resp.json()
    return out if isinstance(out, list) else [out]


def top2_margin(url: str, prompt: str, output_prefix: list[int]) -> float:
    """top1 - top2 logprob of the next token after prompt + output_prefix."""
    tok = requests.post(url + "/tokenize", json={"prompt": prompt}, timeout=60).json()
    ids = tok["tokens"] + output_prefix
    out = generate(
        url, None, max_new_tokens=1, input_ids=ids, return_logprob=True,
        top_logprobs_num=2,
    )[0]
    (first, second) = out["meta_info"]["output_top_logprobs"][0][:2]
    return first[0] - second[0]


def assert_same_greedy(stock_url: str, prompt: str, stock: dict, spec: dict) -> None:
    a, b = stock["output_ids"], spec["output_ids"]
    if a == b:
        return
    j = first_divergence(a, b)
    margin = top2_margin(stock_url, prompt, a[:j])
    assert margin <= NEAR_TIE_NATS, (
        f"outputs diverge at token {j} with top-2 margin {margin:.3f} nats "
        f"(not a near-tie):\nstock: {stock['text']!r}\nspec:  {spec['text']!r}"
    )


def test_scheduler_sees_the_spec_config(spec_server):
    with open(spec_server.log_path) as f:
        log = f.read()
    line = next(ln for ln in log.splitlines() if "sgl_spec attention backend, config" in ln)
    assert '"disable": false' in line and '"mode": "exact"' in line
    assert "impl=SpecRadixCache" in log


def test_generate_answers_paris(spec_server):
    out = generate(spec_server.url, chatml(QUESTION))[0]
    assert "Paris" in out["text"]


def test_chat_completions_answers_paris(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}],
        temperature=0, max_tokens=24,
    )
    assert "Paris" in resp.choices[0].message.content


def test_second_turn_hits_the_cache(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none")
    messages = [
        {"role": "system", "content": "You answer briefly.\n" + _doc("textwrap", 1500)},
        {"role": "user", "content": "What is this text about?"},
    ]
    first = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=32
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Name one function it mentions."},
    ]
    second = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=32
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0.8 * first.usage.prompt_tokens  # the whole first turn is reused
    assert cached < second.usage.prompt_tokens


@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=lambda i: f"prompt{i}")
def test_greedy_equals_stock(stock_server, spec_server, index):
    prompt = PROMPTS[index]
    stock = generate(stock_server.url, prompt)[0]
    spec = generate(spec_server.url, prompt)[0]
    assert_same_greedy(stock_server.url, prompt, stock, spec)


def test_greedy_equals_stock_batched(stock_server, spec_server):
    """The four shorter prompts in one request: a ragged batch through extend and
    decode (the longest is checked alone above)."""
    prompts = PROMPTS[:4]
    stock = generate(stock_server.url, prompts)
    spec = generate(spec_server.url, prompts)
    assert len(stock) == len(spec) == len(prompts)
    for prompt, a, b in zip(prompts, stock, spec):
        assert_same_greedy(stock_server.url, prompt, a, b)


def test_greedy_equals_stock_with_cached_prefix(stock_server, spec_server):
    """A follow-up sharing a long cached prefix: sgl_spec's offset-causal extend."""
    base = "Answer briefly.\n" + _doc("argparse", 3000)
    for url in (stock_server.url, spec_server.url):
        generate(url, chatml("What is this about?", system=base), max_new_tokens=4)
    prompt = chatml("Which module is described?", system=base)
    stock = generate(stock_server.url, prompt)[0]
    spec = generate(spec_server.url, prompt)[0]
    assert spec["meta_info"]["cached_tokens"] > 500
    assert_same_greedy(stock_server.url, prompt, stock, spec)


def test_frontend_multi_turn(spec_server):
    import sglang as sgl

    @sgl.function
    def two_turns(s):
        s += sgl.user(QUESTION)
        s += sgl.assistant(sgl.gen("first", max_tokens=24, temperature=0))
        s += sgl.user("And what is the capital of Italy?")
        s += sgl.assistant(sgl.gen("second", max_tokens=24, temperature=0))

    backend = sgl.RuntimeEndpoint(spec_server.url)
    state = two_turns.run(backend=backend)
    assert "Paris" in state["first"]
    assert "Rome" in state["second"]
    assert state.get_meta_info("second")["cached_tokens"] > 0
