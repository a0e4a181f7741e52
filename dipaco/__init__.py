"""dipaco: DiPaCo training and routed inference (glossary: docs/design.md)."""
__version__ = "0.1.0"
