"""Tests of coordinator/."""
