"""The speed chats of the harness: chat over a document, and growing context.

Two kinds of conversation, each a frozen ``ChatConfig`` (``PRESETS``):

* ``doc_chat``: turn 1 holds a ~3k-token document and a question; later turns are
  ~50-token follow-up questions about passages of it (``turn_tokens = 0``). Their
  time to first token is what a cached prefix saves: stock's torch_native extend
  still attends over the whole sequence, sgl_spec only from the new queries;
* ``growing``: every turn appends ~1k new tokens of prose and a short question, so
  the prompt grows to ~6k tokens.

A plan names them (``[plan] chats = ["doc_chat", "growing"]``, ``plan.RunPlan``); the
runner plays them on every row with the first row's answers as the chat history, so
every row is sent the same prompts and their TTFTs and outputs compare turn by turn.
Texts come from ``sgl_spec.corpus`` and are a pure function of (tokenizer,
config).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sgl_spec import corpus
from sgl_spec.bench.chat_client import CONTEXT_LEN, ChatScript

# Question and chat-template tokens per turn, for the context-window check.
TURN_OVERHEAD_TOKENS = 80


@dataclass(frozen=True)
class ChatConfig:
    """Conversations played turn by turn, greedy, answers up to ``max_tokens``.

    ``first_tokens`` is the prose in turn 1 (the document), ``turn_tokens`` the
    new prose added by every later turn (0: a follow-up question only).
    """

    conversations: int
    turns: int
    first_tokens: int
    turn_tokens: int
    max_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations <= 0 or self.turns <= 0 or self.max_tokens <= 0:
            raise ValueError(f"conversations, turns and max_tokens must be positive: {self}")
        if self.first_tokens <= 0 or self.turn_tokens < 0:
            raise ValueError(f"first_tokens must be > 0 and turn_tokens >= 0: {self}")
        need = self.first_tokens + (self.turns - 1) * self.turn_tokens
        need += self.turns * (self.max_tokens + TURN_OVERHEAD_TOKENS)
        if need > CONTEXT_LEN:
            raise ValueError(f"a conversation needs ~{need} tokens, over the {CONTEXT_LEN}-"
                             f"token context window: {self}")

    @property
    def follow_ups(self) -> bool:
        """Later turns only ask about the cached document (the TTFT headline)."""
        return self.turn_tokens == 0


PRESETS: dict[str, ChatConfig] = {
    "doc_chat": ChatConfig(conversations=3, turns=5, first_tokens=3000, turn_tokens=0),
    "growing": ChatConfig(conversations=1, turns=6, first_tokens=950, turn_tokens=950,
                          seed=100),
    "doc_chat-quick": ChatConfig(conversations=1, turns=3, first_tokens=3000, turn_tokens=0,
                                 max_tokens=32),
    "growing-quick": ChatConfig(conversations=1, turns=3, first_tokens=1000,
                                turn_tokens=1000, max_tokens=32, seed=100),
}


def preset(name: str) -> ChatConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown chat {name!r}; valid: {sorted(PRESETS)}")
    return PRESETS[name]


# Follow-up questions about a passage, ~50 tokens each with the quoted opening.
_DOC_QUESTIONS = (
    "In the document above, what does the passage that begins \"{quote}\" explain? "
    "Answer in two or three short sentences and mention one specific detail that "
    "the text itself gives.",
    "Look again at the passage starting with \"{quote}\". Which other ideas in the "
    "document are related to it, and how do they connect? Base your answer only on "
    "the document.",
    "Suppose a new programmer reads the passage that opens with \"{quote}\". What is "
    "the single most important thing they should remember from it, and why?",
    "Does the passage beginning \"{quote}\" say anything about errors, limits or "
    "default values? If it does, summarize that part; if not, say so plainly.",
    "Write one short quiz question, with its answer, that checks whether someone "
    "understood the passage that begins \"{quote}\". The answer must be in the text.",
    "Compare the passage starting \"{quote}\" with the one you described in your "
    "previous answer. What do they have in common, and how do they differ?",
)
_GROWING_QUESTIONS = (
    "What is the main topic of the text I just added? Answer in one or two sentences.",
    "Which passage of the new text is the most technical, and what does it say?",
    "Name two terms defined or explained in the new text, and say what each means.",
    "How does the new text relate to the earlier parts of our conversation?",
    "Summarize the passage that begins \"{quote}\" in one sentence.",
    "What would a reader most likely misunderstand in the new text, and why?",
)
_DOC_INTRO = "Please read the following document carefully. I will ask questions about it.\n\n"
_MORE_INTRO = "Here is more text to read.\n\n"


def _quote(passage: corpus.Passage, words: int = 10) -> str:
    return " ".join(passage.text.split()[:words])


def _question(rng: random.Random, templates: tuple[str, ...], turn: int,
              passages: list[corpus.Passage]) -> str:
    template = templates[turn % len(templates)]
    return template.format(quote=_quote(rng.choice(passages)))


def conversations(tokenizer: corpus.Tokenizer, cfg: ChatConfig, name: str) -> list[ChatScript]:
    """The user turns of ``cfg.conversations`` conversations named ``<name>-<i>``,
    deterministic in ``cfg``.

    Turn 1 is ``first_tokens`` of prose plus a question; each later turn adds
    ``turn_tokens`` of new prose (none for a document chat) plus a question.
    """
    out = []
    for c in range(cfg.conversations):
        seed = cfg.seed + 1000 * c
        rng = random.Random(seed)
        later = cfg.turns - 1 if cfg.turn_tokens else 0
        chunks = corpus.chunks(tokenizer, [cfg.first_tokens] + [cfg.turn_tokens] * later, seed)
        turns = []
        for t in range(cfg.turns):
            if t == 0:
                q = _question(rng, _DOC_QUESTIONS, t, chunks[0])
                turns.append(_DOC_INTRO + corpus.join(chunks[0]) + "\n\n" + q)
            elif cfg.turn_tokens:
                q = _question(rng, _GROWING_QUESTIONS, t, chunks[t])
                turns.append(_MORE_INTRO + corpus.join(chunks[t]) + "\n\n" + q)
            else:
                turns.append(_question(rng, _DOC_QUESTIONS, t, chunks[0]))
        out.append(ChatScript(f"{name}-{c}", tuple(turns)))
    return out
