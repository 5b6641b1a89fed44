"""The watershed layer L_w (Round Attention, Sec. 3.1 Observation 2 and Appendix B).

For a conversation of rounds 1..n-1 and a new question (round n), each layer l gives a
distribution P^l over the earlier rounds: the last query token's attention mass on each
round's tokens, normalised over them. Past some layer these distributions agree: for
each layer i, the mean KL divergence KL(P^i || P^j) over the later layers j > i drops
and stays low. L_w is the first *significant* local minimum of that curve.

Counting follows the paper (Table 5's 11 of 24 for Qwen2.5-0.5B; Eq. 2's L_w / L):
layers 1..L_w keep every round's KV on the device, and the round selection reads layer
L_w's attention. The curve is indexed by 0-based layer; a minimum at index i is
L_w = i + 1.

Beside the curve, each conversation's question asks for the fact of one earlier round, and
the profile records, per layer, where the selection's score (``select.round_scores``: each
KV group's largest probability on one of the round's keys over the question's tokens,
summed) ranks that round, and the share
of conversations in which it is among the top tenth (``recall``): what a question that
needs one round would keep, were the selection made there.

Rounds are those of the turn tags (``sgl_spec.cache.segment``: a round steps at each
user turn, the system prompt is round 0). Round 0 is left out of the distribution: a
server always keeps it (and its first tokens are an attention sink at every layer,
which would make all layers look alike), as it keeps the current round.

    python -m sgl_spec.calibrate watershed [--model-path DIR] [--quick]
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from sgl_spec import envs, jsonfile

from .select import STRATEGIES, round_scores, select, strategy

logger = logging.getLogger(__name__)

_FORMAT = 4  # 2: the recall per layer; 3: ranked by the peak score; 4: adaptive clipped
EPS = 1e-6  # added to every round's mass before the KL: empty rounds have log 0


@dataclass(frozen=True)
class WatershedConfig:
    """What the calibration plays: ``conversations`` chats of ``rounds`` (lo, hi) rounds
    of ``round_tokens`` (lo, hi) prose tokens each (``sgl_spec.rounds.conversations``);
    ``significance``: a local minimum counts where it lies within this share of the
    curve's range above its lowest value, after a drop of the rest (``find_watershed``)."""

    conversations: int = 16
    rounds: tuple[int, int] = (12, 24)
    round_tokens: tuple[int, int] = (60, 160)
    significance: float = 0.25
    seed: int = 0

    def __post_init__(self):
        if self.conversations < 1 or not 2 <= self.rounds[0] <= self.rounds[1]:
            raise ValueError(f"need conversations >= 1 and 2 <= rounds lo <= hi; got "
                             f"{self.conversations}, {self.rounds}")
        if not 0 < self.significance < 1:
            raise ValueError(f"significance must be in (0, 1), got {self.significance}")

    @classmethod
    def quick(cls) -> WatershedConfig:
        """Three short conversations: seconds, for tests."""
        return cls(conversations=3, rounds=(6, 8), round_tokens=(40, 80))


def round_spans(ids: list[int], fmt) -> list[tuple[int, int]]:
    """[start, end) of rounds 1..n-1 in ``ids`` (a chat whose last round is the new
    question): the earlier rounds a question can select. ``fmt``: the model's
    ``TurnFormat``."""
    from sgl_spec.cache.segment import segment

    bounds: dict[int, list[int]] = {}
    for span in segment(ids, fmt):
        b = bounds.setdefault(span.tag.round, [span.start, span.end])
        b[0], b[1] = min(b[0], span.start), max(b[1], span.end)
    last = max(bounds)
    return [tuple(bounds[r]) for r in sorted(bounds) if 0 < r < last]


