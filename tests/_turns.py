"""A synthetic chat format for turn tests (no sglang): ChatML-like special tokens,
plain content tokens >= 20, a reasoning span the template drops from history."""

from __future__ import annotations

from sgl_spec.cache.turn_format import TurnFormat

IM_START, IM_END, SYSTEM, USER, ASSISTANT, TOOL, NL, THINK, END_THINK = range(1, 10)
ROLE_TOKEN = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
FMT = TurnFormat(
    openers=tuple((r, (IM_START, t)) for r, t in ROLE_TOKEN.items()),
    end=(IM_END,),
    think=((THINK,), (END_THINK,)),
    drops_reasoning=True,
)


def turn(role: str, content: list[int], reasoning: list[int] | None = None) -> list[int]:
    body = list(content)
    if reasoning is not None:
        body = [THINK, *reasoning, END_THINK, *body]
    return [IM_START, ROLE_TOKEN[role], NL, *body, IM_END, NL]
