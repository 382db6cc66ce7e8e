"""Transports below the CPU backend: how bytes move between the members of one communicator."""
