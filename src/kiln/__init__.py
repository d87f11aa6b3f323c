"""Kiln: serve a language model and train LoRA adapters while serving."""
__version__ = "0.1.0"
