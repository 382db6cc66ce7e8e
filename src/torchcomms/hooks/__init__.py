"""Hooks that observe communicators (flight recorder, logs, checks) land here."""
