"""Teacher-forced sparse decode probe: for one turn of a harness set (the long-turns set
on the default model; PROBE_MODEL and PROBE_PRESET pick others), replay exact's
answer (its own history, float32, HF transformers) with each answer query attending
sink + a selection + window in every layer, and report where the argmax leaves exact's
tokens and by how much; beside it, the dense model's own top1 - top2 margin per step.

Selections: the retrieval head's top-B (one set for all layers, as served), the best
single set for all layers (top-B of the target's layer-averaged attention: an oracle),
one oracle set per group of layers, one per layer, each layer's top-B of the head's top-C
candidates (by this step's attention, the previous step's, or its group's first layer's),
the head's set with the first layers dense, and the head's set with the top of the
prompt's last-w head queries forced in.

    python probe.py ../2026-11-27-specontext-long-turns-fp32/turns-sgl_spec-exact.json \
        qa-0-5:2 THREADS ANSWER_TOKENS [VARIANT,SUBSTRINGS]
    PROBE_MODEL=qwen2.5-coder-0.5b PROBE_PRESET=long-context python probe.py \
        ../2026-11-27-specontext-qwen-full-exact/turns-sgl_spec-exact.json qa-0-3:2 2 31 \
        "head B=1024,head B=2048,oracle shared B=1024"

A name in VARIANT,SUBSTRINGS that is a variant's whole name picks that variant alone.
PROBE_HEAD=0 skips the head (no training where none is prepared): the oracle variants.
"""
import dataclasses, json, os, sys, time, torch
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from sgl_spec.bench import dataset
from sgl_spec.head import eagle3
from sgl_spec.head.model import RetrievalHead
from sgl_spec.head.train import load_target
from sgl_spec.train_head import prepare
from sgl_spec.prepare_model import prepare as prep_model

SINK, WINDOW = 4, 64

class Sparse:
    def __init__(self): self.rows = None; self.mask = None; self.rec = None
    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kw):
        out, w = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
        if self.rows is None:
            return out, w
        L = module.layer_idx
        hq, hkv, T = query.shape[1], key.shape[1], key.shape[2]
        g = hq // hkv
        scale = scaling or query.shape[-1] ** -0.5
        q = query[0, :, self.rows].float() * scale
        k = key[0].float().repeat_interleave(g, 0)
        v = value[0].float().repeat_interleave(g, 0)
        logits = q @ k.transpose(1, 2)  # [Hq, R, T]
        future = torch.arange(T)[None, :] > self.rows[:, None]
        logits = logits.masked_fill(future, float("-inf"))
        if self.rec is not None:
            p = torch.softmax(logits, -1).view(hkv, g, *logits.shape[1:]).mean(1)
            self.rec.append(p)
        if self.mask is not None:
            m = self.mask(L).repeat_interleave(g, 0)  # [Hq, R, T]
            logits = logits.masked_fill(~m, float("-inf"))
            o = torch.softmax(logits, -1) @ v
            out = out.clone()
            out[0, self.rows] = o.transpose(0, 1).to(out.dtype)
        return out, w

sp = Sparse()
AttentionInterface.register("probe", sp)
mp = prep_model(model=os.environ.get("PROBE_MODEL", "smollm2-135m"))
USE_HEAD = os.environ.get("PROBE_HEAD", "1") != "0"  # 0: the oracle variants only, no head
if USE_HEAD:
    cfg, w, n_aux = eagle3.load(prepare(mp))  # trains the head where none is prepared
model, tok, _ = load_target(mp)
model.config._attn_implementation = "probe"
for m in model.modules():
    if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
        m.config._attn_implementation = "probe"
if USE_HEAD:
    aux_layers = cfg.resolve_aux_layers(model.config.num_hidden_layers)
    head = RetrievalHead(cfg, w, n_aux)
embed = model.get_input_embeddings().weight
exact = json.load(open(sys.argv[1]))["chat"]
name, turn = sys.argv[2].split(":")
# qa-<seed>-<n>: the dataset's seed is in the conversation's name
preset = dataset.DatasetConfig.preset(os.environ.get("PROBE_PRESET", "long-turns"))
convs = dataset.generate(dataclasses.replace(preset, seed=int(name.split("-")[1])), tok)
turn = int(turn)
c = next(c for c in convs if c.name == name)
ex = {t["turn"]: t for t in exact if t["conversation"] == name}
msgs = []
for i in range(1, turn):
    msgs += [{"role": "user", "content": c.turns[i - 1].user_message}, {"role": "assistant", "content": ex[i]["text"]}]
msgs.append({"role": "user", "content": c.turns[turn - 1].user_message})
ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
ans = ex[turn]["output_ids"][:int(sys.argv[4]) if len(sys.argv) > 4 else 48]
full = torch.tensor(ids + ans)
p0, T = len(ids), full.shape[0]
rows = torch.arange(p0 - 1, T - 1)  # the queries emitting ans[0..]
print(f"{name} turn {turn}: history {p0}, answer {tok.decode(ans)!r}", flush=True)
L = model.config.num_hidden_layers

def run(mask, record=False):
    sp.rows, sp.mask, sp.rec = rows, mask, ([] if record else None)
    with torch.no_grad():
        # logits of the answer's rows only: over every position a 151k vocabulary
        # takes 9.5 GB at 15.7k tokens
        out = model(input_ids=full[None], output_hidden_states=record, use_cache=False,
                    logits_to_keep=len(rows) + 1)
    rec = sp.rec
    sp.rows = sp.mask = sp.rec = None
    return out, rec

t0 = time.time()
out, att = run(None, record=True)
att = torch.stack(att)  # [L, Hkv, R, T] dense
print(f"dense pass {time.time()-t0:.0f}s", flush=True)
if USE_HEAD:
    aux = torch.stack([out.hidden_states[i][0] for i in aux_layers], 1)
    keys, qprev = head.over_sequence(full, aux, embed)
