"""Tests of prefill_node/, decode_node/ and worker/: the two workers and their runtime."""
