"""fuselight schedule rules (DLight style)."""