dense_logits = out.logits[0, :len(rows)]
del out
ref = torch.tensor(ans)
agree_dense = (dense_logits.argmax(-1) == ref).float().mean().item()
print(f"HF dense argmax agrees with exact's tokens on {agree_dense:.2f}")
srt = dense_logits.sort(-1, descending=True).values
print("dense margin (top1 - top2) per step:", [round(float(x), 2) for x in (srt[:, 0] - srt[:, 1])])

def head_scores(t):  # [Hkv, T] scores of the query at position t
    q = head.queries(full[t:t + 1], torch.tensor([t]), qprev[t:t + 1], embed)
    s = head.scores(q, keys[None, :t], torch.tensor([t]))[0]
    return torch.cat([s, s.new_zeros(s.shape[0], T - t)], -1)

hs = torch.stack([head_scores(int(t)) for t in rows], 1) if USE_HEAD else None  # [Hkv, R, T]
cols = torch.arange(T)
cand = (cols[None, :] >= SINK) & (cols[None, :] < rows[:, None] + 1 - WINDOW)  # [R, T]
base = (cols[None, :] < SINK) | ((cols[None, :] >= rows[:, None] + 1 - WINDOW) & (cols[None, :] <= rows[:, None]))

def topk_mask(scores, B, forced=None):  # scores [Hkv, R, T] -> allowed [Hkv, R, T]
    s = scores.masked_fill(~cand[None], float("-inf"))
    if forced is not None:
        s = s.masked_fill(forced & cand[None], float("inf"))
    idx = s.topk(min(B, s.shape[-1]), -1).indices
    # B past the candidates (a short history): all of them, never a masked position
    m = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True) & (s > float("-inf"))
    return m | base[None]

def question_scores(wq):  # head's prompt-window queries, summed group-max softmax over [0, p0)
    acc = torch.zeros(keys.shape[1], T)
    for t in range(p0 - wq, p0):
        acc += head_scores(t)
    return acc

# name -> a builder of layer -> allowed [Hkv, R, T]; only the picked ones are built
def shared(m): return lambda l: m
def per_layer(ms): return lambda l: ms[l]
def refined(C, scores):  # the head's top-C; layer l keeps the top-1024 of them by scores(l)
    hc = topk_mask(hs, C)
    return per_layer([topk_mask(scores(l).masked_fill(~hc, float("-inf")), 1024) for l in range(L)])
def previous(a):  # each step's row replaced by the step before's (step 0 keeps its own)
    return torch.cat([a[:, :1], a[:, :-1]], 1)
def first_layers(G):  # layer -> the first layer of its group
    return {int(l): int(p[0]) for p in torch.arange(L).chunk(G) for l in p}
def groups(G):
    parts = torch.arange(L).chunk(G)
    gm = {int(l): topk_mask(att[p].mean(0), 1024) for p in parts for l in p}
    return lambda l: gm[l]
def first_dense(d):
    m = topk_mask(hs, 1024); f = torch.ones_like(m)
    return lambda l: f if l <= d else m
def question_set(wq, bq):
    qset = question_scores(wq).masked_fill(~(cols < p0 - WINDOW), float("-inf")).topk(bq, -1).indices
    forced = torch.zeros(keys.shape[1], T, dtype=torch.bool).scatter_(-1, qset, True)[:, None, :].expand(-1, len(rows), -1)
    return shared(topk_mask(hs, 1024, forced))

variants = {
    "oracle shared B=1024": lambda: shared(topk_mask(att.mean(0), 1024)),
    "oracle per-layer B=1024": lambda: per_layer([topk_mask(att[l], 1024) for l in range(L)]),
    **{f"oracle {G} layer groups B=1024": lambda G=G: groups(G) for G in (2, 3, 6)},
}
if USE_HEAD:
    for B in (1024, 2048):
        variants[f"head B={B}"] = lambda B=B: shared(topk_mask(hs, B))
    for C in (2048, 4096):
        variants[f"head C={C} per-layer top-1024"] = lambda C=C: refined(C, lambda l: att[l])
        variants[f"head C={C} per-layer top-1024 by the previous step"] = \
            lambda C=C: refined(C, lambda l: previous(att[l]))
        for G in (3, 6):
            variants[f"head C={C} {G} groups top-1024 by their first layer"] = \
                lambda C=C, G=G: refined(C, lambda l, f=first_layers(G): att[f[l]])
    for d in (0, 1, 2, 3):
        variants[f"head B=1024, layers <= {d} dense"] = lambda d=d: first_dense(d)
    for wq, bq in ((32, 256), (32, 512), (64, 256)):
        variants[f"head B=1024 + head question set {bq} (w={wq})"] = lambda wq=wq, bq=bq: question_set(wq, bq)
picks = sys.argv[5].split(",") if len(sys.argv) > 5 else None
only = [v for v in variants if picks is None or v in picks
        or any(x in v for x in picks if x not in variants)]
for name_v in only:
    t0 = time.time()
    o, _ = run(variants[name_v]())
    lg = o.logits[0, :len(rows)]
    top = lg.argmax(-1)
    diff = (top != ref).nonzero().flatten().tolist()
    ref_l = lg.gather(-1, ref[:, None])[:, 0]
    gap = (lg.max(-1).values - ref_l)
    first = diff[0] if diff else None
    s = f"{name_v:48s} {len(diff):2d}/{len(ans)} steps leave exact's token"
    if first is not None:
        s += f"; first at step {first}: {tok.decode([int(top[first])])!r} over {tok.decode([ans[first]])!r} by {gap[first]:.2f}"
    print(s + f" ({time.time()-t0:.0f}s)", flush=True)
