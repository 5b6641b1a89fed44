"""Round Attention (Sec. 3): conversations cut into rounds, the watershed layer past
which the layers' round-level attention agrees, and the strategies that pick each new
question's rounds at that layer.

``conversations`` builds multi-round chats from the bundled corpus (calibration, the
recall preset); ``watershed`` measures a model's watershed layer (Appendix B:
``python -m sgl_spec.calibrate watershed``); ``select`` holds the round strategies
(``--spec-round-strategy``).
"""
