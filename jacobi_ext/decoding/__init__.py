"""Decoding: greedy AR, Jacobi, multi-block + rejection recycling (all lossless)."""

from .batch import left_pad
from .engine import METHODS, GenerateResult, generate

__all__ = ["METHODS", "GenerateResult", "generate", "left_pad"]
