"""Online vertical/slash line selection for one extend (LoopServe §5.2, Algorithm 2).

Per line head: sample some of the new queries, compute their exact causal attention
over all ``N+n`` keys (fp32 softmax), sum the sampled mass along every vertical line
(key column) and every slash line (offset ``q_pos - k_pos``), then add lines greedily
until the selected lines cover at least ``alpha`` of the sampled mass. The local band
(offsets ``0..local-1``) and the sink columns (``0..sink-1``) are always kept.

Sampling (Alg. 2 line 1, ``RandomSelect``): the last ``last_q`` queries plus
``strided_q`` queries evenly strided over the rest, deterministic. The last queries
see every key, including all the new ones (a vertical inside the new text is only
visible to queries after it), and they lead into generation, so lines they need
must not be missed (MInference estimates its patterns from the last 64 queries for
the same reason). The strided rows represent the earlier queries, whose lines the
last queries alone would miss (LoopServe's Key Point 2: where the question sits
matters). 64 + 64 rows cost ``128 * (N+n) * D`` multiply-adds per head, about 2% of a
dense 6k-over-6k prefill; every row is sampled when ``n <= last_q + strided_q``.

Granularity: one line set per KV head by default (``per_kv_head``): the group's
query heads share the KV head's keys, so one set serves them all and one index is
built per KV head; the group's sampled attention is averaged (each row still sums
to 1). ``per_kv_head=False`` selects per query head.

Greedy (Alg. 2 lines 6-16): a line's value is its *marginal* sampled mass (the
mass of its cells not already covered by selected lines of the other kind: a slash
and a vertical share one cell per query) divided by its marginal cost (its cells in
the full ``[n, N+n]`` extend matrix not already covered), the ``Δw / (l - overlap)``
rule of Alg. 2 line 11, evaluated over all candidates rather than only the heads of
the two weight-sorted lists. To stay practical it runs in rounds: each round
recomputes the exact marginal gains and costs of every line with a few dense ops on
the sampled ``[S, N+n]`` matrix, ranks by gain/cost and takes the shortest prefix
whose summed gains reach the remaining deficit, capped at ``max_lines_per_round``
lines in the first round and twice as many each round after (so diffuse heads that
need thousands of lines finish in a handful of rounds).
Within a round gains ignore overlaps among the round's own picks, so they are upper
bounds: a round never overshoots the deficit by more than its last line, and the
loop only stops once the *measured* coverage of the union reaches ``alpha``, so the
guarantee on the sampled attention is exact.

Seeds (LoopServe §5.2, reuse across turns): lines selected for an earlier extend of
the same sequence (verticals are absolute key positions, still valid because that
KV is now the cached prefix; slashes are offsets) can be passed as ``seeds``. In the
first round every seed line whose sampled mass per sampled cell is above the
uniform level (``total / sampled causal cells``) is taken before the ranked
candidates, best value first and only up to the deficit; stale or useless seeds
thus fail the filter and cost nothing. Seeds add no round: they replace part of
the first round's picks, so heads whose earlier lines still carry their mass
finish in fewer rounds, and lines the current sample underrates but an earlier
turn needed are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lines import LineSet, check_inputs
from .reference import line_mask


@dataclass(frozen=True)
class SelectConfig:
    # Sampled-mass fraction to cover (§6.3.1 finds 0.98-1.0 safe). No default: the
    # served one is sgl_spec.config.PrefillConfig.alpha, the one source of defaults.
    alpha: float
    local: int = 64  # offsets 0..local-1 always selected (the local band)
    sink: int = 4  # key columns 0..sink-1 always selected (attention sinks)
    last_q: int = 64  # sampled: the last last_q queries ...
    strided_q: int = 64  # ... plus strided_q evenly strided earlier ones
    per_kv_head: bool = True  # one line set per KV head (else per query head)
    max_lines_per_round: int = 64  # greedy lines added in the first round; doubles

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        for name in ("local", "sink", "last_q", "strided_q"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.last_q + self.strided_q < 1:
            raise ValueError("last_q + strided_q must be >= 1 (no query sampled)")
        if self.max_lines_per_round < 1:
            raise ValueError(
                f"max_lines_per_round must be >= 1, got {self.max_lines_per_round}"
            )


def sample_queries(n: int, config: SelectConfig) -> torch.Tensor:  # [S] int64, sorted
    """Row indices (0-based among the ``n`` new queries) that the selection samples."""
    if n <= config.last_q + config.strided_q:
        return torch.arange(n)
    head = n - config.last_q
    strided = torch.linspace(0, head - 1, config.strided_q).round().long()
    return torch.unique(torch.cat([strided, torch.arange(head, n)]))


def sampled_attention(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D]
    history_len: int,
    rows: torch.Tensor,  # [S] int64 query rows
    scale: float | None = None,
    per_kv_head: bool = True,
) -> torch.Tensor:  # [H_l, S, N+n] float32, CPU; zero at non-causal cells
    """Causal fp32 attention probabilities of the sampled rows, per line head."""
    dims = check_inputs(q, k, None, None, history_len)
    scale = dims.head_dim**-0.5 if scale is None else scale
    g = dims.group
    pos = history_len + rows.to(q.device)  # [S]
    noncausal = torch.arange(dims.num_keys, device=q.device)[None, :] > pos[:, None]
    # 16-bit inputs (the KV cache's dtype) multiply in 16 bits, faster than fp32 on a
    # CPU with native bfloat16. The scores round to bf16 (2^-9 of each score), which
    # moves a probability by a few percent at most for the largest logits: the
    # selection ranks line masses of a sample, and its coverage guarantee holds on
    # the probabilities it computed. The softmax is fp32.
    half = (torch.float16, torch.bfloat16)
    gemm = q.dtype if q.dtype in half and k.dtype == q.dtype else torch.float32
    out = []
    for kvh in range(dims.num_kv_heads):  # one KV head at a time bounds the memory
        qs = q[rows.to(q.device), kvh * g : (kvh + 1) * g].to(gemm)  # [S, g, D]
        kh = k[:, kvh].to(gemm).contiguous()  # [K, D]
        # One 2-D GEMM against K^T as a view (no permuted copy of the scores).
        qs = qs.transpose(0, 1).reshape(-1, qs.shape[-1])  # [g*S, D]
        scores = (qs @ kh.t()).view(g, -1, dims.num_keys).float().mul_(scale)  # [g, S, K]
        p = torch.softmax(scores.masked_fill_(noncausal, float("-inf")), dim=-1)
        if per_kv_head:
            out.append(p.mean(0, keepdim=True))
        else:
            out.append(p)
    return torch.cat(out).cpu()


def _span_count(prefix: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Selected entries in ``[lo, hi)`` given ``prefix = [0, cumsum(selected)]``."""
    top = prefix.numel() - 1
    return prefix[hi.clamp(0, top)] - prefix[lo.clamp(0, top)]


