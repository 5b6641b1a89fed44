"""Train a retrieval head for a target model on this machine's CPU.

Objective (why not the paper's): SpeContext (Sec 3-4) distils a next-token draft
(EAGLE-3) and relies on the draft's attention resembling the target's. Here the head
is fitted to the target's attention *directly*: at each training query position t,
the target's attention over the history, averaged over its layers and the query heads
of each KV head's group, restricted to the candidates a selection chooses from
(``[sink, t + 1 - window)``) and renormalised, is the distribution the head's scores
(softmax per query head, max over the group, as served) are trained to match
(cross-entropy). A single set of B positions per KV head serves every layer, and the
attention mass such a set covers, averaged over layers, is the sum of that averaged
distribution over the set: so the objective is the figure the head is judged by
(``sgl_spec.bench.head_fidelity``), and it needs far fewer examples than next-token
distillation, which this CPU could not afford at 4k+ tokens.

Inputs are EAGLE-3's (the target's embedding and its residual stream at three layers,
one position back), so the head is saved in the EAGLE-3 layout and loads like a real
draft. Initialisation: the head starts as the target's middle aux layer (its q/k
projections with that layer's input norm folded in, ``fc`` passing that layer's
stream through), i.e. as one real attention layer of the target, shifted by one
position, and training moves it toward all layers' average.

Steps: (1) run the target (Hugging Face transformers, bf16) over ``sequences``
chats from :mod:`.data`, keeping per sequence the aux hidden states and the averaged
attention rows of its query positions (never a full attention map); (2) fit the head
with Adam; (3) save. Progress bars on both.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from . import data, eagle3, rope
from .config import HeadConfig
from .model import HeadWeights, rms_norm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    sequences: int = 40
    min_tokens: int = 2048
    max_tokens: int = 6144
    epochs: int = 6
    lr: float = 2e-3
    sink: int = 4
    window: int = 64
    seed: int = 0
    held_out: int = 4  # sequences kept out of training; their loss is reported

    def __post_init__(self):
        if self.sequences <= self.held_out or self.held_out < 1:
            raise ValueError(f"sequences ({self.sequences}) must exceed held_out "
                             f"({self.held_out}) >= 1")
        if not 256 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 256 <= min_tokens ({self.min_tokens}) <= max_tokens "
                             f"({self.max_tokens})")
        if self.epochs < 1 or not self.lr > 0:
            raise ValueError(f"epochs ({self.epochs}) must be >= 1 and lr ({self.lr}) > 0")

    @classmethod
    def for_window(cls, window: int) -> TrainConfig:
        """The default run for a model of ``window`` positions: a 16k+ model (the opt-in
        long-context one) trains on 4k-12k-token chats, fewer of them."""
        if window >= 16384:
            return cls(sequences=24, min_tokens=4096, max_tokens=12288, held_out=3)
        return cls()

    @classmethod
    def quick(cls) -> TrainConfig:
        """A short run (CI, tests): a few sequences of ~1k tokens, two epochs."""
        return cls(sequences=6, min_tokens=768, max_tokens=1280, epochs=2, held_out=1)


@dataclass
class Example:
    ids: torch.Tensor  # [T] int64
    aux: torch.Tensor  # [T, n_aux, Ht] bf16: residual stream entering each aux layer
    queries: torch.Tensor  # [R] int64 query positions
    target: torch.Tensor  # [Hkv, R, T] fp32: mean over layers and group of attention


# ------------------------------------------------------------------ target pass


class Recorder:
    """An attention function for transformers that also keeps the target's attention
    rows at ``rows`` (query positions), group-averaged: summed over layers (``sum``,
    ``layers``), or each layer's (``per_layer``, when it is a list)."""

    def __init__(self):
        self.rows: torch.Tensor | None = None
        self.sum: torch.Tensor | None = None
        self.layers = 0
        self.per_layer: list[torch.Tensor] | None = None

    def start(self, rows, per_layer: bool = False) -> None:
        self.rows, self.sum, self.layers = rows, None, 0
        self.per_layer = [] if per_layer else None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, query, key, value, attention_mask,
                                     scaling=scaling, **kw)
        if self.rows is not None:
            hq, hkv, t = query.shape[1], key.shape[1], key.shape[2]
            q = query[0, :, self.rows].float() * (scaling or query.shape[-1] ** -0.5)
            k = key[0].float().repeat_interleave(hq // hkv, dim=0)  # [Hq, T, D]
            logits = q @ k.transpose(1, 2)  # [Hq, R, T]
            future = torch.arange(t)[None, :] > self.rows[:, None]
            p = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
            p = p.view(hkv, hq // hkv, *p.shape[1:]).mean(1)  # group mean [Hkv, R, T]
            if self.per_layer is not None:
                self.per_layer.append(p)
            else:
                self.sum = p if self.sum is None else self.sum + p
            self.layers += 1
        return out


def load_target(model_path: str):
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    rec = Recorder()
    AttentionInterface.register("sgl_spec_head_capture", rec)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # float32: the attention rows are training targets (precision), and CPUs without
    # native bfloat16 run bf16 GEMMs slower than float32 (sgl_spec.cpu).
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="sgl_spec_head_capture")
    model.eval()
    return model, AutoTokenizer.from_pretrained(model_path), rec


@torch.no_grad()
def capture(model, rec: Recorder, sample: data.Sample, aux_layers: tuple[int, ...]) -> Example:
    ids = torch.tensor(sample.ids)[None]
    rec.start(torch.tensor(sample.queries))
    # logits_to_keep=1: only the hidden states and attention rows are kept, and the LM head
    # over every position is a large share of a long pass on a big vocabulary
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    # hidden_states[i] is the stream entering decoder layer i (0: the embeddings).
    aux = torch.stack([out.hidden_states[i][0] for i in aux_layers], dim=1)
    target = rec.sum / rec.layers
    rec.rows = None
    return Example(ids[0], aux.to(torch.bfloat16), torch.tensor(sample.queries), target)


# ------------------------------------------------------------------ the head


def head_config(model) -> HeadConfig:
    c = model.config
    heads = c.num_attention_heads
    scaling = getattr(c, "rope_scaling", None) or {}
    theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    return HeadConfig(
        hidden_size=c.hidden_size, num_q_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", heads),
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        vocab_size=c.vocab_size, target_hidden_size=c.hidden_size, rope_theta=float(theta),
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        max_position_embeddings=c.max_position_embeddings,
        rope_scaling=tuple(sorted((k, v) for k, v in scaling.items()
                                  if k in ("rope_type", "type", "factor",
                                           "original_max_position_embeddings")
                                  and not (k in ("rope_type", "type") and v == "default"))),
        aux_layers=(2, c.num_hidden_layers // 2, c.num_hidden_layers - 3),
    )


class HeadModule(torch.nn.Module):
    """The head as a trainable module (the served math is ``model.RetrievalHead``)."""

    def __init__(self, cfg: HeadConfig, init: HeadWeights, embed: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        p = lambda t: torch.nn.Parameter(t.detach().clone().float())  # noqa: E731
        self.fc, self.hidden_norm, self.input_norm = p(init.fc), p(init.hidden_norm), p(init.input_norm)
        self.q_proj, self.k_proj = p(init.q_proj), p(init.k_proj)
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        inv, self.attn_factor = rope.inv_freq(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)

    def weights(self) -> HeadWeights:
        return HeadWeights(self.fc.data, self.hidden_norm.data, self.input_norm.data,
                           self.q_proj.data, self.k_proj.data)

    def loss(self, ex: Example, sink: int, window: int) -> torch.Tensor:
        c, h = self.cfg, self.cfg.hidden_size
        t = ex.ids.shape[0]
        e = rms_norm(self.embed[ex.ids], self.input_norm, c.rms_norm_eps)  # [T, H]
        ctx = rms_norm(ex.aux.float().flatten(1) @ self.fc.T, self.hidden_norm, c.rms_norm_eps)
        prev = torch.cat([ctx.new_zeros(1, h), ctx[:-1]])  # position j reads c_{j-1}
        pos = torch.arange(t)
        k = torch.cat([e, prev], -1) @ self.k_proj.T
        k = rope.apply(k.view(t, c.num_kv_heads, c.head_dim), pos, self.inv_freq, self.attn_factor)
        qi = ex.queries
        q = torch.cat([e[qi], prev[qi]], -1) @ self.q_proj.T
        q = rope.apply(q.view(-1, c.num_q_heads, c.head_dim), qi, self.inv_freq, self.attn_factor)
        g = c.group
        logits = torch.einsum("rkgd,tkd->kgrt", q.view(-1, c.num_kv_heads, g, c.head_dim), k)
        logits = logits * c.head_dim ** -0.5
        cols = pos[None, :]
        logits = logits.masked_fill((cols >= qi[:, None]), float("-inf"))  # keys < t
        s = torch.softmax(logits, dim=-1).amax(dim=1)  # [Hkv, R, T] served score
        cand = (cols >= sink) & (cols < (qi[:, None] + 1 - window))
        tgt = ex.target * cand
        tgt = tgt / tgt.sum(-1, keepdim=True).clamp(min=1e-9)
        s = s * cand
        s = s / s.sum(-1, keepdim=True).clamp(min=1e-9)
        keep = cand.any(-1)  # queries with candidates at all
        ce = -(tgt * torch.log(s.clamp(min=1e-9))).sum(-1)  # [Hkv, R]
        return ce[:, keep].mean()


def init_weights(model, cfg: HeadConfig) -> HeadWeights:
    """The target's middle aux layer as a head (see the module docstring)."""
    mid = cfg.aux_layers[1]
    layer = model.model.layers[mid]
    attn, ln = layer.self_attn, layer.input_layernorm.weight.detach().float()
    h = cfg.hidden_size
    fc = torch.zeros(h, len(cfg.aux_layers) * cfg.target_hidden_size)
    fc[:, h: 2 * h] = torch.eye(h)  # pass the middle layer's stream through
    zeros_q = torch.zeros(cfg.num_q_heads * cfg.head_dim, h)
    zeros_k = torch.zeros(cfg.num_kv_heads * cfg.head_dim, h)
    wq = attn.q_proj.weight.detach().float() * ln[None, :]
    wk = attn.k_proj.weight.detach().float() * ln[None, :]
    return HeadWeights(fc=fc, hidden_norm=torch.ones(h), input_norm=ln.clone(),
                       q_proj=torch.cat([zeros_q, wq], 1), k_proj=torch.cat([zeros_k, wk], 1))


# ------------------------------------------------------------------ the run


def train(model_path: str, out: str, tc: TrainConfig = TrainConfig(),
          progress: bool = True) -> dict:
    """Train and save a head for ``model_path`` into ``out``; returns its report."""
    from tqdm import tqdm

    t0 = time.time()
    torch.manual_seed(tc.seed)
    model, tok, rec = load_target(model_path)
    cfg = head_config(model)
    seqs = data.samples(tok, tc.sequences, (tc.min_tokens, tc.max_tokens), seed=tc.seed)
    examples = []
    for s in tqdm(seqs, desc="head: target attention", unit="seq", disable=not progress):
        examples.append(capture(model, rec, s, cfg.aux_layers))
    capture_s = time.time() - t0
    embed = model.get_input_embeddings().weight
    head = HeadModule(cfg, init_weights(model, cfg), embed)
    del model
    held, fit = examples[: tc.held_out], examples[tc.held_out:]
    evaluate = lambda: sum(head.loss(ex, tc.sink, tc.window).item()  # noqa: E731
                           for ex in held) / len(held)
    with torch.no_grad():
        before = evaluate()
    opt = torch.optim.Adam(head.parameters(), lr=tc.lr)
    steps = tc.epochs * len(fit)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    rng = random.Random(tc.seed)
    bar = tqdm(total=steps, desc="head: fitting", unit="step", disable=not progress)
    for _ in range(tc.epochs):
        order = list(range(len(fit)))
        rng.shuffle(order)
        for i in order:
            loss = head.loss(fit[i], tc.sink, tc.window)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update(1)
    bar.close()
    with torch.no_grad():
        after = evaluate()
    report = {"model": os.path.abspath(model_path), "config": asdict(tc),
              "held_out_loss_init": before, "held_out_loss": after,
              "capture_s": round(capture_s, 1), "total_s": round(time.time() - t0, 1),
              "tokens": sum(len(s.ids) for s in seqs)}
    eagle3.save(out, cfg, head.weights(), metadata=report)
    logger.info("retrieval head saved to %s (held-out loss %.3f -> %.3f)", out, before, after)
    return report
