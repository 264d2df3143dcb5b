"""Bundled model scripts (each defines ``build(device)``) and the data they train on."""

from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parent


def bundled_scripts() -> dict[str, Path]:
    """File name -> path of every bundled model script."""
    return {
        p.name: p for p in sorted(EXAMPLES_DIR.glob("*.py")) if not p.name.startswith("_") and p.name != "data.py"
    }
