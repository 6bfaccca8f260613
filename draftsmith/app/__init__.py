"""The app layer: the `draftsmith` CLI and its commands, the quickstart, the drafter table, exports.

It may import every other part of draftsmith; nothing below it imports it (tests/test_layering.py).
"""
