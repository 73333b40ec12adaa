"""Tandem's engine: speculative decoding with an independent draft model."""
from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "SpeculativeConfig"]
