"""Adapters: one module per drift (or small family of drifts on one surface)."""
