"""sgl_spec's serving options (the ``--spec-*`` flags): one frozen config of five parts.

``SpecConfig`` composes ``CacheConfig`` (radix cache), ``DecodeConfig`` (decode
attention), ``PrefillConfig`` (prefill attention), ``KrulConfig`` (compressed host
tier) and ``RoundConfig`` (Round Attention on the layer-tiered pool). Every default lives here, once,
and is the served default; each field's flag, help and valid values live in ``FLAGS``,
from which the launcher builds its argument group. The launcher validates the flags
and hands the config to sglang's spawned processes as JSON (``SGLSPEC_CONFIG``).

Kept free of heavy imports (no torch): the launcher rejects bad flags before sglang
loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from sgl_spec import envs

# Decode modes: "exact" (dense) and the selection policies of sgl_spec.sparse.
MODES = ("exact", "streaming", "snapkv", "loopserve", "specontext")
# How SpeContext's elastic loads reach the staging buffers (sgl_spec.attention.prefetch).
PREFETCH = ("auto", "inline", "thread", "stream")
# What the radix cache keeps of the KV that sparse decode steps wrote.
SPARSE_KV_CACHE = ("auto", "keep", "drop")
# Radix-cache eviction orders.
CACHE_EVICTIONS = ("lru", "turn")
# The radix tree's core: the turn-tagged one where a feature reads tags, or as asked.
TREE_CORES = ("auto", "compiled", "tagged")
# How sglang's DP controller picks a rank (--dp-size > 1): by cached prefix, or sglang's.
DP_DISPATCH = ("cache_aware", "sglang")
# --spec-decode-profile's values other than a file: measure once and cache, or none.
PROFILE_CHOICES = ("auto", "off")
# Prefill attention: "exact" (dense) or LoopServe's online vertical/slash lines.
PREFILL_MODES = ("exact", "loopserve")
# Round Attention's selection of earlier rounds (sgl_spec.rounds.select's registry).
ROUND_STRATEGIES = ("topk", "fixed", "adaptive")
# SpeContext's adaptive memory management (sgl_spec.tiers.offload): off, or Algorithm 2.
OFFLOAD = ("off", "auto")


class Flag(NamedTuple):
    """One ``--spec-*`` flag: where its value goes and what it accepts."""

    name: str
    section: str  # a part of SpecConfig (PARTS) or "" (SpecConfig itself)
    field: str
    kind: str  # "choice", "int", "fraction", "bool" or "path"
    help: str
    choices: tuple[str, ...] = ()
    lo: int = 0  # "int": the smallest valid value


FLAGS: tuple[Flag, ...] = (
    Flag("--spec-mode", "decode", "mode", "choice",
         "Decode attention mode. 'exact' is dense attention (the path every sparse mode "
         "falls back to); 'streaming' attends the sink and a recent window "
         "(StreamingLLM); 'snapkv' selects --spec-budget positions per KV head once, "
         "from the last prompt window (SnapKV); 'loopserve' reselects them from the "
         "last --spec-nd decoded queries (LoopServe Sec 5.3); 'specontext' selects them "
         "before every step with a retrieval head, one selection for all layers, and "
         "loads only what changed (SpeContext). Sparse modes run on CPU; on CUDA hosts "
         "decode stays exact, except specontext (serving on a GPU is not verified).",
         MODES),
    Flag("--spec-budget", "decode", "budget", "int",
         "Sparse modes: history positions selected per KV head and layer (B).", lo=1),
    Flag("--spec-sink", "decode", "sink", "int",
         "Sparse modes: first positions always attended (attention sink).", lo=0),
    Flag("--spec-window", "decode", "window", "int",
         "Sparse modes: last positions always attended (recent window).", lo=1),
    Flag("--spec-nd", "decode", "nd", "int",
         "loopserve: reselection interval in decode steps, and the number of recent "
         "decoded queries that score the history.", lo=1),
    Flag("--spec-lookahead", "decode", "lookahead", "int",
         "loopserve: each history position is scored by its attention mass plus the "
         "largest mass among itself and the N positions before it, so the selection keeps "
         "what follows an attended token before the answer reads it (0: LoopServe's own "
         "score, Eq. 7).", lo=0),
    Flag("--spec-prompt-seed", "decode", "prompt_seed", "bool",
         "loopserve: the decode steps before the first selection (step 16) attend what the "
         "prompt's last --spec-window queries select at the end of its prefill (scored as "
         "a reselection scores), instead of the whole history: no dense steps, and more "
         "answers differ from exact's (docs/sparse-decode.md)."),
    Flag("--spec-min-context", "decode", "min_context", "int",
         "Sparse modes: histories shorter than this decode exactly (as do histories "
         "that budget + sink + window cover).", lo=0),
    Flag("--spec-decode-profile", "decode", "profile_path", "path",
         "Sparse modes: where a sparse decode step is faster than an exact one on this "
         "host. 'auto': the profile of this host, model, dtype and --spec-* decode flags "
         "('python -m sgl_spec.calibrate decode'), measured once at the first start (a "
         "progress bar; a few minutes) and kept in the cache dir; 'off': --spec-min-context "
         "alone; or a profile file. Histories shorter than the profile's crossover decode "
         "exactly, and every history does where the sparse mode was faster at no measured "
         "length (the server then decodes as --spec-mode exact). GET /sgl_spec/cache "
         "('decode') says which rows decode sparse and why."),
    Flag("--spec-dense-layers", "decode", "dense_layers", "int",
         "Sparse modes: the first N layers attend the whole history, the others their "
         "selection (layer 0's attention is the most spread out: docs/sparse-decode.md).",
         lo=0),
    Flag("--spec-draft-path", "decode", "draft_path", "path",
         "specontext: the retrieval head, an EAGLE-3 draft checkpoint directory "
         "(LlamaForCausalLMEagle3, as for --speculative-draft-model-path) or one written "
         "by 'python -m sgl_spec.train_head'. Empty: the head trained for --model-path, "
         "prepared once into the cache dir."),
    Flag("--spec-prefetch", "decode", "prefetch", "choice",
         "specontext: how each step's changed KV rows reach the staging buffers. 'inline' "
         "copies a layer's rows right before its attention; 'thread' copies every layer's "
         "from a worker thread while earlier layers compute; 'stream' on a CUDA side "
         "stream; 'auto' is stream on CUDA, inline on CPU (a worker thread competes "
         "with the layers for the same cores).",
         PREFETCH),
    Flag("--spec-offload", "decode", "offload", "choice",
         "specontext: SpeContext's adaptive memory management (Sec 6). 'auto': as the KV "
         "pool's tokens in use grow past Algorithm 1's thresholds for the device KV "
         "budget (--spec-offload-kv-bytes), one more layer's KV (the last first) moves to "
         "the host, and sparse rows read it only through their elastic loads into the "
         "staging rows; layers come back when the pool drains. --max-total-tokens is then "
         "the pool's slots on both tiers. CPU only; not with HiCache or --spec-rounds "
         "(docs/design/offload.md). 'off': every layer stays on the device.", OFFLOAD),
    Flag("--spec-offload-kv-bytes", "decode", "offload_kv_bytes", "int",
         "--spec-offload auto: the device KV byte budget (the resident layers' rows in use, "
         "the retrieval head's layer and the staging rows), e.g. 67108864 for 64 MiB.",
         lo=0),
    Flag("--spec-sparse-kv-cache", "decode", "sparse_kv_cache", "choice",
         "Sparse modes: what the radix cache keeps of a request's KV from its first "
         "sparse decode step on (its output tokens' K and V past layer 0 come from "
         "sparse attention). 'keep' caches it as stock sglang caches every output, and a "
         "follow-up turn reuses it; 'drop' caches only what dense passes wrote, and a "
         "follow-up turn recomputes the previous answer densely, so every cached prefix "
         "is exact mode's (costs a prefill of the answer's tokens). 'auto' is drop for "
         "specontext, whose answers over a long history are sparse from the first step, "
         "and keep for the other modes (docs/sparse-decode.md).", SPARSE_KV_CACHE),
    Flag("--spec-cache-eviction", "cache", "eviction", "choice",
         "Radix-cache eviction order. 'lru' is stock sglang's (identical evictions, "
         "sglang's compiled tree core); 'turn' evicts dead reasoning branches "
         "(finished turns' reasoning the chat template drops from history) first, then "
         "the least recently active conversations, oldest rounds first (the turn-tagged "
         "tree core).", CACHE_EVICTIONS),
    Flag("--spec-tree-core", "cache", "tree_core", "choice",
         "The radix tree's core. 'auto': sgl_spec's turn-tagged core where a feature reads "
         "turn tags (--spec-cache-eviction turn, --spec-krul, LoopServe prefill with "
         "reuse), sglang's compiled core otherwise; 'tagged': the turn-tagged core always "
         "(to compare a tagged feature with HiCache on the same core); 'compiled': "
         "sglang's, refused with a feature that needs tags.", TREE_CORES),
    Flag("--spec-dp-dispatch", "cache", "dp_dispatch", "choice",
         "With --dp-size > 1 and sglang's round-robin --load-balance-method: "
         "'cache_aware' sends a request to the DP rank that was sent the longest prefix "
         "of its prompt (a conversation's later turns meet their cached history), "
         "round robin where no rank holds half of it; 'sglang' leaves sglang's dispatch.",
         DP_DISPATCH),
    Flag("--spec-prefill", "prefill", "mode", "choice",
         "Prefill attention mode, independent of --spec-mode (decode). 'exact' is dense "
         "attention; 'loopserve' selects vertical and slash lines per layer and KV head "
         "from a sample of each long extend's own queries and attends only those "
         "(LoopServe Sec 5.2). CPU only.", PREFILL_MODES),
    Flag("--spec-prefill-alpha", "prefill", "alpha", "fraction",
         "loopserve prefill: fraction of the sampled attention mass the selected lines "
         "must cover."),
    Flag("--spec-prefill-min-tokens", "prefill", "min_tokens", "int",
         "loopserve prefill: extends with fewer new tokens (short turns, decode-sized "
         "chunks) take the exact path, and in every extend the positions below this "
         "attend densely, so a prompt shorter than this only reuses cached KV that dense "
         "attention wrote.", lo=1),
    Flag("--spec-prefill-max-density", "prefill", "max_density", "fraction",
         "loopserve prefill: a layer whose selected lines cover more than this share of "
         "the causal cells makes the dense call instead; 1 never falls back."),
    Flag("--spec-prefill-skip-density", "prefill", "skip_density", "fraction",
         "loopserve prefill: a layer whose selected lines cover more than this share of "
         "the causal cells skips its selection in the next extends and makes the dense "
         "call, re-selecting every 8th extend; 1 never skips."),
    Flag("--spec-prefill-reuse", "prefill", "reuse", "bool",
         "loopserve prefill: seed each extend's selection with the lines kept on the "
         "cached turn it continues (a payload of the radix tree's nodes)."),
    Flag("--spec-krul", "krul", "enable", "bool",
         "Krul: the host tier keeps conversations' KV compressed (rows in "
         "--spec-krul-codec; when HiCache demotes a conversation, the layer pairs whose "
         "attention is most alike merge, MiniCache-style, where their KV are alike too), "
         "so it holds more conversations; checksummed, recomputed if damaged. Needs "
         "--enable-hierarchical-cache."),
    Flag("--spec-krul-gamma", "krul", "gamma", "fraction",
         "Krul: layers whose attention share on the first and last 10%% of the history "
         "is under this are input-sensitive and never shared (Algorithm 1's threshold)."),
    Flag("--spec-krul-ratio", "krul", "ratio", "fraction",
         "Krul: share of the layers to pair up (r_l; the paper's 0.5)."),
    Flag("--spec-krul-strategy", "krul", "strategy", "choice",
         "Krul: where a conversation's layer pairs come from. 'conversation': Algorithm 1 "
         "on its own attention, which the attention path samples as it serves the "
         "conversation (a prefill row per 128 new tokens, 8 at most, none in a shorter "
         "turn; every 64th decode step); "
         "'model': the model's statistics (--spec-krul-stats), one strategy for all "
         "(the paper's Krul (Fix)), also the fallback for a conversation not yet observed.",
         ("conversation", "model")),
    Flag("--spec-krul-retain", "krul", "retain", "fraction",
         "Krul: share of a pair's tokens kept unmerged, those whose K or V directions "
         "differ most between the two layers."),
    Flag("--spec-krul-max-error", "krul", "max_error", "fraction",
         "Krul: a pair whose merged KV would differ from the layers' own by more than this "
         "(relative L2 error, K or V, over the node's tokens) is kept exact instead."),
    Flag("--spec-krul-codec", "krul", "codec", "choice",
         "Krul: how the host tier stores each token's K and V at a layer, per token and "
         "head with a bf16 scale. 'k8v4': K in int8, V in 4 bits; 'int8': both in int8; "
         "'full': the pool's "
         "dtype, as stock's host pool. Merged pairs store their shared direction the same "
         "way.", ("k8v4", "int8", "full")),
    Flag("--spec-krul-stats", "krul", "stats_path", "path",
         "Krul: the model's attention statistics, a file written by 'python -m "
         "sgl_spec.calibrate strategy'. Empty: measured once for --model-path into the "
         "cache dir."),
    Flag("--spec-krul-profile", "krul", "profile_path", "path",
         "Krul: this host's restore profile, written by 'python -m sgl_spec.calibrate "
         "restore'. A demoted conversation then leaves the share of its rows that the "
         "profile's host tier balances (a pyramid, most at the first layer) unstored, and "
         "its restore recomputes them while the rest is loaded. Empty: every row is "
         "stored and loaded (share 0, what this CPU's calibration chooses)."),
    Flag("--spec-krul-restore", "krul", "restore", "choice",
         "Krul: how a restore's recompute (--spec-krul-profile) meets the load of the "
         "stored rows. 'pipelined': it runs while sglang's loader copies them (a worker "
         "thread on CPU; the compute stream beside the loader's on GPU), as the share's "
         "cost model assumes; 'serial': to completion first; 'auto': pipelined on GPU, "
         "serial on CPU (there a host copy is a small part of a restore, and the "
         "recompute runs slower on a worker thread than in the scheduler's).",
         ("auto", "pipelined", "serial")),
    Flag("--spec-rounds", "rounds", "enable", "bool",
         "Round Attention on a layer-tiered KV pool (CPU): layers from the model's "
         "watershed L_w up keep only a working set on the device (the system prompt's "
         "round, the rounds each new question selects at L_w, the current round); every "
         "finished round's upper-layer KV is one host block, referenced from its radix "
         "node. Composes with HiCache (its host pool holds the lower layers), Krul, "
         "turn eviction and --spec-prefill loopserve (sparse below L_w). Needs a "
         "calibrated watershed (python -m sgl_spec.calibrate watershed): without one the "
         "server serves exact and says so (docs/design/round-attention.md)."),
    Flag("--spec-round-strategy", "rounds", "strategy", "choice",
         "Which earlier rounds a question attends past L_w, from its attention at L_w "
         "(qAtt): 'topk' the top tenth, 'fixed' those over 0.1 of it, 'adaptive' those over "
         "mean + 3 std (sigma-clipped: again over the rest until none is new); the most "
         "attended round and the last --spec-round-recent rounds "
         "are always kept.", ROUND_STRATEGIES),
    Flag("--spec-round-recent", "rounds", "recent", "int",
         "Rounds just before a question kept whatever the strategy picks."),
    Flag("--spec-round-min-rounds", "rounds", "min_rounds", "int",
         "Conversations with fewer earlier rounds (the system prompt's not counted) "
         "attend all of them: exact.", lo=1),
    Flag("--spec-round-upper-tokens", "rounds", "upper_tokens", "int",
         "Device slots of the upper layers (the working sets); 0: as many as the full "
         "pool (--max-total-tokens), which saves no device memory. A request whose "
         "working set does not fit is refused with an error naming this flag."),
    Flag("--spec-round-drop-after", "rounds", "drop_after", "int",
         "Round Attention Sec. 3.4, opt-in: a finished round that no question's selection "
         "kept for this many questions in a row is dropped from the host tier (its block "
         "freed; no later question attends it). 0: rounds are never dropped.", lo=0),
    Flag("--spec-round-watershed", "rounds", "watershed", "int",
         "L_w (1-based; layers 1..L_w keep every token on the device); 0: the model's "
         "calibrated profile."),
    Flag("--spec-check-invariants", "", "check_invariants", "bool",
         "Debug: after every scheduler step check that no KV slot is both free and held "
         "by the radix tree or a running request, and when the server goes idle that "
         "every per-request structure of sgl_spec is empty; violations are logged as "
         "errors and served at GET /sgl_spec/cache ('invariants'). Costs a pass over the "
         "KV pool's slot ids per step."),
    Flag("--spec-disable", "", "disable", "bool",
         "Serve with stock sglang components (torch_native attention on CPU, sglang's "
         "default radix cache) for side-by-side comparison."),
)
_BY_FIELD = {(f.section, f.field): f for f in FLAGS}


def check_value(flag: Flag, v) -> None:
    """ValueError naming the flag and its valid values where ``v`` is not one of them."""
    if flag.kind == "choice" and v not in flag.choices:
        raise ValueError(f"{flag.name} {v!r} is invalid; valid values: "
                         f"{', '.join(flag.choices)}")
    if flag.kind == "int" and (isinstance(v, bool) or not isinstance(v, int) or v < flag.lo):
        raise ValueError(f"{flag.name} {v!r} is invalid; valid range: integers >= {flag.lo}")
    if flag.kind == "fraction" and (isinstance(v, bool) or not isinstance(v, (int, float))
                                    or not 0.0 < v <= 1.0):
        raise ValueError(f"{flag.name} {v!r} is invalid; valid range: a number in (0, 1]")
    if flag.kind == "bool" and not isinstance(v, bool):
        raise ValueError(f"{flag.name} {v!r} is invalid; valid values: true, false")
    if flag.kind == "path" and not isinstance(v, str):
        raise ValueError(f"{flag.name} {v!r} is invalid; valid values: a path")


def _check(section: str, obj) -> None:
    """Validate the fields of ``obj`` that have a flag; ValueError names the flag."""
    for f in dataclasses.fields(obj):
        flag = _BY_FIELD.get((section, f.name))
        if flag is not None:
            check_value(flag, getattr(obj, f.name))


@dataclass(frozen=True)
class CacheConfig:
    eviction: str = "lru"
    dp_dispatch: str = "cache_aware"
    tree_core: str = "auto"

    def __post_init__(self):
        _check("cache", self)


@dataclass(frozen=True)
class DecodeConfig:
    """Decode attention: the mode and what a sparse policy keeps per request, KV head and
    layer: ``budget`` selected positions (B), the first ``sink`` and last ``window``
    positions; LoopServe reselects every ``nd`` steps from the first selection at step
    ``first_select_step`` (Algorithm 3: 16, not a flag), and with ``prompt_seed`` its steps
    before that attend a selection the prompt's last ``window`` queries made at prefill;
    histories under ``min_context`` decode exactly."""

    mode: str = "exact"
    budget: int = 1024
    sink: int = 4
    window: int = 64
    nd: int = 16
    lookahead: int = 16
    min_context: int = 2048
    first_select_step: int = 16
    prompt_seed: bool = False
    draft_path: str = ""
    prefetch: str = "auto"
    dense_layers: int = 0
    profile_path: str = "auto"
    sparse_kv_cache: str = "auto"
    offload: str = "off"
    offload_kv_bytes: int = 0
    # Why this server decodes as it does (the launcher's --spec-decode-profile decision;
    # GET /sgl_spec/cache shows it). Not a flag.
    decision: str = ""

    def __post_init__(self):
        _check("decode", self)
        n = self.first_select_step
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"first_select_step {n!r} is invalid; valid range: integers >= 0")
        if self.prompt_seed and self.mode != "loopserve":
            raise ValueError(f"--spec-prompt-seed is read only with --spec-mode loopserve (got "
                             f"--spec-mode {self.mode}); valid: drop it, or --spec-mode "
                             "loopserve")
        if self.mode != "specontext":
            for flag, value, default in (("--spec-draft-path", self.draft_path, ""),
                                         ("--spec-prefetch", self.prefetch, "auto")):
                if value != default:
                    raise ValueError(f"{flag} is read only with --spec-mode specontext "
                                     f"(got --spec-mode {self.mode}); valid: drop it, or "
                                     "--spec-mode specontext")
        if self.mode == "exact" and self.profile_path not in PROFILE_CHOICES:
            raise ValueError("--spec-decode-profile is read only with a sparse --spec-mode "
                             "(got exact); valid: drop it, or --spec-mode "
                             f"{' / '.join(m for m in MODES if m != 'exact')}")
        if self.mode == "exact" and self.sparse_kv_cache == "drop":
            raise ValueError("--spec-sparse-kv-cache drop needs a sparse --spec-mode (got "
                             "exact, whose KV is all dense); valid: --spec-sparse-kv-cache "
                             "auto / keep, or --spec-mode "
                             f"{' / '.join(m for m in MODES if m != 'exact')}")
        if self.mode == "exact" and self.dense_layers:
            raise ValueError("--spec-dense-layers is read only with a sparse --spec-mode "
                             "(got exact, where every layer is dense); valid: drop it, or "
                             f"--spec-mode {' / '.join(m for m in MODES if m != 'exact')}")
        if self.lookahead != DecodeConfig.lookahead and self.mode != "loopserve":
            raise ValueError(f"--spec-lookahead is read only with --spec-mode loopserve (got "
                             f"--spec-mode {self.mode}); valid: drop it, or --spec-mode "
                             "loopserve")
        if self.offload != "off" and self.mode != "specontext":
            raise ValueError(f"--spec-offload {self.offload} needs --spec-mode specontext (got "
                             f"{self.mode}: only its rows read offloaded layers through "
                             "staging rows); valid: --spec-offload off, or --spec-mode "
                             "specontext")
        if self.offload == "auto" and not self.offload_kv_bytes:
            raise ValueError("--spec-offload auto needs --spec-offload-kv-bytes (the device KV "
                             "byte budget); valid: a number of bytes > 0, or --spec-offload off")
        if self.offload == "off" and self.offload_kv_bytes:
            raise ValueError("--spec-offload-kv-bytes is read only with --spec-offload auto; "
                             "valid: drop it, or add --spec-offload auto")

    @property
    def drops_sparse_kv(self) -> bool:
        """Whether the radix cache keeps only dense passes' KV (--spec-sparse-kv-cache,
        'auto': drop for specontext, keep for the other modes; exact refuses drop)."""
        return self.sparse_kv_cache == "drop" or (self.sparse_kv_cache == "auto"
                                                  and self.mode == "specontext")

    def use_exact(self, seq_len: int) -> bool:
        """Whether a history of ``seq_len`` positions decodes densely: short histories
        (< min_context) gain nothing, and where sink + window + budget cover the whole
        history the "sparse" subset would be all of it."""
        return seq_len < self.min_context or self.budget + self.sink + self.window >= seq_len

    def first_sparse_step(self, prompt_len: int) -> int | None:
        """The first decode step (0-based) of a ``prompt_len``-token request that attends a
        subset, None if none does (exact mode, or a history too short; the history's
        growth during the answer is not counted). LoopServe's first selection from decoded
        queries is at ``first_select_step``, its prompt's (``prompt_seed``) at prefill;
        SnapKV and StreamingLLM select before the first step."""
        if self.mode == "exact" or self.use_exact(prompt_len):
            return None
        return self.first_select_step if self.mode == "loopserve" and not self.prompt_seed \
            else 0

    @property
    def retrieval_head(self) -> bool:
        """Whether the server runs SpeContext's retrieval head (and keeps its K in the
        KV pool as one extra layer)."""
        return self.mode == "specontext"


@dataclass(frozen=True)
class PrefillConfig:
    """Prefill attention. The alpha default and the density thresholds are the ones
    that kept the harness' accuracy against exact (docs/sparse-prefill.md)."""

    mode: str = "exact"
    alpha: float = 0.97
    min_tokens: int = 2048
    reuse: bool = True
    max_density: float = 0.3
    skip_density: float = 0.2

    def __post_init__(self):
        _check("prefill", self)


