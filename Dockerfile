# The Dispach node as an image. It is configured only by environment variables
# (see runtime/config.py); compose.yaml sets them for a Postgres + NATS deployment.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DISPACH_HOME=/var/lib/dispach

WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY actors ./actors
COPY eventstore ./eventstore
COPY gateways ./gateways
RUN pip install --no-cache-dir . \
    && rm -rf build ./*.egg-info

# Run as an unprivileged user that owns the data directory (DISPACH_HOME).
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/dispach dispach
USER dispach
WORKDIR /var/lib/dispach

EXPOSE 7420
# `dispach serve` drains in-flight work on SIGTERM before it exits.
STOPSIGNAL SIGTERM
CMD ["dispach", "serve"]
