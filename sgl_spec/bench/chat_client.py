"""Play conversations turn by turn through a server's OpenAI chat API, timing each turn.

Each turn is one streaming ``/v1/chat/completions`` request, greedy (temperature 0).
Besides timing, it asks sglang for the prompt and output token ids
(``return_{input,output}_ids_in_sglext``) and the top-2 logprobs at every output
position, so that two servers' answers can be compared token by token and a
divergence's logit margin read off without another request. The server must run
with ``--enable-cache-report`` for ``cached_tokens`` to be filled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from sgl_spec.bench.timing import Stopwatch

TOP_LOGPROBS = 2
# The default model's (SmolLM2) context window: a played conversation, its answers
# included, must fit.
CONTEXT_LEN = 8192


@dataclass(frozen=True)
class ChatScript:
    """The user messages of one conversation; the answers come from a server."""

    name: str
    user_turns: tuple[str, ...]


class PlayItem(NamedTuple):
    """One conversation to play and its per-turn answer budget. ``ignore_eos`` asks
    the server for exactly ``max_tokens`` tokens (fixed-length long generations)."""

    conversation: ChatScript
    max_tokens: int
    ignore_eos: bool = False


@dataclass(frozen=True)
class TurnResult:
    """One turn as one server answered it. Times in seconds, from the request send.

    ``top_logprobs[i]`` holds the two most likely ``(token_text, logprob)`` at output
    position i; the final EOS token has ids but no logprobs entry.
    """

    conversation: str
    turn: int  # 1-based
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finish_reason: str
    text: str
    prompt_sha1: str  # of the prompt token ids: both servers must be sent the same
    output_ids: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[str, float], ...], ...]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (as bench_serving defines it)."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def from_json(cls, d: dict) -> "TurnResult":
        """The inverse of ``asdict`` after a JSON round trip (lists back to tuples)."""
        return cls(**{**d, "output_ids": tuple(d["output_ids"]),
                      "top_logprobs": tuple(tuple(map(tuple, p)) for p in d["top_logprobs"])})


def _sha1(ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()


def stream_turn(client, model: str, messages: list[dict], max_tokens: int,
                conversation: str, turn: int, ignore_eos: bool = False) -> TurnResult:
    """Send one chat request and collect its timing, ids, logprobs and usage."""
    extra = {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    if ignore_eos:  # only then, so that other requests stay byte-identical to before
        extra["ignore_eos"] = True
    watch = Stopwatch()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
        logprobs=True, top_logprobs=TOP_LOGPROBS, extra_body=extra,
    )
    ttft = None
    end = None
    parts: list[str] = []
    top: list[tuple[tuple[str, float], ...]] = []
    finish = ""
    usage = None
    input_ids: list[int] = []
    output_ids: list[int] = []
    for chunk in stream:
        now = watch.elapsed()
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                ttft = now if ttft is None else ttft
                parts.append(choice.delta.content)
            if choice.logprobs and choice.logprobs.content:
                top.extend(
                    tuple((t.token, t.logprob) for t in item.top_logprobs)
                    for item in choice.logprobs.content
                )
            if choice.finish_reason:
                finish, end = choice.finish_reason, now
        ext = (chunk.model_extra or {}).get("sglext")
        if ext:
            input_ids = ext.get("input_ids") or input_ids
            output_ids = (ext.get("output_ids") or [output_ids])[0]
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError(f"{conversation} turn {turn}: the stream carried no usage chunk")
    end = end if end is not None else watch.elapsed()
    details = usage.prompt_tokens_details
    return TurnResult(
        conversation=conversation,
        turn=turn,
        ttft_s=ttft if ttft is not None else end,
        latency_s=end,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
        output_tokens=usage.completion_tokens,
        finish_reason=finish,
        text="".join(parts),
        prompt_sha1=_sha1(input_ids),
        output_ids=tuple(output_ids),
        top_logprobs=tuple(top),
    )


def play(client, model: str, conversation: ChatScript, max_tokens: int,
         history: list[str] | None = None,
         on_turn: Callable[[TurnResult], None] | None = None,
         ignore_eos: bool = False) -> list[TurnResult]:
    """Play ``conversation`` turn by turn; returns one ``TurnResult`` per turn.

    The assistant messages in the history are this server's own answers, or, when
    ``history`` is given (one answer per turn), those answers instead: the speed
    chats pin the history to the first row's answers so that, after a divergence,
    later turns still send every row the same prompt.
    """
    if history is not None and len(history) != len(conversation.user_turns):
        raise ValueError(
            f"{conversation.name}: history has {len(history)} answers for "
            f"{len(conversation.user_turns)} turns"
        )
    messages: list[dict] = []
    results = []
    for i, user in enumerate(conversation.user_turns):
        messages.append({"role": "user", "content": user})
        result = stream_turn(client, model, messages, max_tokens, conversation.name, i + 1,
                             ignore_eos)
        results.append(result)
        if on_turn is not None:
            on_turn(result)
        answer = history[i] if history is not None else result.text
        messages.append({"role": "assistant", "content": answer})
    return results


def warmup(client, model: str) -> None:
    """One short greedy request, so that the first timed turn pays no lazy start-up."""
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0.0,
    )


def make_client(base_url: str, timeout_s: float = 900.0, api_key: str = "none"):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, timeout=timeout_s,
                         max_retries=0)