@dataclass(frozen=True)
class KrulConfig:
    """Krul: compressed cross-layer KV for demoted conversations. gamma is not given by
    the paper: 0.8 is provisional (it leaves the early, input-sensitive layers unshared
    on the default model's statistics, ``python -m sgl_spec.calibrate strategy``).
    ratio 0.5 is the paper's (Sec 8.5); retain 0.05 bounds what MiniCache's retained
    tokens cost. max_error is the exact fallback: a pair whose merge errs by more stays
    exact, which on the default models is every pair (docs/design/krul.md, "Step 2").
    The codec is what compresses instead (k8v4: K int8 and V 4-bit per token and head,
    each with a bf16 scale; docs/design/krul.md §13)."""

    enable: bool = False
    gamma: float = 0.8
    ratio: float = 0.5
    retain: float = 0.05
    max_error: float = 0.2
    codec: str = "k8v4"
    strategy: str = "conversation"
    stats_path: str = ""
    profile_path: str = ""
    restore: str = "auto"

    def __post_init__(self):
        _check("krul", self)
        for flag, value in (("stats", self.stats_path), ("profile", self.profile_path),
                            ("strategy", self.strategy != "conversation"),
                            ("restore", self.restore != "auto")):
            if value and not self.enable:
                raise ValueError(f"--spec-krul-{flag} is read only with --spec-krul; valid: "
                                 "drop it, or add --spec-krul")


