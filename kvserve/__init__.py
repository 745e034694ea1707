"""kvserve: a paged, memory-first LLM inference engine."""
from kvserve.errors import ConfigError, InvalidRequestError, ModelLoadError
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "InvalidRequestError", "ModelLoadError", "ConfigError"]
__version__ = "0.1.0"


def __getattr__(name):  # LLM pulls in torch; load it on first use
    if name == "LLM":
        from kvserve.llm import LLM
        return LLM
    raise AttributeError(name)
