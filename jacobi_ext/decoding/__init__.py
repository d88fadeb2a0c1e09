"""Decoding: greedy AR, Jacobi, multi-block + rejection recycling (all lossless)."""

from .engine import METHODS, GenerateResult, generate

__all__ = ["METHODS", "GenerateResult", "generate"]
