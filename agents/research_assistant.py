"""A research assistant over one local document, in SGLang's frontend language.

Flow (one ``@sgl.function``, four kinds of gen call):

1. ``plan``: the document goes into the conversation once, followed by the
   research question; the model lists 2-4 sub-questions, one per line.
2. ``answer`` x N: ``s.fork(N)`` answers the sub-questions in parallel. Every
   fork starts from the same document + plan prefix, so the server's radix
   cache serves that prefix and each fork prefills only its own question.
3. ``report``: the fork results are read back and written into the main
   conversation (join), and a final gen writes the report.
4. ``follow_up`` (optional): one more turn on the same conversation.

Run against a server: ``python -m sgl_spec.agents.research_assistant --port N``; with
``--api openai`` the same calls go through any OpenAI-compatible chat API (llama.cpp's
``llama-server`` too), the forks sent at once from threads.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import sglang as sgl

DEFAULT_MODULE = "textwrap"
DEFAULT_QUESTION = "What is this module for, and how do you use it?"
# ~4 characters per token for English docs with SmolLM2's tokenizer: about 1.7k tokens.
DEFAULT_MAX_CHARS = 7000
MIN_SUB_QUESTIONS = 2
MAX_SUB_QUESTIONS = 4
# Used when the 135M model's plan cannot be parsed into enough questions.
FALLBACK_SUB_QUESTIONS = (
    "What is the main purpose of the document?",
    "What are the most important functions or ideas it describes?",
    "What options or details should a user know about?",
)

SYSTEM_PROMPT = "You are a helpful research assistant. Answer briefly, using only the document."


@dataclass(frozen=True)
class AgentConfig:
    """Generation budget for each kind of call; greedy decoding throughout."""

    max_sub_questions: int = 3
    plan_tokens: int = 64
    answer_tokens: int = 64
    report_tokens: int = 128
    follow_up_tokens: int = 64

    def __post_init__(self) -> None:
        if not MIN_SUB_QUESTIONS <= self.max_sub_questions <= MAX_SUB_QUESTIONS:
            raise ValueError(
                f"max_sub_questions={self.max_sub_questions}; valid: "
                f"{MIN_SUB_QUESTIONS}..{MAX_SUB_QUESTIONS}"
            )
        for name in ("plan_tokens", "answer_tokens", "report_tokens", "follow_up_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")


@dataclass(frozen=True)
class CallStats:
    """One gen call as the server reported it (meta_info)."""

    name: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class AgentResult:
    question: str
    plan: str
    sub_questions: list[str]
    sub_answers: list[str]
    report: str
    follow_up: str | None
    calls: list[CallStats] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.calls)

    @property
    def cached_tokens(self) -> int:
        return sum(c.cached_tokens for c in self.calls)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict:
        out = asdict(self)
        out["calls"] = [dict(asdict(c), hit_ratio=c.hit_ratio) for c in self.calls]
        out.update(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                   hit_ratio=self.hit_ratio)
        return out


# ---------------------------------------------------------------------------
# Documents


def truncate(text: str, max_chars: int) -> str:
    """Cut ``text`` to at most ``max_chars``, at a paragraph (else line) boundary."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for sep in ("\n\n", "\n"):
        cut = head.rfind(sep)
        if cut > max_chars // 2:
            return head[:cut].rstrip()
    return head.rstrip()