@dataclass(frozen=True)
class RoundConfig:
    """Round Attention (docs/design/round-attention.md). ``watershed`` 0 is resolved by
    the launcher from the model's calibrated profile; ``decision`` says what it found
    (not a flag)."""

    enable: bool = False
    strategy: str = "topk"
    recent: int = 1
    min_rounds: int = 4
    upper_tokens: int = 0
    watershed: int = 0
    drop_after: int = 0
    decision: str = ""

    def __post_init__(self):
        _check("rounds", self)
        if not self.enable:
            for flag, value, default in (("strategy", self.strategy, "topk"),
                                         ("recent", self.recent, 1),
                                         ("min-rounds", self.min_rounds, 4),
                                         ("upper-tokens", self.upper_tokens, 0),
                                         ("watershed", self.watershed, 0),
                                         ("drop-after", self.drop_after, 0)):
                if value != default:
                    raise ValueError(f"--spec-round-{flag} is read only with --spec-rounds; "
                                     "valid: drop it, or add --spec-rounds")


# SpecConfig's parts: field name (and FLAGS section) -> its config class.
PARTS: dict[str, type] = {"cache": CacheConfig, "decode": DecodeConfig,
                          "prefill": PrefillConfig, "krul": KrulConfig, "rounds": RoundConfig}


