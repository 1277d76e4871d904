"""Stand-in for MLC-LLM's package (tests only)."""

__version__ = "0.0.stub"
