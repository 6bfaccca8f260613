"""Exporters: draftsmith checkpoints -> files that transformers, vLLM and SGLang load.

draftsmith.checkpoint (core) reads and validates native checkpoints; here `eagle3` and `medusa` build engine
formats for heads, `hf` turns a distilled draft into an ordinary causal LM. `draftsmith.app.export`
is the command and the dispatcher.
"""
