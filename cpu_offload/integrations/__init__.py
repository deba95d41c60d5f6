"""Integrations with host libraries, one module per library; each imports its library lazily."""
