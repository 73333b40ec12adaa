from engine.models.loading import ModelSource, build_model, load_state_dict, load_tokenizer, resolve_model
from engine.models.transformer import ModelArgs, Transformer

__all__ = ["ModelArgs", "ModelSource", "Transformer", "build_model", "load_state_dict", "load_tokenizer",
           "resolve_model"]
