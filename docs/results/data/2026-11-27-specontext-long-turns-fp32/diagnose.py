"""Where SpeContext B=1024 loses qa-0-5 / qa-0-13 turn 2 of the long-turns set: for each
query that emits a digit of exact's answer value, the rank of the value's occurrences in the
prompt by the head's score (per KV head; "top-1024" = inside the budget) and by the target's
layer-averaged attention (the best shared set), teacher-forced on exact's own answers.

    python docs/results/data/2026-11-27-specontext-long-turns-fp32/diagnose.py \
        docs/results/data/2026-11-27-specontext-long-turns-fp32/turns-sgl_spec-exact.json
"""
import json, sys, torch
torch.set_num_threads(2)
from sgl_spec.bench import dataset
from sgl_spec.head import eagle3
from sgl_spec.head.model import RetrievalHead
from sgl_spec.head.train import load_target
from sgl_spec.train_head import prepare
from sgl_spec.prepare_model import prepare as prep_model

mp = prep_model()
cfg, w, n_aux = eagle3.load(prepare(mp))
model, tok, rec = load_target(mp)
aux_layers = cfg.resolve_aux_layers(model.config.num_hidden_layers)
head = RetrievalHead(cfg, w, n_aux)
embed = model.get_input_embeddings().weight
convs = dataset.generate(dataset.DatasetConfig.preset("long-turns"), tok)
exact = json.load(open(sys.argv[1]))["chat"]
B, sink, window = 1024, 4, 64
for name in ("qa-0-5", "qa-0-13"):
    c = next(c for c in convs if c.name == name)
    t1, t2 = c.turns
    ex1 = next(t for t in exact if t["conversation"] == name and t["turn"] == 1)
    ex2 = next(t for t in exact if t["conversation"] == name and t["turn"] == 2)
    msgs = [{"role": "user", "content": t1.user_message},
            {"role": "assistant", "content": ex1["text"]},
            {"role": "user", "content": t2.user_message}]
    ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    ans = ex2["output_ids"][:16]
    full = torch.tensor(ids + ans)
    p0 = len(ids)
    # the value's first token in the answer and every occurrence in the prompt
    vt = tok.encode(" " + str(ex2["text"]).split(" is ")[1].split(".")[0], add_special_tokens=False)
    a_at = next(i for i in range(len(ans)) if ans[i:i + len(vt)] == vt)
    occ = [i for i in range(p0 - len(vt)) if ids[i:i + len(vt)] == vt]
    print(name, "history", p0, "value tokens", vt, tok.decode(vt), "answer step", a_at, "in prompt at", occ)
    rows = torch.arange(p0 - 1, p0 + len(ans))
    rec.start(rows, per_layer=True)
    with torch.no_grad():
        out = model(input_ids=full[None], output_hidden_states=True, use_cache=False)
    att = torch.stack(rec.per_layer)  # [L, Hkv, R, T]
    rec.start(None)
    aux = torch.stack([out.hidden_states[i][0] for i in aux_layers], 1)
    keys, qprev = head.over_sequence(full, aux, embed)
    T = full.shape[0]
    cols = torch.arange(T)
    for step in range(a_at, a_at + len(vt)):  # the query that emits the value's first token is at p0 + step - 1
        t = p0 + step - 1  # the query emitting answer token `step`
        r = t - (p0 - 1)
        p = att[:, :, r]  # [L, Hkv, T]
        q = head.queries(full[t:t + 1], torch.tensor([t]), qprev[t:t + 1], embed)
        s = head.scores(q, keys[None, :t], torch.tensor([t]))[0]
        s = torch.cat([s, s.new_zeros(s.shape[0], T - t)], -1)
        cand = (cols >= sink) & (cols < t + 1 - window)
        hs = s.masked_fill(~cand, -1)
        pm = p.mean(0).masked_fill(~cand, -1)
        for o in occ:
            span = list(range(o - 8, o + len(vt)))
            hr = [(hs[h] > hs[h, o]).sum().item() for h in range(hs.shape[0])]
            orr = [(pm[h] > pm[h, o]).sum().item() for h in range(pm.shape[0])]
            mass = p[:, :, o].mean().item()
            deep = p[-10:, :, o].mean().item()
            print(f"  step {step} query pos {t}: value at {o}: head rank per KV head {hr} (top-{B}: {[x < B for x in hr]}), "
                  f"oracle-shared rank {orr}; target mass on it all-layer mean {mass:.4f}, last 10 layers {deep:.4f}")
