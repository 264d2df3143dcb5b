"""Bundled model scripts (each defines ``build(device)``) and the data they train on."""