@dataclass(frozen=True)
class SpecConfig:
    """What ``--spec-*`` selected. Immutable; every part validated on construction."""

    disable: bool = False
    check_invariants: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    krul: KrulConfig = field(default_factory=KrulConfig)
    rounds: RoundConfig = field(default_factory=RoundConfig)

    def __post_init__(self):
        _check("", self)
        if self.rounds.enable:
            clash = [name for name, on in (
                ("--spec-disable", self.disable),
                (f"--spec-mode {self.decode.mode}", self.decode.mode != "exact"),
                ("--spec-krul-profile", bool(self.krul.profile_path))) if on]
            if clash:
                raise ValueError(f"--spec-rounds does not compose with {', '.join(clash)} yet "
                                 "(its upper layers attend the working set, which a sparse "
                                 "decode does not know; a Krul restore's recompute runs "
                                 f"every layer); valid: drop {', '.join(clash)}, or "
                                 "drop --spec-rounds")
        if self.disable and self.krul.enable:
            raise ValueError("--spec-krul needs sgl_spec's cache; valid: drop --spec-disable, "
                             "or drop --spec-krul")
        needs = self._tag_readers()
        if self.cache.tree_core == "compiled" and needs:
            raise ValueError(f"--spec-tree-core compiled: {', '.join(needs)} read turn tags, "
                             "which only the tagged core keeps; valid: auto or tagged, or "
                             f"drop {', '.join(needs)}")

    def _tag_readers(self) -> list[str]:
        """The flags whose features read turn tags on the tree's nodes."""
        return [name for name, on in (
            ("--spec-cache-eviction turn", self.cache.eviction == "turn"),
            ("--spec-krul", self.krul.enable),
            ("--spec-rounds", self.rounds.enable),
            ("--spec-prefill loopserve (with reuse)",
             self.prefill.mode == "loopserve" and self.prefill.reuse)) if on]

    @property
    def tagged_cache(self) -> bool:
        """Whether the radix cache runs the turn-tagged tree core: asked for, or a feature
        reads turn tags on its nodes (turn eviction, Krul, LoopServe's kept lines);
        otherwise sglang's compiled tree core."""
        return self.cache.tree_core == "tagged" or (
            self.cache.tree_core == "auto" and bool(self._tag_readers()))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SpecConfig:
        data = json.loads(text)
        known = {"disable", "check_invariants", *PARTS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{envs.SGLSPEC_CONFIG} has unknown keys {unknown}; "
                             f"valid keys: {sorted(known)}")
        for name, part in PARTS.items():
            if name in data:
                sub = data[name]
                valid = {f.name for f in dataclasses.fields(part)}
                bad = sorted(set(sub) - valid)
                if bad:
                    raise ValueError(f"{envs.SGLSPEC_CONFIG} {name} has unknown keys {bad}; "
                                     f"valid keys: {sorted(valid)}")
                data[name] = part(**sub)
        return cls(**data)


