"""Agents written in SGLang's frontend language, installed as ``sgl_spec.agents``.

Run one against a server: ``python -m sgl_spec.agents.research_assistant --port N``.
"""
