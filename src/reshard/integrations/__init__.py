"""Integrations with real training and inference stacks (transformers, vLLM)."""
