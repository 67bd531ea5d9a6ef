"""Model definitions: dense decoder targets (Llama, Qwen2, Qwen3); draft heads come later."""

from tandem.models.config import ModelConfig
from tandem.models.decoder import DecoderLM, ForwardContext, ForwardOutput
from tandem.models.loader import load_model

__all__ = ["DecoderLM", "ForwardContext", "ForwardOutput", "ModelConfig", "load_model"]
