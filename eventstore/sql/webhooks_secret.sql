-- A subscription's signing secret, written before its webhook.created (a delivery never finds a
-- subscription without one).
INSERT INTO webhook_secrets (webhook_id, secret) VALUES (%(id)s, %(secret)s)
