"""Integrations with serving engines. Each subpackage imports its engine only when used."""
