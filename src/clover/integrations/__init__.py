"""Clover inside other serving stacks (vLLM: `clover.integrations.vllm`). Nothing here is imported by
the rest of clover; each integration imports its host package only when that host loads it."""
