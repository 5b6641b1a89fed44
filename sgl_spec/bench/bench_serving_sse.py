"""``sglang.bench_serving`` that skips SSE comment lines, for llama.cpp's server.

``llama-server`` sends a comment line (``:``) now and then while it reads a long prompt, a
keep-alive that the SSE spec says clients ignore; ``bench_serving``'s stream readers parse
every line as JSON and fail on it. This runs ``bench_serving``'s own ``cli_main`` with its
prefix helper mapping comment lines to ``[DONE]``, which its readers skip. Nothing else
changes, and sglang servers never send such lines: every row of
``sgl_spec.bench.side_by_side`` runs through it, so all are measured by the same client.

    python -m sgl_spec.bench.bench_serving_sse [bench_serving's flags]
"""

from __future__ import annotations


def skip_comments(remove_prefix):
    def wrapped(text: str, prefix: str) -> str:
        return "[DONE]" if text.startswith(":") else remove_prefix(text, prefix)

    return wrapped


def main() -> None:
    from sglang.benchmark import serving

    serving.remove_prefix = skip_comments(serving.remove_prefix)
    serving.cli_main()


if __name__ == "__main__":
    main()
