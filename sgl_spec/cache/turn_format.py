"""Where turns begin and end, derived from the model's own chat template.

A :class:`TurnFormat` holds token patterns: the opener of each role's turn
(ChatML ``<|im_start|>user``, Llama-3 ``<|start_header_id|>user<|end_header_id|>``),
the end-of-turn marker, and the reasoning-span markers. Nothing is hard-coded for
one model: :func:`derive` renders a probe conversation through the template,
reads the text between the messages, and tokenizes it with the model's tokenizer.

It also records whether the template drops an earlier assistant turn's reasoning
from the history it renders (Qwen3- and DeepSeek-R1-style templates do); cached
reasoning of a finished turn can then never be matched again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# Probe contents: plain words that tokenize on their own in any BPE vocabulary.
_PROBE = {role: f"probe {role} content" for role in ROLES}
_PROBE_REASONING = "probe hidden thought"
_PROBE_ANSWER = "probe final answer"
_TOOL_PROBE = [
    {"role": "user", "content": "probe question"},
    {"role": "assistant", "content": "probe call"},
    {"role": "tool", "content": _PROBE["tool"]},
]


@dataclass(frozen=True)
class TurnFormat:
    """Token patterns of one chat format. Immutable; shared by cache and tests.

    openers:  (role, token ids) for each role the template renders, e.g.
              ("user", (1, 4093)) for ChatML's ``<|im_start|>user``.
    end:      token ids of the end-of-turn marker (``<|im_end|>``), or ().
    think:    (start ids, end ids) of the reasoning span, or None.
    drops_reasoning: the template leaves an earlier assistant turn's reasoning out
              of the history it renders.
    """

    openers: tuple[tuple[str, tuple[int, ...]], ...]
    end: tuple[int, ...] = ()
    think: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    drops_reasoning: bool = False
    first_ids: tuple[int, ...] = field(init=False, repr=False)
    # (pattern, kind, role) in match order, and the longest pattern's length.
    kinds: tuple = field(init=False, repr=False)
    longest: int = field(init=False, repr=False)

    def __post_init__(self):
        if not self.openers:
            raise ValueError("TurnFormat needs at least one role opener")
        for role, ids in self.openers:
            if role not in ROLES or not ids:
                raise ValueError(
                    f"bad opener {role!r}={ids!r}; roles must be one of {', '.join(ROLES)} "
                    "with a non-empty token pattern"
                )
        patterns = [ids for _, ids in self.openers] + [self.end]
        if self.think is not None:
            patterns += list(self.think)
        object.__setattr__(
            self, "first_ids", tuple(sorted({p[0] for p in patterns if p}))
        )
        kinds = [(tuple(ids), 0, role) for role, ids in self.openers]
        if self.end:
            kinds.append((tuple(self.end), 1, None))
        if self.think is not None:
            kinds += [(tuple(self.think[0]), 2, None), (tuple(self.think[1]), 3, None)]
        # Longest first, so a pattern that prefixes another never shadows it.
        kinds.sort(key=lambda k: -len(k[0]))
        object.__setattr__(self, "kinds", tuple(kinds))
        object.__setattr__(self, "longest", len(kinds[0][0]))

    def opener_len(self, role: str | None) -> int:
        for r, ids in self.openers:
            if r == role:
                return len(ids)
        return 0

    def describe(self) -> dict:
        return {
            "openers": {r: list(ids) for r, ids in self.openers},
            "end": list(self.end),
            "think": None if self.think is None else [list(t) for t in self.think],
            "drops_reasoning": self.drops_reasoning,
        }


def _render(tokenizer, template: str | None, messages: list[dict]) -> str:
    kwargs = {"tokenize": False, "add_generation_prompt": False}
    if template is not None:
        kwargs["chat_template"] = template
    return tokenizer.apply_chat_template(messages, **kwargs)


def _inside(tokenizer, text: str, start: int, end: int) -> tuple[int, ...]:
    """Ids of the tokens of ``text`` that lie wholly in [start, end), tokenized in
    context: markers that are plain text (not special tokens) can merge with
    their neighbours, so a boundary sits at the nearest whole token."""
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    return tuple(
        i for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
        if a >= start and b <= end and b > a
    )


def _spans_between(rendered: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Char ranges before each message's content (after the previous one's), and
    the tail after the last."""
    out, pos = [], 0
    for m in messages:
        at = rendered.find(m["content"], pos)
        if at < 0:
            raise ValueError(f"chat template did not render message {m['role']!r}")
        out.append((pos, at))
        pos = at + len(m["content"])
    out.append((pos, len(rendered)))
    return out


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def derive(
    tokenizer,
    chat_template: str | None = None,
    reasoning: tuple[str, str] | None = None,
) -> TurnFormat:
    """Derive the turn format of ``tokenizer``'s chat template (or ``chat_template``).

    ``reasoning`` is the model's reasoning markers, e.g. ``("<think>", "</think>")``
    from sglang's ``--reasoning-parser``; None means the model has no reasoning spans.
    Raises ValueError when the template cannot render a user/assistant exchange.
    """
    roles = ["system", "user", "assistant", "user", "assistant"]
    messages = [{"role": r, "content": _PROBE[r] + f" {i}"} for i, r in enumerate(roles)]
    text = _render(tokenizer, chat_template, messages)
    gaps = _spans_between(text, messages)
    # The tail after the last message is that turn's end marker (plus whitespace).
    end_text = text[slice(*_strip(text, *gaps[-1]))]
    if not end_text:
        raise ValueError("chat template renders no end-of-turn marker after a message")

    def opener_range(gap: tuple[int, int]) -> tuple[int, int]:
        # A gap is [end of previous turn] + [opener of this turn].
        cut = text.rfind(end_text, *gap)
        return _strip(text, cut + len(end_text) if cut >= 0 else gap[0], gap[1])

    user = opener_range(gaps[3])
    if "user" not in text[slice(*user)]:
        raise ValueError(f"cannot find the user opener in {text[slice(*gaps[3])]!r}")
    openers = {
        "user": _inside(tokenizer, text, *user),
        "assistant": _inside(tokenizer, text, *opener_range(gaps[4])),
    }
    cut = text.rfind(end_text, *gaps[3])
    end = _inside(tokenizer, text, cut, cut + len(end_text))
    # The first message's gap also holds BOS and template preambles, so the other
    # roles' openers are the user opener with the role name swapped, where the
    # template renders exactly that.
    user_text = text[slice(*user)]
    for role, probe in (("system", messages[:2]), ("tool", _TOOL_PROBE)):
        try:
            probe_text = _render(tokenizer, chat_template, probe)
        except Exception:  # templates without a tool role
            logger.info("chat template cannot render role %r; not tagged", role)
            continue
        at = probe_text.find(user_text.replace("user", role))
        if at >= 0:
            openers[role] = _inside(tokenizer, probe_text, at, at + len(user_text) - 4
                                    + len(role))

    think = None
    drops = False
    if reasoning is not None:
        start, stop = reasoning
        probe = [
            {"role": "user", "content": "probe question"},
            {"role": "assistant",
             "content": f"{start}\n{_PROBE_REASONING}\n{stop}\n\n{_PROBE_ANSWER}"},
            {"role": "user", "content": "probe follow up"},
        ]
        kept = _render(tokenizer, chat_template, probe[:2])
        a, b = kept.find(start), kept.find(stop)
        if a < 0 or b < 0:
            raise ValueError(f"chat template does not render reasoning markers {reasoning}")
        think = (_inside(tokenizer, kept, a, a + len(start)),
                 _inside(tokenizer, kept, b, b + len(stop)))
        later = _render(tokenizer, chat_template, probe)
        drops = _PROBE_ANSWER in later and _PROBE_REASONING not in later
    fmt = TurnFormat(
        openers=tuple(openers.items()),
        end=end,
        think=think,
        drops_reasoning=drops,
    )
    logger.info("turn format: %s", fmt.describe())
    return fmt
