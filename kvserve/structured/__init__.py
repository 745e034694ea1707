"""Grammar-constrained decoding: a spec (JSON schema, regex, choice, EBNF) compiled by xgrammar
against the model's tokenizer, one matcher per sequence, and the token bitmask that the sampler
applies on the device. The engine imports this package; it imports nothing of the engine."""
from kvserve.structured.grammar import BitmaskFiller, GrammarState, StructuredCompiler, apply_bitmask

__all__ = ["BitmaskFiller", "GrammarState", "StructuredCompiler", "apply_bitmask"]
