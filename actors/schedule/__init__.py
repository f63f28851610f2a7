"""Schedules: when they are due and what a firing derives (plan.py is the pure core)."""
