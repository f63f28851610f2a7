"""Outbound event webhooks: which events a subscription is sent (plan.py) and the fan-out that
promises them to the outbox (fanout.py)."""
