"""Long-generation workload: prompts that make a model write 1k-4k tokens.

Reasoning-style decoding (long step-by-step explanations, long numbered lists) is
where a decode-time KV policy acts for thousands of steps (LoopServe's progressive
KV compression, Sec. 5). Each prompt is one user turn answered greedily; a run is
scored against exact attention's output for the same prompt by
``scoring.greedy_agreement``: tokens generated before the first divergence, and the
share of matching positions. The prompt list is fixed, so every run asks the same.

    >>> for p in prompts("default"):
    ...     conv = p.to_workload()             # play with max_tokens=p.max_tokens
    >>> score(reference_ids, candidate_ids)    # Agreement(prefix, share)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sgl_spec.bench import scoring, workloads

MIN_TOKENS = 1024
MAX_TOKENS = 4096


@dataclass(frozen=True)
class LongGenPrompt:
    """One prompt and its output budget; a small model may stop early, so the
    harness may also ask the server to ignore EOS for fixed-length outputs."""

    name: str
    prompt: str
    max_tokens: int

    def __post_init__(self) -> None:
        if not MIN_TOKENS <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(
                f"{self.name}: max_tokens must be in [{MIN_TOKENS}, {MAX_TOKENS}], "
                f"got {self.max_tokens}"
            )
        if not self.name or not self.prompt.strip():
            raise ValueError(f"a prompt needs a name and text, got {self.name!r}")

    def to_workload(self) -> workloads.Conversation:
        return workloads.Conversation(f"longgen-{self.name}", (self.prompt,))


PROMPTS: tuple[LongGenPrompt, ...] = (
    LongGenPrompt("animals", "List 300 different animals, one per line, numbered. "
                  "Do not stop before number 300.", 2048),
    LongGenPrompt("countries", "List 150 countries of the world with their capital "
                  "cities, one per line, numbered, in the form 'country: capital'.", 2048),
    LongGenPrompt("numbers-in-words", "Write every number from 1 to 400 in English "
                  "words, one per line, for example 'one', 'two', 'three'.", 4096),
    LongGenPrompt("bread", "Explain step by step how to bake a loaf of bread at home, "
                  "from choosing the flour to slicing the loaf. Write at least 40 "
                  "numbered steps and explain each step in two or three sentences.", 3072),
    LongGenPrompt("python-run", "Explain step by step what happens when a computer "
                  "runs a Python program, from reading the source file to printing "
                  "the output. Give each step a heading and a detailed paragraph. "
                  "Write at least 1500 words.", 3072),
    LongGenPrompt("long-division", "Show, step by step, how to divide 987654321 by 37 "
                  "using long division. Write out every subtraction and every "
                  "digit brought down, then check the result by multiplication.", 1024),
    LongGenPrompt("history-timeline", "Write a timeline of 100 important events in "
                  "world history, one per line, numbered, each with its year and one "
                  "sentence of explanation.", 4096),
    LongGenPrompt("recipes", "Give 20 simple recipes. For each one, list the "
                  "ingredients and then the numbered steps to cook it.", 4096),
)
PRESETS: dict[str, tuple[str, ...]] = {
    "default": tuple(p.name for p in PROMPTS),
    "quick": ("animals", "long-division"),
}


def prompts(preset: str = "default") -> list[LongGenPrompt]:
    """The prompts of ``preset`` ("default": all, "quick": two), in a fixed order."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {sorted(PRESETS)}")
    by_name = {p.name: p for p in PROMPTS}
    return [by_name[name] for name in PRESETS[preset]]


def score(reference_ids: Sequence[int], candidate_ids: Sequence[int]) -> scoring.Agreement:
    """Agreement of a candidate's output ids with exact attention's (the reference)."""
    return scoring.greedy_agreement(reference_ids, candidate_ids)


def summarize(agreements: Sequence[scoring.Agreement]) -> dict:
    return scoring.agreement_summary(agreements)
