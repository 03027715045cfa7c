"""Speculative decoding: proposers (n-gram prompt lookup, a draft model; the seat EAGLE / MTP heads
plug into) and verification. SpeculativeConfig (config.py) is what users pass; the Speculator
(speculator.py) is what LLMEngine holds; verify.py runs inside ModelRunner.run."""
from nanovllm.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
