"""Does a lost turn-2 answer come from the selection, or from turn 1's cached KV?

A sparse server caches the KV of its own decoded turn-1 answer (computed under sparse
attention). For each conversation this plays, on one running server: (cached) turn 1,
then turn 2 over the cached prefix, as the harness did; (fresh) the cache flushed, and
turn 2's whole prompt (turn 1's answer text as exact wrote it) prefilled in one go, so
every KV row of the history is a dense prefill's. Prints each answer against exact's.

    python fresh.py URL SEED EXACT_TURNS_JSON CONV[,CONV...]
"""
import dataclasses, json, sys, urllib.request
from sgl_spec.bench import chat_client, dataset
from sgl_spec.prepare_model import prepare as prep_model
from transformers import AutoTokenizer

url, seed, exact_path, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
mp = prep_model(model="qwen2.5-coder-0.5b")
tok = AutoTokenizer.from_pretrained(mp)
cfg = dataclasses.replace(dataset.DatasetConfig.preset("long-context"), seed=seed)
convs = {c.name: c for c in dataset.generate(cfg, tok)}
exact = {(t["conversation"], t["turn"]): t for t in json.load(open(exact_path))["chat"]}
client = chat_client.make_client(url)
model = client.models.list().data[0].id

def flush():
    urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST")).read()

def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))

for name in names:
    c = convs[name]
    u1, u2 = c.turns[0].user_message, c.turns[1].user_message
    e1, e2 = exact[(name, 1)], exact[(name, 2)]
    mt = 128
    flush()
    r1 = chat_client.stream_turn(client, model, [{"role": "user", "content": u1}], mt, name, 1)
    msgs = [{"role": "user", "content": u1}, {"role": "assistant", "content": r1.text},
            {"role": "user", "content": u2}]
    r2 = chat_client.stream_turn(client, model, msgs, mt, name, 2)
    flush()
    msgs[1]["content"] = e1["text"]
    f2 = chat_client.stream_turn(client, model, msgs, mt, name, 2)
    print(f"{name}: turn 1 {'= exact' if r1.output_ids == tuple(e1['output_ids']) else 'differs from exact'}", flush=True)
    for label, r in (("cached", r2), ("fresh", f2)):
        d = first_diff(r.output_ids, tuple(e2["output_ids"]))
        verdict = "= exact" if d is None else f"leaves exact at token {d}"
        print(f"  turn 2 {label:6s} (cached {r.cached_tokens:5d} of {r.prompt_tokens}): {verdict}: {r.text[:100]!r}", flush=True)
    print(f"  exact: {e2['text'][:100]!r}", flush=True)
