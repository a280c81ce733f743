"""Notifications: which runs changed state, and their delivery."""
