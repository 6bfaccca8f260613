"""draftsmith: train drafters for speculative decoding and measure them honestly."""

__version__ = "0.1.0"

from draftsmith.errors import DraftsmithError  # noqa: E402

__all__ = ["DraftsmithError", "__version__"]