def greedy_lines(
    attn: torch.Tensor,  # [S, N+n] float32 sampled probabilities (0 at non-causal cells)
    pos: torch.Tensor,  # [S] int64 absolute query positions of the rows, sorted
    n: int,
    history_len: int,
    config: SelectConfig,
    seed: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([n_v], [n_s]) int64 CPU
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One head's greedy selection. Returns ``(vertical, slash, sampled_coverage)``.

    ``seed``: candidate (vertical, slash) lines of an earlier extend, preferred in
    the first round when above the uniform mass level (module docstring).
    """
    num_s, num_keys = attn.shape
    cols = torch.arange(num_keys)
    # diag[r, d] = column of row r's cell on slash d; num_keys (a zero pad) if none.
    diag = pos[:, None] - cols[None, :]  # [S, K]
    diag[diag < 0] = num_keys
    # [S, K+1] float64 uncovered mass (float64: sums of ~1e6 small terms per round).
    rest = torch.cat([attn.double(), torch.zeros(num_s, 1, dtype=torch.float64)], dim=1)
    is_v = torch.zeros(num_keys, dtype=torch.bool)  # selected verticals, by column
    is_s = torch.zeros(num_keys, dtype=torch.bool)  # selected slashes, by offset
    # Cells of a line in the full extend matrix (columns and offsets share the formula).
    length = (n - (cols - history_len).clamp(min=0)).double()  # [K], >= 1
    lo, hi = history_len - cols, history_len + n - cols  # partner lines meeting a new query
    total = rest.sum()
    slack = (1.0 - config.alpha) * total  # uncovered mass we may leave

    def add(vert: torch.Tensor, slash: torch.Tensor) -> None:
        is_v[vert] = True
        is_s[slash] = True
        rest[:, vert] = 0.0
        rest.scatter_(1, diag[:, slash], 0.0)  # the pad column absorbs misses

    add(torch.arange(min(config.sink, num_keys)), torch.arange(min(config.local, num_keys)))
    cap = config.max_lines_per_round
    seed_mask = None  # [2K] bool: seed lines, verticals then slashes (first round only)
    if seed is not None:
        seed_mask = torch.zeros(2 * num_keys, dtype=torch.bool)
        seed_mask[seed[0][seed[0] < num_keys]] = True
        seed_mask[num_keys + seed[1][seed[1] < num_keys]] = True
        # Sampled cells of line c (column c or offset c): rows at positions >= c.
        seen = (num_s - torch.searchsorted(pos, cols)).double()  # [K]
        level = total / max(float((pos + 1).sum()), 1.0)  # mean mass per sampled cell
        seed_min_gain = torch.cat([seen, seen]) * level  # [2K]
    while True:
        remaining = rest.sum()
        if remaining <= slack:
            break
        gain_v = rest.sum(0)[:num_keys]  # [K]
        gain_s = rest.gather(1, diag).sum(0)  # [K]
        # Marginal cost: a vertical c meets slash d in a new query iff N <= c+d < N+n.
        cost_v = (length - _span_count(_prefix(is_s), lo, hi)).clamp(min=1.0)
        cost_s = (length - _span_count(_prefix(is_v), lo, hi)).clamp(min=1.0)
        gain = torch.cat([gain_v, gain_s])  # [2K]: verticals then slashes
        value = gain / torch.cat([cost_v, cost_s])
        value[torch.cat([is_v, is_s]) | (gain <= 0)] = -1.0
        n_cand = int((value > 0).sum())
        if n_cand == 0:  # nothing left adds mass (alpha = 1 up to rounding)
            break
        top = torch.topk(value, min(n_cand, cap)).indices
        if seed_mask is not None:  # first round: good seeds rank before the others
            good = (seed_mask & (value > 0) & (gain >= seed_min_gain)).nonzero().flatten()
            good = good[torch.argsort(value[good], descending=True)]
            top = torch.cat([good, top[~torch.isin(top, good)]])
            seed_mask = None
        need = (remaining - slack).reshape(1)
        take = int(torch.searchsorted(gain[top].cumsum(0), need)) + 1
        picked = top[:take]
        add(picked[picked < num_keys], picked[picked >= num_keys] - num_keys)
        cap *= 2  # rounds stay logarithmic in the number of lines
    coverage = 1.0 if total <= 0 else float((total - remaining) / total)
    return is_v.nonzero().flatten(), is_s.nonzero().flatten(), coverage


def _prefix(selected: torch.Tensor) -> torch.Tensor:  # [K+1] int64
    return torch.cat([torch.zeros(1, dtype=torch.long), selected.long().cumsum(0)])


def select_lines(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D], keys of history and new tokens
    history_len: int,
    config: SelectConfig,
    scale: float | None = None,  # default 1/sqrt(D)
    seeds: LineSet | None = None,  # an earlier extend's lines, same line heads
) -> LineSet:  # Hkv line heads (Hq with per_kv_head=False)
    """Algorithm 2 for every line head of one layer's extend; see the module docstring."""
    dims = check_inputs(q, k, None, None, history_len)
    rows = sample_queries(dims.n, config)
    attn = sampled_attention(q, k, history_len, rows, scale, config.per_kv_head)
    pos = history_len + rows
    vert, sl, cov = [], [], []
    if seeds is not None and seeds.num_heads != attn.shape[0]:
        raise ValueError(
            f"seeds have {seeds.num_heads} line heads, the selection {attn.shape[0]}"
        )
    for h in range(attn.shape[0]):
        seed = None if seeds is None else (seeds.vertical[h], seeds.slash[h])
        v_h, s_h, c_h = greedy_lines(attn[h], pos, dims.n, history_len, config, seed)
        vert.append(v_h)
        sl.append(s_h)
        cov.append(c_h)
    return LineSet(vert, sl, torch.tensor(cov, dtype=torch.float32))


def recovered_mass(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D]
    lines: LineSet,
    history_len: int,
    scale: float | None = None,
    rows_per_chunk: int = 128,
) -> torch.Tensor:  # [H_l] float32, CPU
    """Fraction of the FULL causal attention mass (all ``n`` queries) on the lines.

    Per query head it is the mean over rows of the dense softmax mass on selected
    cells; a line head reports the mean over its query heads. O(n (N+n)) work:
    an evaluation metric, not part of the serving path.
    """
    dims = check_inputs(q, k, None, lines, history_len)
    scale = dims.head_dim**-0.5 if scale is None else scale
    kf = k.float().repeat_interleave(dims.group, dim=1)  # [K, Hq, D]
    cols = torch.arange(dims.num_keys, device=q.device)
    mass = torch.zeros(dims.num_q_heads, dtype=torch.float64)
    for r0 in range(0, dims.n, rows_per_chunk):
        r1 = min(dims.n, r0 + rows_per_chunk)
        pos = torch.arange(history_len + r0, history_len + r1, device=q.device)
        scores = torch.einsum("rhd,khd->hrk", q[r0:r1].float(), kf) * scale
        p = torch.softmax(scores.masked_fill(cols > pos[:, None], float("-inf")), -1)
        mask = line_mask(lines, dims.n, history_len, (r0, r1)).to(q.device)
        mask = mask.repeat_interleave(dims.line_group, dim=0)  # [Hq, r, K]
        mass += (p * mask).sum((1, 2), dtype=torch.float64).cpu()
    frac = mass / max(dims.n, 1)
    return frac.view(lines.num_heads, dims.line_group).mean(1).float()
