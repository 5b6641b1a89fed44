"""Chat templates for sgl_spec's default model in sglang's frontend language.

sglang's frontend guesses a template from the model path and finds none for
SmolLM2 (it falls back to "default", and the model then rambles). SmolLM2-Instruct
speaks ChatML, so the matcher below maps it to sglang's built-in "chatml".
"""

from __future__ import annotations

import re

_SMOLLM = re.compile(r"smollm", re.IGNORECASE)


def match_smollm(model_path: str) -> str | None:
    return "chatml" if _SMOLLM.search(model_path or "") else None


def register_frontend_matchers(chat_template_module) -> None:
    registry = chat_template_module.matching_function_registry
    if match_smollm not in registry:
        registry.insert(0, match_smollm)
