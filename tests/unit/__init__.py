"""Unit tests: pure, in-memory, no database."""
