"""Integrations with inference engines (vLLM); each loads its engine lazily."""
