"""The served model's turn format: its tokenizer, ``--chat-template`` and
``--reasoning-parser``. The only module that reads sglang's server args for it."""

from __future__ import annotations

import logging
import os

from sgl_spec.cache.turn_format import TurnFormat, derive

logger = logging.getLogger(__name__)


def reasoning_markers(name: str | None) -> tuple[str, str] | None:
    """(start, end) markers of sglang's reasoning parser ``name``."""
    if not name:
        return None
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    detector_cls = ReasoningParser.DetectorMap.get(name)
    if detector_cls is None:
        raise ValueError(
            f"--reasoning-parser {name!r} is unknown; valid values: "
            f"{', '.join(sorted(ReasoningParser.DetectorMap))}"
        )
    detector = detector_cls()
    return detector.think_start_token, detector.think_end_token


def turn_format_for(server_args) -> TurnFormat | None:
    """Derive the format, or None (everything untagged) if the model has no chat
    template; logged either way."""
    from transformers import AutoTokenizer

    path = server_args.tokenizer_path or server_args.model_path
    try:
        tok = AutoTokenizer.from_pretrained(
            path, trust_remote_code=server_args.trust_remote_code
        )
    except Exception as e:  # tokenizer-less models (--skip-tokenizer-init)
        logger.warning("sgl_spec: no tokenizer at %s (%s); turns are not tagged", path, e)
        return None
    template = None
    chat_template = server_args.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            template = f.read()
    if template is None and not getattr(tok, "chat_template", None):
        logger.warning("sgl_spec: %s has no chat template; turns are not tagged", path)
        return None
    try:
        return derive(tok, template, reasoning_markers(server_args.reasoning_parser))
    except ValueError as e:
        logger.warning("sgl_spec: cannot derive turns from the chat template: %s", e)
        return None
