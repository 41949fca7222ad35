"""Tests of reliability/."""
