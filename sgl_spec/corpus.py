"""Real English prose of a requested token length, from text that ships with Python.

The pool is the prose paragraphs of the docstrings (module, class and function) of a
fixed list of standard-library modules, in a fixed order. Code examples, tables and
indented blocks are dropped; a paragraph's lines are re-flowed into one line. Nothing
is downloaded, and the same Python version, seed and tokenizer always give the same
text (the docstrings themselves change between Python releases, so record the
version next to any figure made from this text).

    >>> doc = document(tokenizer, 3000, seed=0)      # ~3000 tokens of prose
    >>> parts = documents(tokenizer, 1000, count=5, seed=1)  # disjoint chunks

``tokenizer`` is anything with ``encode(text, add_special_tokens=False) -> list[int]``
and ``decode(ids) -> str`` (a Hugging Face tokenizer).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

# Prose-rich modules present in CPython 3.11-3.13 whose import has no side effects.
MODULES: tuple[str, ...] = (
    "argparse", "base64", "cmd", "codecs", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "difflib", "doctest", "enum",
    "fileinput", "ftplib", "functools", "hashlib", "heapq", "http.client",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "optparse", "os",
    "pdb", "pickle", "queue", "random", "re", "sched", "shelve", "shutil",
    "smtplib", "socketserver", "statistics", "string", "struct", "subprocess",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
    "typing", "urllib.parse", "uuid", "wave", "zipfile",
)
SEPARATOR = "\n\n"
MIN_WORDS = 20


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Passage:
    """One prose paragraph; ``source`` names the documented object (``json.dumps``)."""

    source: str
    text: str
    n_tokens: int

    def __post_init__(self) -> None:
        if self.n_tokens <= 0:
            raise ValueError(f"passage from {self.source} has {self.n_tokens} tokens")


_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def _is_prose(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    if any(line[:1].isspace() or line.lstrip().startswith((">>>", "...", "|", "+-", "-"))
           for line in lines):
        return False  # code, doctest, table or list
    text = " ".join(lines)
    words = text.split()
    if len(words) < MIN_WORDS or not _SENTENCE_END.search(text):
        return False
    alpha = sum(c.isalpha() or c.isspace() for c in text)
    return alpha / len(text) > 0.85


def _docstrings(module_name: str) -> Iterator[tuple[str, str]]:
    with warnings.catch_warnings():  # deprecated members (typing.io) warn on access
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
        members = inspect.getmembers(module)
    yield module_name, inspect.getdoc(module) or ""
    for name, obj in members:
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield f"{module_name}.{name}", inspect.getdoc(obj) or ""


@functools.lru_cache(maxsize=1)
def paragraphs() -> tuple[tuple[str, str], ...]:
    """The pool: ``(source, text)`` prose paragraphs in a fixed order, deduplicated."""
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for module_name in MODULES:
        for source, doc in _docstrings(module_name):
            for block in re.split(r"\n\s*\n", doc):
                block = block.strip("\n")
                if not _is_prose(block):
                    continue
                text = " ".join(line.strip() for line in block.splitlines())
                if text not in seen:
                    seen.add(text)
                    out.append((source, text))
    return tuple(out)


def _n_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _truncate(tokenizer: Tokenizer, text: str, budget: int, snap: bool = True) -> str:
    """``text`` cut to at most ``budget`` tokens; with ``snap``, at a sentence end
    when one lies in the second half."""
    ids = tokenizer.encode(text, add_special_tokens=False)[: max(budget, 0)]
    cut = tokenizer.decode(ids)
    ends = [m.end() for m in _SENTENCE_END.finditer(cut)] if snap else []
    if ends and ends[-1] >= len(cut) // 2:
        cut = cut[: ends[-1]]
    return cut.strip()


def _stream(seed: int) -> Iterator[tuple[str, str]]:
    pool = paragraphs()
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    for i in order:
        yield pool[i]


def _take(tokenizer: Tokenizer, stream: Iterator[tuple[str, str]], n_tokens: int) -> list[Passage]:
    # BPE pre-tokenization splits at the sentence end before SEPARATOR, so the token
    # count of the joined text is the sum of count(SEPARATOR + text) per seam: O(n).
    out: list[Passage] = []
    total = 0
    exhausted = True
    for source, text in stream:
        sep = SEPARATOR if out else ""
        budget = n_tokens - total - _n_tokens(tokenizer, sep)
        if budget < 8:
            exhausted = False
            break
        n = _n_tokens(tokenizer, text)
        if n > budget:
            text = _truncate(tokenizer, text, budget)
            n = _n_tokens(tokenizer, text)
            if n == 0:
                exhausted = False
                break
        out.append(Passage(source, text, n))
        total += _n_tokens(tokenizer, sep + text)
        if total >= n_tokens - 8:
            exhausted = False
            break
    # Guard the locality assumption once, exactly.
    while out and (excess := _n_tokens(tokenizer, join(out)) - n_tokens) > 0:
        last = out.pop()
        text = _truncate(tokenizer, last.text, last.n_tokens - excess, snap=False)
        if text:
            out.append(Passage(last.source, text, _n_tokens(tokenizer, text)))
    if exhausted:
        raise ValueError(
            f"the corpus holds fewer than {n_tokens} tokens of unused prose "
            f"({len(paragraphs())} paragraphs)"
        )
    return out


def passages(tokenizer: Tokenizer, n_tokens: int, seed: int) -> list[Passage]:
    """Paragraphs totalling about ``n_tokens`` tokens (joined by ``SEPARATOR``).

    The last paragraph is cut to fit (at a sentence end when one is near):
    ``join(passages(...))`` encodes to at most ``n_tokens`` tokens, and for
    ``n_tokens`` of a few hundred or more to within 2 % below it.
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    return _take(tokenizer, _stream(seed), n_tokens)


def document(tokenizer: Tokenizer, n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` tokens of prose: ``passages`` joined by blank lines."""
    return SEPARATOR.join(p.text for p in passages(tokenizer, n_tokens, seed))


def chunks(tokenizer: Tokenizer, sizes: list[int], seed: int) -> list[list[Passage]]:
    """Disjoint groups of passages (no paragraph twice), group i of about ``sizes[i]``
    tokens, drawn in order from one seeded shuffle of the pool."""
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"sizes must be a non-empty list of positive ints, got {sizes}")
    stream = _stream(seed)
    return [_take(tokenizer, stream, n) for n in sizes]


def documents(tokenizer: Tokenizer, n_tokens: int, count: int, seed: int) -> list[list[Passage]]:
    """``count`` disjoint chunks of about ``n_tokens`` tokens each."""
    return chunks(tokenizer, [n_tokens] * count, seed)


def join(chunk: list[Passage]) -> str:
    return SEPARATOR.join(p.text for p in chunk)
