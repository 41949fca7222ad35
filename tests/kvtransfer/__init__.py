"""Tests of kvtransfer/."""