def stdlib_document(module_name: str = DEFAULT_MODULE, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Prose built from a stdlib module's docstrings: the module, then each public
    class (with its public methods) and function, with signatures."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    parts = [f"Documentation of the Python module `{module_name}`.", inspect.getdoc(module) or ""]
    for name in names:
        obj = getattr(module, name, None)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not inspect.getdoc(obj):
            continue
        if getattr(obj, "__module__", module_name) != module_name:
            continue
        parts.append(f"{name}{_signature(obj)}\n{inspect.getdoc(obj)}")
        if inspect.isclass(obj):
            for meth_name, meth in vars(obj).items():
                if meth_name.startswith("_") or not inspect.isfunction(meth):
                    continue
                if inspect.getdoc(meth):
                    parts.append(f"{name}.{meth_name}{_signature(meth)}\n{inspect.getdoc(meth)}")
    return truncate("\n\n".join(p for p in parts if p), max_chars)


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def load_document(path: str | None, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    if path is None:
        return stdlib_document(DEFAULT_MODULE, max_chars)
    with open(path, encoding="utf-8", errors="replace") as f:
        text = truncate(f.read(), max_chars)
    if not text:
        raise ValueError(f"document {path!r} is empty")
    return text


# ---------------------------------------------------------------------------
# Plan parsing

# "1." "2)" "(3)" "-" "*" "a)" "Q1:" "Question 2:" at the start of a line.
_BULLET = re.compile(
    r"^\s*(?:[-*\u2022]|\(?\d+[.):]|\(?[a-z][.)]|question\s*\d*[.:)]|q\d*[.:)])\s*",
    re.IGNORECASE,
)


def parse_sub_questions(plan: str, max_questions: int = 3) -> list[str]:
    """Sub-questions from the planner's text: one per line, numbering and bullets
    stripped, duplicates dropped. Lines ending in '?' are preferred; other lines of
    at least four words count if there are too few questions. Falls back to
    ``FALLBACK_SUB_QUESTIONS`` when fewer than two remain."""
    questions: list[str] = []
    others: list[str] = []
    seen: set[str] = set()
    for raw in plan.splitlines():
        line = _BULLET.sub("", raw.strip()).strip().strip("*").strip()
        key = line.lower().rstrip("?. ")
        if not key or key in seen:
            continue
        seen.add(key)
        if line.endswith("?") and len(line.split()) >= 3:
            questions.append(line)
        elif len(line.split()) >= 4 and not line.endswith(":"):
            others.append(line)
    picked = (questions + others)[:max_questions]
    if len(picked) < MIN_SUB_QUESTIONS:
        return list(FALLBACK_SUB_QUESTIONS[:max_questions])
    return picked


# ---------------------------------------------------------------------------
# The agent


def plan_message(document: str, question: str, n: int) -> str:
    return (f"Here is a document.\n\n{document}\n\n"
            f"Research question: {question}\n"
            f"Write {n} short questions about the document that help answer "
            "the research question. Write one question per line and nothing else.")


def answer_message(sub_question: str) -> str:
    return f"Answer this question in one or two sentences: {sub_question}"


def report_message(question: str, answers: list[str]) -> str:
    findings = "\n".join(f"- {a}" for a in answers)
    return (f"Write a short report of two or three sentences that answers: {question}\n"
            f"Use these findings:\n{findings}")


@sgl.function
def research(s, document: str, question: str, config: AgentConfig, follow_up: str | None):
    s += sgl.system(SYSTEM_PROMPT)
    s += sgl.user(plan_message(document, question, config.max_sub_questions))
    s += sgl.assistant(sgl.gen("plan", max_tokens=config.plan_tokens, temperature=0))
    sub_questions = parse_sub_questions(s["plan"], config.max_sub_questions)

    # Every fork shares the system + document + plan prefix (committed to the server
    # by fork itself), so only the sub-question is new to the cache.
    forks = s.fork(len(sub_questions))
    for f, sub_question in zip(forks, sub_questions):
        f += sgl.user(answer_message(sub_question))
        f += sgl.assistant(sgl.gen("answer", max_tokens=config.answer_tokens, temperature=0))
    answers = [f["answer"].strip() for f in forks]  # waits for every fork
    fork_meta = [f.get_meta_info("answer") for f in forks]

    # Join: the findings become part of the main conversation.
    s += sgl.user(report_message(question, answers))
    s += sgl.assistant(sgl.gen("report", max_tokens=config.report_tokens, temperature=0))
    if follow_up:
        s += sgl.user(follow_up)
        s += sgl.assistant(sgl.gen("follow_up", max_tokens=config.follow_up_tokens, temperature=0))
    return sub_questions, answers, fork_meta


def _stats(name: str, meta: dict | None) -> CallStats:
    if not meta or "prompt_tokens" not in meta:
        raise RuntimeError(f"gen call {name!r} returned no meta_info with prompt_tokens: {meta!r}")
    return CallStats(name, int(meta["prompt_tokens"]), int(meta.get("cached_tokens", 0)),
                     int(meta.get("completion_tokens", 0)))


def run_research(
    url: str,
    document: str,
    question: str = DEFAULT_QUESTION,
    config: AgentConfig | None = None,
    follow_up: str | None = None,
    chat_template: str | None = None,
) -> AgentResult:
    """Run the agent against the sglang server at ``url`` and collect its stats.

    ``chat_template=None`` lets sglang pick the template from the served model's path.
    """
    config = config or AgentConfig()
    backend = sgl.RuntimeEndpoint(url, chat_template_name=chat_template)
    start = time.perf_counter()
    state = research.run(document=document, question=question, config=config,
                         follow_up=follow_up, backend=backend)
    state.sync()
    if state.error() is not None:
        raise RuntimeError(f"research agent failed: {state.error()!r}")
    sub_questions, answers, fork_meta = state.ret_value
    elapsed = time.perf_counter() - start

    calls = [_stats("plan", state.get_meta_info("plan"))]
    calls += [_stats(f"answer[{i}]", m) for i, m in enumerate(fork_meta)]
    calls.append(_stats("report", state.get_meta_info("report")))
    if follow_up:
        calls.append(_stats("follow_up", state.get_meta_info("follow_up")))
    return AgentResult(
        question=question,
        plan=state["plan"].strip(),
        sub_questions=list(sub_questions),
        sub_answers=list(answers),
        report=state["report"].strip(),
        follow_up=state["follow_up"].strip() if follow_up else None,
        calls=calls,
        elapsed_s=elapsed,
    )


def run_research_openai(
    base_url: str,
    document: str,
    question: str = DEFAULT_QUESTION,
    config: AgentConfig | None = None,
    follow_up: str | None = None,
    model: str | None = None,
    pinned: AgentResult | None = None,
    api_key: str = "EMPTY",
) -> AgentResult:
    """The same calls through any server's OpenAI chat API (sglang's ``/v1``, llama.cpp's
    ``llama-server``): the plan, then the forks sent at once from threads, the join when
    all have answered, the report and the follow-up. Each call's cached tokens are the
    server's ``usage.prompt_tokens_details.cached_tokens`` (0 where it reports none).

    ``pinned``, another server's result, supplies the plan, answers and report that the
    later prompts carry, so that two servers are sent the same prompts; each server's own
    texts are what is returned.
    """
    import openai

    config = config or AgentConfig()
    client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key)
    model = model or client.models.list().data[0].id

    def call(name: str, messages: list[dict], max_tokens: int) -> tuple[str, CallStats]:
        ret = client.chat.completions.create(model=model, messages=messages,
                                             max_tokens=max_tokens, temperature=0)
        usage = ret.usage
        details = getattr(usage, "prompt_tokens_details", None)
        cached = (getattr(details, "cached_tokens", None) or 0) if details else 0
        return ((ret.choices[0].message.content or "").strip(),
                CallStats(name, usage.prompt_tokens, cached, usage.completion_tokens))

    def user(text: str) -> dict:
        return {"role": "user", "content": text}

    def assistant(text: str) -> dict:
        return {"role": "assistant", "content": text}

    start = time.perf_counter()
    conv = [{"role": "system", "content": SYSTEM_PROMPT},
            user(plan_message(document, question, config.max_sub_questions))]
    plan, plan_call = call("plan", conv, config.plan_tokens)
    sub_questions = (pinned.sub_questions if pinned
                     else parse_sub_questions(plan, config.max_sub_questions))
    conv.append(assistant(pinned.plan if pinned else plan))
    with ThreadPoolExecutor(len(sub_questions)) as pool:  # fork
        forked = list(pool.map(
            lambda iq: call(f"answer[{iq[0]}]", [*conv, user(answer_message(iq[1]))],
                            config.answer_tokens), enumerate(sub_questions)))
    answers = [a for a, _ in forked]                      # join
    conv.append(user(report_message(question, pinned.sub_answers if pinned else answers)))
    report, report_call = call("report", conv, config.report_tokens)
    calls = [plan_call, *(c for _, c in forked), report_call]
    answer_follow_up = None
    if follow_up:
        conv += [assistant(pinned.report if pinned else report), user(follow_up)]
        answer_follow_up, follow_call = call("follow_up", conv, config.follow_up_tokens)
        calls.append(follow_call)
    return AgentResult(question=question, plan=plan, sub_questions=list(sub_questions),
                       sub_answers=answers, report=report, follow_up=answer_follow_up,
                       calls=calls, elapsed_s=time.perf_counter() - start)


# ---------------------------------------------------------------------------
# CLI


def format_result(result: AgentResult) -> str:
    lines = [f"Research question: {result.question}", "", "Plan:", result.plan, ""]
    for i, (q, a) in enumerate(zip(result.sub_questions, result.sub_answers), 1):
        lines += [f"Sub-question {i}: {q}", f"Answer {i}: {a}", ""]
    lines += ["Report:", result.report, ""]
    if result.follow_up is not None:
        lines += ["Follow-up:", result.follow_up, ""]
    lines.append(f"{'call':<12}{'prompt':>8}{'cached':>8}{'output':>8}{'hit':>8}")
    for c in result.calls:
        lines.append(f"{c.name:<12}{c.prompt_tokens:>8}{c.cached_tokens:>8}"
                     f"{c.completion_tokens:>8}{c.hit_ratio:>8.1%}")
    lines.append(f"{'total':<12}{result.prompt_tokens:>8}{result.cached_tokens:>8}"
                 f"{'':>8}{result.hit_ratio:>8.1%}")
    lines.append(f"elapsed: {result.elapsed_s:.1f} s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_spec.agents.research_assistant",
        description="Research assistant over a local document (plan, fork/join, report).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--doc", default=None,
                   help=f"text file to research (default: docstrings of the `{DEFAULT_MODULE}` module)")
    p.add_argument("--max-doc-chars", type=int, default=DEFAULT_MAX_CHARS,
                   help="truncate the document to this many characters (~4 per token)")
    p.add_argument("--question", default=DEFAULT_QUESTION)
    p.add_argument("--follow-up", default=None, help="optional follow-up question, asked last")
    p.add_argument("--sub-questions", type=int, default=AgentConfig.max_sub_questions,
                   help=f"how many sub-questions to plan ({MIN_SUB_QUESTIONS}-{MAX_SUB_QUESTIONS})")
    p.add_argument("--api", choices=("sglang", "openai"), default="sglang",
                   help="sglang: the frontend language over sglang's native API (fork shares "
                   "the prefix); openai: the same calls through any OpenAI-compatible chat API, "
                   "e.g. llama.cpp's llama-server (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="--api openai: the model name to send (default: the server's first)")
    p.add_argument("--chat-template", default=None,
                   help="--api sglang: sglang chat template name (default: picked from the "
                   "model path)")
    for kind in ("plan", "answer", "report", "follow-up"):
        field = kind.replace("-", "_") + "_tokens"
        p.add_argument(f"--{kind}-tokens", type=int, default=getattr(AgentConfig, field),
                       help=f"most tokens each {kind} call generates (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_doc_chars <= 0:
        parser.error(f"--max-doc-chars={args.max_doc_chars} must be positive")
    wrong = "--model" if args.api == "sglang" and args.model else (
        "--chat-template" if args.api == "openai" and args.chat_template else None)
    if wrong:
        parser.error(f"{wrong} is read only with --api "
                     f"{'openai' if wrong == '--model' else 'sglang'}; valid: drop it")
    try:
        config = AgentConfig(max_sub_questions=args.sub_questions,
                             plan_tokens=args.plan_tokens, answer_tokens=args.answer_tokens,
                             report_tokens=args.report_tokens,
                             follow_up_tokens=args.follow_up_tokens)
    except ValueError as exc:  # names the field and the valid values
        parser.error(str(exc))
    url = f"http://{args.host}:{args.port}"
    document = load_document(args.doc, args.max_doc_chars)
    if args.api == "openai":
        result = run_research_openai(url, document, question=args.question, config=config,
                                     follow_up=args.follow_up, model=args.model)
    else:
        result = run_research(url, document, question=args.question, config=config,
                              follow_up=args.follow_up, chat_template=args.chat_template)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