def round_mass(p: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """``p`` [T] fp32 (one query's attention over T positions) summed over each span and
    normalised over the spans: [len(spans)] fp32, sums to 1."""
    m = torch.stack([p[a:b].sum() for a, b in spans]).clamp_min(0)
    return m / m.sum().clamp_min(1e-30)


def asked_rank(p: torch.Tensor, spans: list[tuple[int, int]], asked: int) -> int:
    """Where the selection's score ranks round ``asked`` (0-based into ``spans``) at one
    layer: 1 = first. ``p`` [Hkv, n, T]: the question's n queries' attention,
    group-averaged (``head.train.Recorder``)."""
    peak = torch.stack([p[..., a:b].amax(-1) for a, b in spans], dim=-1)  # [Hkv, n, R]
    score = round_scores(peak, [[i] for i in range(len(spans))])
    return int((score > score[asked]).sum()) + 1


SCORES = ("peak", "mass")  # the served score; each query's mass on a round, which it replaced


def kept(p: torch.Tensor, spans: list[tuple[int, int]], asked: int, recent: int = 1
         ) -> dict[str, dict[str, bool]]:
    """Whether each strategy keeps round ``asked`` (0-based into ``spans``; with the last
    ``recent`` rounds and the most attended one, as a server does), per score: the peak
    (``select.round_scores``) and the mass. ``p`` as ``asked_rank``'s."""
    out = {}
    for name in SCORES:
        per = [p[..., a:b].amax(-1) if name == "peak" else p[..., a:b].sum(-1)
               for a, b in spans]
        score = round_scores(torch.stack(per, dim=-1), [[i] for i in range(len(spans))])
        share = score / score.sum().clamp_min(1e-30)
        out[name] = {s: asked in select(share, strategy(s), recent) for s in STRATEGIES}
    return out


def strategy_recall(kepts: list[list[dict]]) -> dict[str, dict[str, list[float]]]:
    """Per score and strategy, per layer, the share of conversations whose asked round it
    keeps, from ``kept`` per conversation and layer."""
    n = len(kepts)
    if not kepts:
        return {}
    layers = range(len(kepts[0]))
    return {sc: {st: [sum(k[layer][sc][st] for k in kepts) / n for layer in layers]
                 for st in STRATEGIES} for sc in SCORES}


def recall(ranks: list[list[int]], rounds: list[int], fraction: float = 0.10) -> list[float]:
    """Per layer, the share of conversations whose asked round ranks within the top
    ``fraction`` of their earlier rounds (at least one): the ``topk`` strategy's pick."""
    import math

    if not ranks:
        return []
    tops = [max(1, math.ceil(fraction * r)) for r in rounds]
    return [sum(rk[layer] <= t for rk, t in zip(ranks, tops, strict=True)) / len(ranks)
            for layer in range(len(ranks[0]))]


MIN_RECALL = 0.75  # the selection's recall at L_w below which a server serves exact


def weak_selection(prof: dict, how: str = "topk", bar: float = MIN_RECALL) -> str | None:
    """Why selecting with strategy ``how`` at the profile's L_w would lose what questions
    ask for (the share of the calibration's questions whose asked round it keeps there
    under ``bar``, naming the layer where that share is highest), or None. Profiles
    without per-strategy shares read the top-tenth recall."""
    lw = prof.get("watershed")
    rec = ((prof.get("strategy_recall") or {}).get("peak") or {}).get(how) \
        or prof.get("recall")
    if lw is None or not rec or rec[lw - 1] >= bar:
        return None
    best = max(range(len(rec) - 1), key=lambda i: (rec[i], -i))  # the last layer: no upper
    return (f"the selection ({how}) at L_w {lw} keeps the asked round for "
            f"{rec[lw - 1]:.0%} of the calibration's questions (under {bar:.0%}; highest "
            f"at layer {best + 1}: {rec[best]:.0%}; --spec-round-watershed N selects there)")


def mean_kl_to_later(P: torch.Tensor) -> torch.Tensor:
    """``P`` [L, R] fp32 (each layer's distribution over R rounds) -> [L - 1] fp32: for
    layer i, the mean over j > i of KL(P_i || P_j). (The last layer has no later one.)"""
    q = P.double() + EPS
    q = q / q.sum(dim=1, keepdim=True)
    logq = q.log()
    # kl[i, j] = sum_r q_i,r (log q_i,r - log q_j,r)
    kl = (q * logq).sum(1, keepdim=True) - q @ logq.T  # [L, L]
    L = P.shape[0]
    later = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    out = (kl * later).sum(1)[:-1] / later.sum(1)[:-1]
    return out.float()


def find_watershed(curve: list[float] | torch.Tensor, significance: float = 0.25) -> int | None:
    """The first significant local minimum of the mean-KL curve, as L_w (1-based: the
    minimum at 0-based index i gives i + 1); None when the curve has none.

    A local minimum: lower than the layer before it, not higher than the one after (the
    curve's last point needs only the first). Significant: within ``significance`` of
    the curve's range above its lowest value, and reached by a drop of at least
    ``1 - significance`` of the range from the highest point before it. So neither a
    ripple in the high part of the curve counts, nor a low start (first layers that
    agree with the later ones before the layers that disagree)."""
    c = [float(x) for x in curve]
    if len(c) < 3:
        return None
    lo, hi = min(c), max(c)
    if hi - lo <= 0:
        return None
    bar, drop = lo + significance * (hi - lo), (1 - significance) * (hi - lo)
    for i in range(1, len(c)):
        if c[i] < c[i - 1] and (i == len(c) - 1 or c[i] <= c[i + 1]) and c[i] <= bar \
                and max(c[:i]) - c[i] >= drop:
            return i + 1
    return None


def profile_path(model_path: str, wc: WatershedConfig = WatershedConfig()) -> str:
    """Where ``prepare`` keeps the model's watershed profile (the cache dir)."""
    key = [_FORMAT, os.path.abspath(model_path), dataclasses.asdict(wc)]
    return envs.keyed_path("watershed", model_path, key, suffix=".json")


def measure(model_path: str, wc: WatershedConfig = WatershedConfig(),
            progress: bool = True) -> dict:
    """Appendix B on ``wc``'s conversations, the model in transformers (float32).
    Returns the profile: the per-conversation curves, their mean, L_w (None: no
    significant minimum), the layer count and the mean per-layer distributions'
    entropy (how peaked the selection would be)."""
    import random

    from tqdm import tqdm

    from sgl_spec.cache.turn_format import derive
    from sgl_spec.head.train import load_target
    from sgl_spec.rounds.conversations import conversation

    model, tok, rec = load_target(model_path)
    fmt = derive(tok)
    layers = model.config.num_hidden_layers
    rng = random.Random(wc.seed)
    curves, tokens, sizes, ranks, kepts = [], [], [], [], []
    bar = tqdm(range(wc.conversations), desc="watershed: conversations", unit="conv",
               disable=not progress)
    for i in bar:
        conv = conversation(tok, rng.randint(*wc.rounds), wc.round_tokens,
                            seed=wc.seed * 1009 + i)
        text = tok.apply_chat_template(list(conv.messages), tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        spans = round_spans(ids, fmt)
        if len(spans) < 2:
            raise ValueError(f"the chat template of {model_path} yields {len(spans)} earlier "
                             "rounds for a multi-round chat: no watershed can be measured")
        rec.start(torch.arange(spans[-1][1], len(ids)), per_layer=True)  # the question
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        P = torch.stack([round_mass(p[:, -1].mean(0), spans) for p in rec.per_layer])
        ranks.append([asked_rank(p, spans, conv.asked - 1) for p in rec.per_layer])
        kepts.append([kept(p, spans, conv.asked - 1) for p in rec.per_layer])
        rec.per_layer = rec.rows = None
        curves.append(mean_kl_to_later(P).tolist())
        tokens.append(len(ids))
        sizes.append(len(spans))
        bar.set_postfix(tokens=len(ids), rounds=len(spans))
    mean = torch.tensor(curves).mean(0)
    return {"format": _FORMAT, "model": os.path.abspath(model_path), "layers": layers,
            "config": dataclasses.asdict(wc), "curve": mean.tolist(), "curves": curves,
            "tokens": tokens, "rounds": sizes, "asked_ranks": ranks,
            "recall": recall(ranks, sizes), "strategy_recall": strategy_recall(kepts),
            "watershed": find_watershed(mean, wc.significance)}


def prepare(model_path: str, wc: WatershedConfig = WatershedConfig(), force: bool = False,
            out: str | None = None) -> str:
    """Measure (once) and return the path of the model's watershed profile (JSON)."""
    path = out or profile_path(model_path, wc)
    if os.path.exists(path) and not force:
        return path
    prof = measure(model_path, wc)
    jsonfile.write_atomic(path, prof)
    logger.info("watershed of %s: L_w = %s of %d layers, saved to %s", model_path,
                prof["watershed"], prof["layers"], path)
    return path


def _checked(d: dict) -> dict:
    if len(d["curve"]) != d["layers"] - 1:
        raise ValueError(f"a curve of {len(d['curve'])} points for {d['layers']} layers")
    return d


def load(path: str) -> dict:
    """The profile ``prepare`` wrote; ValueError names what is wrong."""
    return jsonfile.read_versioned(path, _FORMAT, "watershed profile", _checked)
