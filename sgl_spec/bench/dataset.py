"""Multi-turn long-context QA conversations with planted facts (LoopServe-style).

In the spirit of LoopServe's multi-turn benchmark (LoopServe Sec. 4.1): every turn
brings its own context, real prose from ``sgl_spec.corpus`` with short facts
planted in it ("The secret code of the blue lighthouse is 4817."); the turn's question
sits at the beginning, middle or end of that context (diverse query positions) and
asks about a fact of this turn or of an earlier one (diverse query relevance). Answers
are a 4-digit number or one common word, scored by ``sgl_spec.bench.scoring``.

Facts are made for a very small model: every object appears in one fact only per
conversation, every value once in the whole conversation, and the question repeats
the fact's wording. A ``long``-style question (``long_answer_share``) asks for one
sentence that restates the fact's long subject before the value, so that the answer
comes only after ~24 generated tokens, where sparse decode has already reselected. Generation is offline and a pure function of (config, tokenizer):

    >>> convs = generate(DatasetConfig.preset("default"), tokenizer)
    >>> convs[0].turns[1].user_message      # what is sent as the 2nd user message
    >>> stats(convs)

Conversations are meant to be played turn by turn with the model's own answers in
the history (``Conversation.to_workload()`` feeds ``chat_client.play``).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, replace

from sgl_spec import corpus
from sgl_spec.bench.chat_client import CONTEXT_LEN, ChatScript

POSITIONS: tuple[str, ...] = ("begin", "middle", "end")
SOURCES: tuple[str, ...] = ("this_turn", "earlier_turn")
# short: the value alone; long: one sentence restating the whole subject, then the value.
STYLES: tuple[str, ...] = ("short", "long")

COLOURS: tuple[str, ...] = (
    "red", "blue", "green", "yellow", "orange", "purple", "pink", "brown",
    "black", "white", "grey", "golden", "silver",
)
OBJECTS: tuple[str, ...] = (
    "lighthouse", "bicycle", "teapot", "violin", "castle", "umbrella", "tractor",
    "canoe", "windmill", "lantern", "submarine", "piano", "kite", "barn",
    "helicopter", "trumpet", "igloo", "carousel", "telescope", "wagon", "pyramid",
    "scarecrow", "fountain", "tugboat", "balloon", "volcano", "caravan", "treehouse",
    "sailboat", "drum", "rocking chair", "greenhouse",
)
VALUE_WORDS: tuple[str, ...] = (
    "apple", "banana", "cherry", "lemon", "mango", "falcon", "tiger", "zebra",
    "dolphin", "eagle", "rabbit", "panda", "cactus", "tulip", "maple", "pepper",
    "rocket", "anchor", "candle", "pillow", "hammer", "garden", "forest", "island",
    "desert", "thunder", "winter", "summer", "marble", "penguin", "walnut", "harbor",
)
# kind -> (attribute in the sentence, instruction appended to the question)
KINDS: dict[str, tuple[str, str]] = {
    "number": ("secret code", "Answer with the number only."),
    "word": ("password", "Answer with one word only."),
}
LONG_INSTRUCTION = ("Answer with one full sentence that repeats the whole subject of the "
                    "question, then the {what}.")
# Long subjects: "that <who> wrote in <where> during <when>" (~18 words with the key).
# No part repeats within a conversation, so that two facts never share a subject's words.
_WHO = ("the harbour council", "the old lighthouse keeper", "the village schoolteacher",
        "the travelling merchant", "the county surveyor", "the night watchman",
        "the retired sea captain", "the young apprentice baker")
_WHERE = ("a winter maintenance ledger", "the margin of a faded shipping map",
          "a sealed letter to the mayor", "the back page of the parish register",
          "a notebook kept under the counter", "the minutes of the spring assembly",
          "a postcard sent from the coast", "the cover of an old hymn book")
_WHEN = ("the long storm of the northern autumn", "the first week of the harvest fair",
         "the quiet months after the flood", "the annual inspection of the bridges",
         "the hottest summer anyone remembered", "the night the mill burned down",
         "the wedding of the miller's daughter", "the last days of the fishing season")
# Chat-template tokens around each message (SmolLM2: "<|im_start|>user\n...<|im_end|>\n").
TEMPLATE_TOKENS = 24
MIN_TURN_TOKENS = 200

_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def _one_of(what: str, value: str, valid) -> None:
    """ValueError naming ``what`` and the valid values unless ``value`` is one of them."""
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {valid}")


@dataclass(frozen=True)
class DatasetConfig:
    """What to generate; every conversation draws one size from ``tokens_per_turn``
    and a turn count in ``turns`` (inclusive), cycling through all combinations.

    ``tokens_per_turn`` is the length of each user message (context, facts and
    question). ``earlier_turn_share`` is the share of questions about an earlier
    turn among the turns that have one (all turns but the first). ``max_tokens``
    is the answer budget, only used to check that a conversation fits the window.
    """

    seed: int = 0
    conversations: int = 18
    turns: tuple[int, int] = (2, 4)
    tokens_per_turn: tuple[int, ...] = (500, 1000, 1750)
    facts_per_turn: int = 3
    earlier_turn_share: float = 0.5
    positions: tuple[str, ...] = POSITIONS
    max_tokens: int = 32
    # Share of questions in the long style; any > 0 gives every fact a long subject.
    long_answer_share: float = 0.0
    context_len: int = CONTEXT_LEN  # the model's window, that every conversation fits

    def __post_init__(self) -> None:
        if self.conversations <= 0:
            raise ValueError(f"conversations must be positive, got {self.conversations}")
        if len(self.turns) != 2 or not 1 <= self.turns[0] <= self.turns[1]:
            raise ValueError(f"turns must be (min, max) with 1 <= min <= max, got {self.turns}")
        if not self.tokens_per_turn or min(self.tokens_per_turn) < MIN_TURN_TOKENS:
            raise ValueError(
                f"tokens_per_turn must be a non-empty tuple of sizes >= {MIN_TURN_TOKENS}, "
                f"got {self.tokens_per_turn}"
            )
        if not 1 <= self.facts_per_turn * self.turns[1] <= len(OBJECTS):
            raise ValueError(
                f"facts_per_turn * max turns must be in 1..{len(OBJECTS)} (one object per "
                f"fact), got {self.facts_per_turn} * {self.turns[1]}"
            )
        if not 0.0 <= self.earlier_turn_share <= 1.0:
            raise ValueError(f"earlier_turn_share must be in [0, 1], got {self.earlier_turn_share}")
        bad = [p for p in self.positions if p not in POSITIONS]
        if not self.positions or bad or len(set(self.positions)) != len(self.positions):
            raise ValueError(
                f"positions must be distinct values among {POSITIONS}, got {self.positions}"
            )
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not 0.0 <= self.long_answer_share <= 1.0:
            raise ValueError(f"long_answer_share must be in [0, 1], got {self.long_answer_share}")
        if self.long_answer_share > 0 and self.facts_per_turn * self.turns[1] > len(_WHO):
            raise ValueError(f"long subjects are distinct for at most {len(_WHO)} facts per "
                             f"conversation, got {self.facts_per_turn} * {self.turns[1]}")
        need = self.turns[1] * (max(self.tokens_per_turn) + self.max_tokens + TEMPLATE_TOKENS)
        if need > self.context_len:
            raise ValueError(
                f"the longest conversation needs ~{need} tokens, over the "
                f"{self.context_len}-token context window: {self}"
            )

    @classmethod
    def preset(cls, name: str) -> DatasetConfig:
        """``default``: 18 conversations, histories ~1k to ~7k tokens; ``quick``: 3 small;
        ``long-turns``: 27 two-turn conversations of 2300- or 3000-token messages, so
        every turn is an extend of >= 2048 new tokens (the sparse prefill's default
        threshold), 18 questions per position; ``long-context`` (a 32k-window model such
        as ``prepare_model --model qwen2.5-coder-0.5b``): 27 two-turn conversations of
        4200- or 8000-token messages, so 4k-16k tokens precede each question, 18 per
        position, half in the long style; ``long-context-quick``: 3 of them;
        ``late-needles``: 12 one-turn conversations of 3000- or 3600-token messages for the
        default model, one fact each, every question in the long style (the model restates
        the fact's long subject first, so the value comes after the restated subject,
        where LoopServe's first selection at step 16 may already have been made), 4 per
        position."""
        long_context = cls(conversations=27, turns=(2, 2), tokens_per_turn=(4200, 8000),
                           facts_per_turn=1, max_tokens=64, long_answer_share=0.5,
                           context_len=32768)
        presets = {
            "default": cls(),
            "long-turns": cls(conversations=27, turns=(2, 2), tokens_per_turn=(2300, 3000)),
            "quick": cls(conversations=3, turns=(2, 3), tokens_per_turn=(400,),
                         facts_per_turn=2),
            "long-context": long_context,
            "long-context-quick": replace(long_context, conversations=3),
            "late-needles": cls(conversations=12, turns=(1, 1), tokens_per_turn=(3000, 3600),
                                facts_per_turn=1, max_tokens=64, long_answer_share=1.0),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; valid: {sorted(presets)}")
        return presets[name]


@dataclass(frozen=True)
class Fact:
    """One planted fact; ``turn`` is the 0-based turn whose context holds it."""

    turn: int
    colour: str
    object: str
    kind: str
    value: str
    qualifier: str = ""  # a long subject's tail ("that ... wrote in ... during ...")

    def __post_init__(self) -> None:
        _one_of("fact kind", self.kind, sorted(KINDS))
        if not self.value or " " in self.value:
            raise ValueError(f"a fact's value must be one word, got {self.value!r}")

    @property
    def key(self) -> str:
        key = f"{KINDS[self.kind][0]} of the {self.colour} {self.object}"
        return f"{key} {self.qualifier}" if self.qualifier else key

    @property
    def sentence(self) -> str:
        return f"The {self.key} is {self.value}."

    def question(self, style: str = "short") -> str:
        _one_of("question style", style, STYLES)
        instruction = KINDS[self.kind][1] if style == "short" else LONG_INSTRUCTION.format(
            what="number" if self.kind == "number" else "word")
        return f"Question: What is the {self.key}? {instruction}"


@dataclass(frozen=True)
class Turn:
    """One user turn. ``user_message`` is ``question`` placed at ``position`` of
    ``context`` (which holds ``facts``); ``n_tokens`` is its measured length."""

    index: int  # 0-based
    context: str
    facts: tuple[Fact, ...]
    question: str
    position: str
    source: str
    fact: Fact  # the fact asked about
    answer: str
    user_message: str
    n_tokens: int
    style: str = "short"

    def __post_init__(self) -> None:
        _one_of("position", self.position, POSITIONS)
        _one_of("source", self.source, SOURCES)
        _one_of("question style", self.style, STYLES)
        expect = "this_turn" if self.fact.turn == self.index else "earlier_turn"
        if self.source != expect or self.fact.turn > self.index:
            raise ValueError(f"turn {self.index} asks about {self.fact} as {self.source}")
        if self.answer != self.fact.value or self.question not in self.user_message:
            raise ValueError(f"turn {self.index}: answer or question does not match its fact")


@dataclass(frozen=True)
class Conversation:
    name: str
    tokens_per_turn: int  # the target size of every user message
    turns: tuple[Turn, ...]

    @property
    def user_turns(self) -> tuple[str, ...]:
        return tuple(t.user_message for t in self.turns)

    @property
    def history_tokens(self) -> int:
        """Tokens of all user messages (answers and chat template not counted)."""
        return sum(t.n_tokens for t in self.turns)

    def to_workload(self) -> ChatScript:
        """The user messages, for ``chat_client.play`` (answers come from the server)."""
        return ChatScript(self.name, self.user_turns)


# --------------------------------------------------------------------------- generation


def _n_tokens(tokenizer: corpus.Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _word_in(word: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None


def draw_values(rng: random.Random, kinds: list[str], prose: str) -> list[str]:
    """One value per fact: distinct, and absent from the conversation's prose."""
    used: set[str] = set()
    out = []
    for kind in kinds:
        while True:
            value = str(rng.randint(1000, 9999)) if kind == "number" else rng.choice(VALUE_WORDS)
            if value not in used and not _word_in(value, prose):
                break
        used.add(value)
        out.append(value)
    return out


def plant(rng: random.Random, prose: str, sentences: list[str]) -> str:
    """``sentences`` inserted after sentence ends of ``prose``, one per equal share
    of the sentence ends, so that facts spread over the whole context."""
    cuts = [0] + [m.end() for m in _SENTENCE_END.finditer(prose)]
    if len(set(cuts)) < len(sentences):  # too few sentences: any word boundary
        cuts = [0] + [m.start() for m in re.finditer(r"\s", prose)] + [len(prose)]
    cuts = sorted(set(cuts))
    k = len(sentences)
    chosen = [rng.choice(cuts[len(cuts) * i // k: len(cuts) * (i + 1) // k]) for i in range(k)]
    text = prose
    for cut, sentence in sorted(zip(chosen, sentences), reverse=True):
        if cut == 0:
            text = f"{sentence} {text}"
        else:
            text = f"{text[:cut]} {sentence}{text[cut:]}"
    return text


def _middle_cut(context: str, question_len: int) -> int:
    """Where to split ``context`` so that the question lies in the middle third of
    the message: a paragraph break if there is one, else a sentence end, else a
    space; nearest the middle."""
    extra = question_len + 4  # the question and its two blank lines
    n = len(context)
    lo, hi = (n + extra) / 3 + 2, 2 * (n + extra) / 3 - extra - 2
    if lo > hi:  # a context too short for that: its own middle third
        lo, hi = n / 3, 2 * n / 3
    for pattern in (r"\n\n", _SENTENCE_END.pattern, r" "):
        cuts = [m.end() for m in re.finditer(pattern, context) if lo <= m.end() <= hi]
        if cuts:
            return min(cuts, key=lambda c: abs(c - n // 2))
    return n // 2


def place(question: str, context: str, position: str) -> str:
    """The user message: ``question`` at the ``position`` of ``context``."""
    if position == "begin":
        return f"{question}\n\n{context}"
    if position == "end":
        return f"{context}\n\n{question}"
    if position == "middle":
        cut = _middle_cut(context, len(question))
        return f"{context[:cut].rstrip()}\n\n{question}\n\n{context[cut:].lstrip()}"
    raise ValueError(f"unknown position {position!r}; valid: {POSITIONS}")


def _conversation(tokenizer: corpus.Tokenizer, name: str, seed: int, n_turns: int,
                  size: int, facts_per_turn: int, positions: list[str],
                  earlier: list[bool], styles: list[str], long_subjects: bool
                  ) -> Conversation:
    rng = random.Random(seed)
    n_facts = n_turns * facts_per_turn
    objects = rng.sample(OBJECTS, n_facts)
    colours = [rng.choice(COLOURS) for _ in range(n_facts)]
    kinds = [rng.choice(sorted(KINDS)) for _ in range(n_facts)]
    qualifiers = [""] * n_facts
    if long_subjects:
        parts = zip(rng.sample(_WHO, n_facts), rng.sample(_WHERE, n_facts),
                    rng.sample(_WHEN, n_facts))
        qualifiers = [f"that {who} wrote in {where} during {when}" for who, where, when in parts]

    # Which fact each turn asks: a fact of this turn, or an earlier one not yet asked.
    asked: list[int] = []
    for t in range(n_turns):
        if earlier[t]:
            pool = [i for i in range(t * facts_per_turn) if i not in asked] or list(
                range(t * facts_per_turn))
        else:
            pool = list(range(t * facts_per_turn, (t + 1) * facts_per_turn))
        asked.append(rng.choice(pool))

    # Prose budget: the message less its facts and question (values are 1-4 tokens;
    # a placeholder of 4 digits stands for them, the message is measured at the end).
    sizes = []
    for t in range(n_turns):
        probe = [Fact(t, colours[i], objects[i], kinds[i], "1234", qualifiers[i])
                 for i in range(t * facts_per_turn, (t + 1) * facts_per_turn)]
        overhead = sum(_n_tokens(tokenizer, " " + f.sentence) for f in probe)
        i = asked[t]
        overhead += _n_tokens(tokenizer, Fact(t, colours[i], objects[i], kinds[i], "1234",
                                              qualifiers[i]).question(styles[t])) + 4
        sizes.append(size - overhead)
    prose = [corpus.join(chunk) for chunk in corpus.chunks(tokenizer, sizes, seed)]
    values = draw_values(rng, kinds, "\n".join(prose))
    facts = [Fact(i // facts_per_turn, colours[i], objects[i], kinds[i], values[i],
                  qualifiers[i]) for i in range(n_facts)]

    turns = []
    for t in range(n_turns):
        planted = tuple(facts[t * facts_per_turn: (t + 1) * facts_per_turn])
        context = plant(rng, prose[t], [f.sentence for f in planted])
        fact = facts[asked[t]]
        question = fact.question(styles[t])
        message = place(question, context, positions[t])
        turns.append(Turn(
            index=t, context=context, facts=planted, question=question,
            position=positions[t], source="earlier_turn" if earlier[t] else "this_turn",
            fact=fact, answer=fact.value, user_message=message,
            n_tokens=_n_tokens(tokenizer, message), style=styles[t],
        ))
    return Conversation(name, size, tuple(turns))


def generate(config: DatasetConfig, tokenizer: corpus.Tokenizer) -> list[Conversation]:
    """``config.conversations`` conversations, a pure function of (config, tokenizer).

    Shapes (turn count, size) cycle through all combinations in a seeded order;
    positions are dealt round-robin over all turns and earlier-turn questions to
    ``round(earlier_turn_share * eligible turns)`` of the turns after the first,
    so the dataset is balanced, not just balanced on average; long-style questions
    likewise to ``round(long_answer_share * turns)`` turns, dealt per position.
    """
    rng = random.Random(config.seed)
    shapes = list(itertools.product(range(config.turns[0], config.turns[1] + 1),
                                    config.tokens_per_turn))
    rng.shuffle(shapes)
    shapes = [shapes[c % len(shapes)] for c in range(config.conversations)]

    total = sum(n for n, _ in shapes)
    positions = [config.positions[i % len(config.positions)] for i in range(total)]
    rng.shuffle(positions)
    eligible = [(c, t) for c, (n, _) in enumerate(shapes) for t in range(1, n)]
    rng.shuffle(eligible)
    earlier = set(eligible[: round(config.earlier_turn_share * len(eligible))])
    # Long style: the first share of each position's turns in a seeded order, so that
    # every position has (nearly) the same share.
    order = list(range(total))
    rng.shuffle(order)
    styles = ["short"] * total
    for p in config.positions:
        mine = [i for i in order if positions[i] == p]
        for i in mine[: round(config.long_answer_share * len(mine))]:
            styles[i] = "long"

    out = []
    start = 0
    for c, (n_turns, size) in enumerate(shapes):
        out.append(_conversation(
            tokenizer, f"qa-{config.seed}-{c}", seed=config.seed * 100_003 + c,
            n_turns=n_turns, size=size, facts_per_turn=config.facts_per_turn,
            positions=positions[start: start + n_turns],
            earlier=[(c, t) in earlier for t in range(n_turns)],
            styles=styles[start: start + n_turns],
            long_subjects=config.long_answer_share > 0,
        ))
        start += n_turns
    return out


# --------------------------------------------------------------------------- stats, io


def _spread(xs: list[int]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def stats(conversations: list[Conversation]) -> dict:
    """Counts and token spreads; ``history_tokens`` sums a conversation's user messages."""
    turns = [t for c in conversations for t in c.turns]
    return {
        "conversations": len(conversations),
        "turns": len(turns),
        "turns_per_conversation": dict(sorted(Counter(len(c.turns) for c in conversations)
                                              .items())),
        "tokens_per_turn": _spread([t.n_tokens for t in turns]),
        "history_tokens": _spread([c.history_tokens for c in conversations]),
        "positions": {p: n for p in POSITIONS if (n := sum(t.position == p for t in turns))},
        "sources": {s: n for s in SOURCES if (n := sum(t.source == s for t in turns))},
        "facts": sum(len(t.facts) for t in turns),
        "styles": {s: n for s in STYLES if (n := sum(t.style == s for t in turns))},
        "answer_kinds": dict(sorted(Counter(t.fact.kind for t in turns).items())),
    }


def to_jsonl(conversations: list[Conversation], path: str) -> None:
    with open(path, "w") as f:
        for c in conversations:
            f.write(json.dumps(asdict(c)) + "\n")


def _turn(d: dict) -> Turn:
    return Turn(**{**d, "facts": tuple(Fact(**f) for f in d["facts"]), "fact": Fact(**d["fact"])})


def from_jsonl(path: str) -> list[Conversation]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Conversation(r["name"], r["tokens_per_turn"], tuple(_turn(t) for t in r["turns"]))
            for r in rows]


__all__ = [
    "POSITIONS", "SOURCES", "STYLES", "DatasetConfig", "Fact", "Turn", "Conversation",
    "generate", "place", "plant", "draw_values", "stats", "to_jsonl", "from_jsonl",
]
