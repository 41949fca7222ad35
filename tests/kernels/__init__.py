"""Tests of kernels/."""
