"""Tests of common/."""
