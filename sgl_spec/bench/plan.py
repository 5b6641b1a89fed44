"""What each configuration of an evaluation run plays: the run plan.

A plan names a dataset preset, the long-generation prompts and a cap on their
output budgets, the speed chats and whether to run the serving benchmark. It comes
from a preset (``--quick``, or the default), or from the ``[plan]`` table of a
configuration set (``configset``), so that a set with many rows can bound its run
time::

    [plan]
    dataset = "default"            # a DatasetConfig preset
    longgen = ["doc-facts"]        # prompt names, or a longgen preset name
    longgen_max_tokens = 512       # caps every prompt's own budget
    chats = ["doc_chat", "growing"]  # speed chats (chats.PRESETS), history pinned
    serving = true                 # sglang.bench_serving random-ids (or a preset name)

A missing key takes the default plan's value (no speed chats, no serving run).
``--quick`` overrides a set's plan and plays everything small; ``--concurrency``
applies to any plan (``choose``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sgl_spec import corpus
from sgl_spec.bench import chats as chat_presets
from sgl_spec.bench import longgen, serving as serving_presets
from sgl_spec.bench.chat_client import PlayItem
from sgl_spec.bench.dataset import DatasetConfig

PLAN_KEYS: tuple[str, ...] = ("dataset", "longgen", "longgen_max_tokens", "chats", "serving")


@dataclass(frozen=True)
class RunPlan:
    """What each configuration plays. ``longgen_max_tokens`` caps every long-generation
    prompt's own budget (``longgen.LongGenPrompt.max_tokens``) to fit the run time."""

    dataset: str  # a DatasetConfig preset
    longgen: tuple[str, ...]  # prompt names
    longgen_max_tokens: int
    chats: tuple[str, ...] = ()  # chats.PRESETS names
    serving: str | None = None  # a serving.PRESETS name; None: no bench_serving run
    concurrency: int = 1

    def __post_init__(self) -> None:
        DatasetConfig.preset(self.dataset)  # raises on an unknown preset
        for name in self.chats:
            chat_presets.preset(name)
        if len(set(self.chats)) != len(self.chats):
            raise ValueError(f"chats must be distinct, got {list(self.chats)}")
        if self.serving is not None:
            serving_presets.preset(self.serving)
        names = {p.name for p in longgen.PROMPTS}
        bad = [n for n in self.longgen if n not in names]
        if bad:
            raise ValueError(f"unknown long-generation prompt(s) {bad}; valid: {sorted(names)}")
        if isinstance(self.longgen_max_tokens, bool) or not isinstance(
                self.longgen_max_tokens, int) or self.longgen_max_tokens <= 0:
            raise ValueError(f"longgen_max_tokens must be a positive integer, got "
                             f"{self.longgen_max_tokens!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @classmethod
    def preset(cls, quick: bool, concurrency: int = 1) -> RunPlan:
        if quick:  # ~2 min per configuration on 2 cores
            return cls("quick", ("long-division",), 256, ("doc_chat-quick", "growing-quick"),
                       "quick", concurrency)
        return cls("default", ("long-division", "animals"), 1024, concurrency=concurrency)

    def prompts(self) -> list[longgen.LongGenPrompt]:
        by_name = {p.name: p for p in longgen.PROMPTS}
        return [by_name[n] for n in self.longgen]

    def longgen_items(self, tokenizer: corpus.Tokenizer | None = None) -> list[PlayItem]:
        """The long-generation requests; prompts with a document need ``tokenizer``
        (ValueError naming the prompt otherwise)."""
        return [PlayItem(p.to_workload(tokenizer), min(p.max_tokens, self.longgen_max_tokens),
                         p.ignore_eos) for p in self.prompts()]

    def chat_items(self, tokenizer: corpus.Tokenizer) -> dict[str, list[PlayItem]]:
        """The speed chats' conversations, per chat name, rendered with ``tokenizer``."""
        out = {}
        for name in self.chats:
            cfg = chat_presets.preset(name)
            out[name] = [PlayItem(c, cfg.max_tokens)
                         for c in chat_presets.conversations(tokenizer, cfg, name)]
        return out

    @property
    def serving_config(self) -> serving_presets.ServingConfig | None:
        return None if self.serving is None else serving_presets.preset(self.serving)


def parse(table: object, where: str = "[plan]") -> RunPlan:
    """A ``RunPlan`` from a ``[plan]`` table; ValueError names the bad key or value
    and the valid ones."""
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table with keys {list(PLAN_KEYS)}")
    unknown = sorted(set(table) - set(PLAN_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {list(PLAN_KEYS)}")
    default = RunPlan.preset(False)
    dataset = table.get("dataset", default.dataset)
    if not isinstance(dataset, str):
        raise ValueError(f"{where}: dataset must be a preset name (string), got {dataset!r}")
    names = table.get("longgen", list(default.longgen))
    if isinstance(names, str):  # a preset name
        if names not in longgen.PRESETS:
            raise ValueError(f"{where}: longgen {names!r} is not a preset; valid presets: "
                             f"{sorted(longgen.PRESETS)}, or a list of prompt names")
        names = list(longgen.PRESETS[names])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: longgen must be a list of prompt names or a preset "
                         f"name, got {names!r}")
    chats = table.get("chats", list(default.chats))
    if not isinstance(chats, list) or not all(isinstance(n, str) for n in chats):
        raise ValueError(f"{where}: chats must be a list of chat names "
                         f"{sorted(chat_presets.PRESETS)}, got {chats!r}")
    serving = table.get("serving", default.serving)
    if isinstance(serving, bool):
        serving = "default" if serving else None
    elif serving is not None and not isinstance(serving, str):
        raise ValueError(f"{where}: serving must be true, false or a preset name "
                         f"{sorted(serving_presets.PRESETS)}, got {serving!r}")
    try:
        return RunPlan(dataset, tuple(names),
                       table.get("longgen_max_tokens", default.longgen_max_tokens),
                       tuple(chats), serving)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _has_preset(name: str) -> bool:
    try:
        DatasetConfig.preset(name)
    except ValueError:
        return False
    return True


def choose(set_plan: RunPlan | None, quick: bool, concurrency: int = 1) -> RunPlan:
    """The plan a run plays: quick if asked, else the set's, else the default. A set
    whose dataset has a ``<name>-quick`` preset (``long-context``) keeps its own plan
    with that dataset under ``--quick``: its rows need its model's long window."""
    if quick and set_plan is not None and _has_preset(f"{set_plan.dataset}-quick"):
        return replace(set_plan, dataset=f"{set_plan.dataset}-quick", concurrency=concurrency)
    if quick or set_plan is None:
        return RunPlan.preset(quick, concurrency)
    return replace(set_plan, concurrency=concurrency)

