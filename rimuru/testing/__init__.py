"""Helpers for tests and demos: tiny random checkpoints of every supported architecture."""

from rimuru.testing.tiny_models import ARCHS, make_tiny_checkpoint, make_tokenizer, tiny_config

__all__ = ["ARCHS", "make_tiny_checkpoint", "make_tokenizer", "tiny_config"]
