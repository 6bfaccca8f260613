"""Exporters: draftsmith checkpoints -> files that transformers, vLLM and SGLang load.

`checkpoint` reads and validates native checkpoints (contracts 1-2 in the design notes), `eagle3` and `medusa`
build engine formats for heads, `hf` turns a distilled draft into an ordinary causal LM. `draftsmith.app.export`
is the command and the dispatcher.
"""
