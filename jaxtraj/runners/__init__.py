"""Runners: service loops that feed the collector."""
