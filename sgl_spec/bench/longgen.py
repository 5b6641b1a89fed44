"""Long-generation workload: prompts that make a model write 1k-4k tokens.

Reasoning-style decoding (long step-by-step explanations, long numbered lists) is
where a decode-time KV policy acts for thousands of steps (LoopServe's progressive
KV compression, Sec. 5). Each prompt is one user turn answered greedily; a run is
scored against exact attention's output for the same prompt by
``agreement.greedy_agreement``: tokens generated before the first divergence, and the
share of matching positions. The prompt list is fixed, so every run asks the same.

Short prompts never reach ``--spec-min-context`` (2048) within a few thousand
generated tokens, so sparse decode would not act on them. Long-context prompts
(``context_tokens > 0``) put a corpus document with planted facts
(``document_with_facts``) before the instruction, so the history is long from the
first decode step; they are rendered offline with the model's tokenizer, a pure
function of (prompt, tokenizer).

    >>> for p in prompts("long-context"):
    ...     conv = p.to_workload(tokenizer)    # play with max_tokens=p.max_tokens
    >>> score(reference_ids, candidate_ids)    # Agreement(prefix, share)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from sgl_spec import corpus
from sgl_spec.bench import agreement, dataset
from sgl_spec.bench.chat_client import CONTEXT_LEN, ChatScript

MIN_TOKENS = 1024
MAX_TOKENS = 4096
# Chat template and the lines around the document (measured by the tests).
PROMPT_OVERHEAD_TOKENS = 64
DOC_INTRO = "Read the following document."


def document_with_facts(tokenizer: corpus.Tokenizer, n_tokens: int, n_facts: int,
                        seed: int) -> tuple[str, tuple[dataset.Fact, ...]]:
    """About ``n_tokens`` tokens of corpus prose (at most that many) with ``n_facts``
    facts ("The secret code of the blue lighthouse is 4817.") planted at sentence
    ends spread over the whole text, as the QA dataset plants them."""
    rng = random.Random(seed)
    objects = rng.sample(dataset.OBJECTS, n_facts)
    colours = [rng.choice(dataset.COLOURS) for _ in objects]
    kinds = [rng.choice(sorted(dataset.KINDS)) for _ in objects]
    # A 4-digit placeholder stands for the values (1-4 tokens) while sizing the prose.
    overhead = sum(len(tokenizer.encode(" " + dataset.Fact(0, c, o, k, "1234").sentence,
                                        add_special_tokens=False))
                   for c, o, k in zip(colours, objects, kinds))
    prose = corpus.document(tokenizer, n_tokens - overhead, seed)
    values = dataset.draw_values(rng, kinds, prose)
    facts = tuple(dataset.Fact(0, c, o, k, v)
                  for c, o, k, v in zip(colours, objects, kinds, values))
    return dataset.plant(rng, prose, [f.sentence for f in facts]), facts


@dataclass(frozen=True)
class LongGenPrompt:
    """One prompt and its output budget.

    ``prompt`` is the instruction. With ``context_tokens > 0`` a document of about
    that many tokens (``document_with_facts``: ``facts`` planted facts, drawn with
    ``seed``) precedes it, and rendering needs the model's tokenizer. A small model
    may stop early; ``ignore_eos`` asks the server for exactly the budget, so that
    every configuration decodes the same number of long-history steps.
    """

    name: str
    prompt: str
    max_tokens: int
    context_tokens: int = 0
    facts: int = 0
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not MIN_TOKENS <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(
                f"{self.name}: max_tokens must be in [{MIN_TOKENS}, {MAX_TOKENS}], "
                f"got {self.max_tokens}"
            )
        if not self.name or not self.prompt.strip():
            raise ValueError(f"a prompt needs a name and text, got {self.name!r}")
        if self.context_tokens < 0:
            raise ValueError(f"{self.name}: context_tokens must be >= 0, "
                             f"got {self.context_tokens}")
        if not 0 <= self.facts <= len(dataset.OBJECTS) or (self.facts and
                                                           not self.context_tokens):
            raise ValueError(f"{self.name}: facts must be in [0, {len(dataset.OBJECTS)}] and "
                             f"need context_tokens > 0, got facts={self.facts}, "
                             f"context_tokens={self.context_tokens}")
        need = self.context_tokens + PROMPT_OVERHEAD_TOKENS + self.max_tokens
        if need > CONTEXT_LEN:
            raise ValueError(f"{self.name}: context_tokens + max_tokens needs ~{need} "
                             f"tokens, over the {CONTEXT_LEN}-token window")

    @property
    def needs_tokenizer(self) -> bool:
        return self.context_tokens > 0

    def render(self, tokenizer: corpus.Tokenizer | None = None) -> str:
        """The user message: the instruction, after the document if there is one."""
        if not self.needs_tokenizer:
            return self.prompt
        if tokenizer is None:
            raise ValueError(f"long-generation prompt {self.name!r} holds a "
                             f"{self.context_tokens}-token document: pass the tokenizer")
        doc, _ = document_with_facts(tokenizer, self.context_tokens, self.facts, self.seed)
        return f"{DOC_INTRO}\n\n{doc}\n\n{self.prompt}"

    def to_workload(self, tokenizer: corpus.Tokenizer | None = None) -> ChatScript:
        return ChatScript(f"longgen-{self.name}", (self.render(tokenizer),))


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
    # Long context: ~3k-token histories from the first decode step, over
    # --spec-min-context, and output that has to look back into the document.
    LongGenPrompt("doc-facts", "List every fact stated in the document above, "
                  "numbered, one per line. Then summarise each paragraph of the "
                  "document in order, numbered, in two or three sentences each.",
                  2048, context_tokens=3000, facts=8, seed=0, ignore_eos=True),
    LongGenPrompt("doc-outline", "Rewrite the document above as a detailed outline: "
                  "one numbered heading per paragraph, in order, and under each heading "
                  "every statement of that paragraph as a bullet point, keeping all "
                  "names and numbers.", 2048, context_tokens=3000, facts=8, seed=1,
                  ignore_eos=True),
    # SpeContext's shape (Sec 7: short input, long reasoning), scaled to this machine:
    # a ~512-token prompt and 4096 generated tokens (EOS ignored), so the history
    # passes --spec-min-context after ~1.5k tokens and the output itself is most of
    # what a selection chooses from. Four seeds: batch 4 plays them at once.
    *(LongGenPrompt(f"reasoning-{i}", "Reason step by step, at length, about the "
                    "document above. For every fact in it, explain what it says, how it "
                    "relates to the paragraph around it and to the other facts, and check "
                    "your explanation; then write a detailed summary of every paragraph. "
                    "Keep going until you have covered everything twice.", 4096,
                    context_tokens=420, facts=4, seed=10 + i, ignore_eos=True)
      for i in range(4)),
)
PRESETS: dict[str, tuple[str, ...]] = {
    "default": tuple(p.name for p in PROMPTS if not p.name.startswith("reasoning-")),
    "quick": ("animals", "long-division"),
    "long-context": ("doc-facts", "doc-outline"),
    "reasoning": ("reasoning-0",),
    "reasoning-x4": tuple(f"reasoning-{i}" for i in range(4)),
}


def prompts(preset: str = "default") -> list[LongGenPrompt]:
    """The prompts of ``preset`` ("default": all, "quick": two short ones,
    "long-context": the document prompts), in a fixed order."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {sorted(PRESETS)}")
    by_name = {p.name: p for p in PROMPTS}
    return [by_name[name] for name in PRESETS[preset]]


def score(reference_ids: Sequence[int], candidate_ids: Sequence[int]) -> agreement.Agreement:
    """Agreement of a candidate's output ids with exact attention's (the reference)."""
    return agreement.greedy_agreement(reference_ids, candidate_ids)


def summarize(agreements: Sequence[agreement.Agreement]) -> dict:
    return agreement.agreement_summary(agreements)
