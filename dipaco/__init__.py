"""dipaco: DiPaCo training and routed inference (see DESIGN.md glossary)."""
__version__ = "0.1.0"
