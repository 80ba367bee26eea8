"""Structured output: what a generation must match (a JSON Schema, any JSON object, a regular
expression, a Lark or GBNF grammar), compiled for one tokenizer, and the per-row matcher the
decoding modes consult.

The engine is llguidance (docs/structured-output.md says why, with the measurements): it computes
the set of tokens that keep the output valid (the mask), the tokens the grammar forces from here
(fast-forward tokens), and how many of a list of tokens stay valid (the check a diffusion block's
left-to-right commit needs).

    spec = GrammarSpec.json_schema({"type": "object", ...})
    compiled = compile_grammar(spec, tokenizer, vocab_size=V, eos_ids={2})
    m = compiled.matcher()          # one per row
    m.mask(logits)                  # -inf where a token would break the grammar
    m.consume([tok]); m.forced(); m.valid_prefix(tokens); m.rollback(n); m.stopped

Errors in the input (an invalid schema, an unsupported keyword, a grammar that does not compile, is
too large or takes too long) are `GrammarError`s (a ValueError "grammar: why")."""

from .constraint import (COMPILE_TIMEOUT_S, MAX_GRAMMAR_CHARS, CompiledGrammar, Constraint, GrammarError,
                         GrammarSpec, compile_grammar)

__all__ = ["COMPILE_TIMEOUT_S", "MAX_GRAMMAR_CHARS", "CompiledGrammar", "Constraint", "GrammarError",
           "GrammarSpec", "compile_grammar"]