def _number_or_text(kind: str):
    """argparse type: an int / float, or the text itself for the config to reject with
    the flag's valid range (argparse's own error would not name it)."""
    def parse(text: str):
        try:
            return int(text) if kind == "int" else float(text)
        except ValueError:
            return text
    return parse


def _default(cfg: SpecConfig, flag: Flag):
    return getattr(getattr(cfg, flag.section) if flag.section else cfg, flag.field)


def add_cli_args(parser: argparse.ArgumentParser, sections: tuple[str, ...] | None = None,
                 skip: tuple[str, ...] = ()) -> None:
    """Add the ``--spec-*`` flags (sglang-style help, defaults shown); ``sections``: only
    those parts' flags, less ``skip`` (a tool that reads, say, the decode flags alone;
    the others keep their defaults in ``from_cli_args``)."""
    group = parser.add_argument_group("sgl_spec options")
    defaults = SpecConfig()
    for flag in FLAGS:
        if (sections is not None and flag.section not in sections) or flag.name in skip:
            continue
        default = _default(defaults, flag)
        dest = f"{flag.section}__{flag.field}"
        if flag.kind == "bool":
            action = (argparse.BooleanOptionalAction if flag.name != "--spec-disable"
                      else "store_true")
            group.add_argument(flag.name, dest=dest, action=action, default=default,
                               help=f"{flag.help} Default: {'on' if default else 'off'}.")
        elif flag.kind == "choice":
            group.add_argument(flag.name, dest=dest, type=str, default=default,
                               choices=flag.choices, help=f"{flag.help} Default: {default}.")
        elif flag.kind == "path":
            group.add_argument(flag.name, dest=dest, type=str, default=default, metavar="DIR",
                               help=f"{flag.help} Default: {default or 'none'}.")
        else:
            valid = (f"Integer >= {flag.lo}" if flag.kind == "int" else "Number in (0, 1]")
            group.add_argument(flag.name, dest=dest, type=_number_or_text(flag.kind),
                               default=default, metavar="N" if flag.kind == "int" else "FLOAT",
                               help=f"{flag.help} {valid}. Default: {default}.")


def from_cli_args(args: argparse.Namespace) -> SpecConfig:
    """The config of parsed flags; raises ValueError naming a bad flag."""
    values: dict[str, dict] = {"": {}, **{name: {} for name in PARTS}}
    defaults = SpecConfig()
    for flag in FLAGS:  # every value first, then the combinations (the parts' checks)
        v = values[flag.section][flag.field] = getattr(
            args, f"{flag.section}__{flag.field}", _default(defaults, flag))
        check_value(flag, v)
    return SpecConfig(**{name: part(**values[name]) for name, part in PARTS.items()},
                      **values[""])


@lru_cache(maxsize=1)
def current() -> SpecConfig:
    """The config of this server process (defaults when launched without sgl_spec)."""
    text = envs.spec_config_json()
    return SpecConfig.from_json(text) if text else SpecConfig()
