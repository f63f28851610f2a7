SELECT stream_version FROM events WHERE stream_id = %(stream)s ORDER BY stream_version DESC LIMIT 1
