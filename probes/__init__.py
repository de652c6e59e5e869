"""Probes: one module per vLLM surface, one probe per API fact speculators relies on."""
