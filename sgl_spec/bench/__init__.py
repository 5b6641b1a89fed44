"""sgl_spec's benchmarks: apart from the serving path (no serving module imports them).

One harness, ``python -m sgl_spec.bench`` (``__main__``), plays configuration sets
(``configs/*.toml``) side by side and reports accuracy, agreement and speed; the
sweeps and micro-benchmarks are modules with their own ``python -m`` entry points.
All of them time through ``timing``, share the CLI prologue of ``cli`` and write
``results.json`` plus a readable ``results.md`` (``render`` formats every cell).

The harness:
    ``__main__``     CLI: the configuration set, plan, dataset; side by side or ``--url``
    ``configset``    server configurations as TOML rows, plan and checks (``configs/``)
    ``plan``         what each row plays: dataset, long generations, speed chats, serving
    ``runner``       starts each row's server and plays the workloads on it
    ``results``      results.json: per-row figures, ratios, agreement, checks
    ``summary``      per-row figures: accuracy, speed, ratios against the first row
    ``agreement``    token-by-token agreement, divergences and their logit margins
    ``tables``       results.md of the harness; ``plots``: its PNG figures
Workloads and clients:
    ``dataset``      multi-turn QA with planted facts (``scoring``: exact match, F1)
    ``longgen``      long-generation prompts
    ``chats``        speed chats: chat over a document, growing context
    ``serving``      ``sglang.bench_serving`` random-ids run and its figures
    ``chat_client``  plays conversations through the OpenAI API, timing each turn
    ``server``       starts, measures and stops a real server (also used by the tests)
    ``sparse_counters``  sgl_spec's sparse-decode counters from /metrics
Sweeps and micro-benchmarks (``python -m sgl_spec.bench.<name> --help``):
    ``decode_sweep`` decode tok/s against history length (servers)
    ``prefill_sweep`` TTFT against new-turn length (servers)
    ``sweep``        what the two sweeps share: --rows, --rounds, per-start spreads
    ``prefill_mass`` recovered attention mass of sparse prefill selection (offline)
    ``qk_capture``   per-layer q/k/v of a real prompt, for prefill_mass and vslash
    ``vslash``       line-sparse prefill attention vs dense SDPA (kernel)
    ``reselect``     one LoopServe reselection vs the dense decode steps it covers
    ``cache_overhead`` the radix cache's own cost
Prose of a given token length comes from ``sgl_spec.corpus`` (Python's docstrings;
the retrieval head's training reads it too). Shared: ``timing`` (medians, spreads,
interleaved rounds), ``cli`` (flags, outputs),
``render`` (markdown cells), ``provenance`` (machine, versions, commit).
"""
