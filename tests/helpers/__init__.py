"""Shared test helpers: clusters of real processes, fakes, certificates, package indexes."""
