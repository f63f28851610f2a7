"""What model calls cost: the price table (per model, US dollars per million tokens of each kind
and per server tool request) and the pure pricing of folded usage.

The defaults are the providers' published list prices for the models named here; an operator
replaces or adds entries with a file (``DISPACH_PRICES_FILE``, YAML or JSON, model id to price)
or inline JSON (``DISPACH_PRICES``). A model the table does not know is never guessed at: its
cost is None and the reason says which model and how to price it. A dated snapshot of a listed
model (``claude-sonnet-4-5-20250929``, ``gpt-4o-2024-08-06``) is priced as the model it is a
snapshot of; nothing else is matched loosely.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import msgspec
import msgspec.yaml

from eventstore.errors import DispachError

NonNegative = Annotated[float, msgspec.Meta(ge=0)]


class Price(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """US dollars per million tokens (``input``: uncached prompt tokens), and per request of
    each server tool (keyed as the provider counts them: ``web_search_requests``)."""

    input: NonNegative
    output: NonNegative
    cache_read: NonNegative | None = None
    """None: cache reads cost as much as input (a provider without a cache discount)."""
    cache_write: NonNegative | None = None
    """None: cache writes cost as much as input (OpenAI does not bill them apart)."""
    server_tools: dict[str, NonNegative] = msgspec.field(default_factory=dict)


class Counts(msgspec.Struct, frozen=True, kw_only=True):
    """Usage of one model over some calls. ``prompt`` includes the cache's reads and writes, as
    every ``model.result`` counts it."""

    prompt: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    server_tools: Mapping[str, int] = msgspec.field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.prompt or self.output or any(self.server_tools.values()))


class Cost(msgspec.Struct, frozen=True):
    """``usd`` None when it cannot be known; ``reason`` then says why."""

    usd: float | None
    reason: str | None = None


_ANTHROPIC_SEARCH = {"web_search_requests": 0.01, "web_fetch_requests": 0.0}


def _claude(input: float, output: float) -> Price:
    # Anthropic: a cache read is a tenth of input, a (5-minute) cache write 1.25 times it.
    return Price(input=input, output=output, cache_read=input / 10, cache_write=input * 1.25,
                 server_tools=_ANTHROPIC_SEARCH)  # fmt: skip


def _openai(input: float, output: float, cached: float) -> Price:
    return Price(input=input, output=output, cache_read=cached)


DEFAULT_PRICES: dict[str, Price] = {
    "scripted": Price(input=0, output=0),
    # The 5 family as Anthropic's model pages list them (platform.claude.com, read 2026-12-07).
    "claude-fable-5-1": _claude(10, 50),
    "claude-opus-5-5": _claude(4, 20),
    "claude-opus-5": _claude(5, 25),
    "claude-sonnet-5-5": _claude(2, 10),
    "claude-sonnet-5": _claude(2, 10),
    "claude-opus-4-5": _claude(5, 25),
    "claude-opus-4-1": _claude(15, 75),
    "claude-opus-4": _claude(15, 75),
    "claude-sonnet-4-5": _claude(3, 15),
    "claude-sonnet-4": _claude(3, 15),
    "claude-3-7-sonnet": _claude(3, 15),
    "claude-haiku-4-5": _claude(1, 5),
    "claude-3-5-haiku": _claude(0.8, 4),
    "gpt-5": _openai(1.25, 10, 0.125),
    "gpt-5-mini": _openai(0.25, 2, 0.025),
    "gpt-5-nano": _openai(0.05, 0.4, 0.005),
    "gpt-4.1": _openai(2, 8, 0.5),
    "gpt-4.1-mini": _openai(0.4, 1.6, 0.1),
    "gpt-4.1-nano": _openai(0.1, 0.4, 0.025),
    "gpt-4o": _openai(2.5, 10, 1.25),
    "gpt-4o-mini": _openai(0.15, 0.6, 0.075),
    "o3": _openai(2, 8, 0.5),
    "o4-mini": _openai(1.1, 4.4, 0.275),
}
"""List prices, USD per million tokens (and per server tool request), of the models named."""

_SNAPSHOT = re.compile(r"-(\d{8}|\d{4}-\d{2}-\d{2}|latest)$")


class PriceError(DispachError):
    code = "prices_invalid"


class PriceTable:
    def __init__(self, prices: Mapping[str, Price] | None = None) -> None:
        self.prices: dict[str, Price] = dict(DEFAULT_PRICES if prices is None else prices)

    def price(self, model: str | None) -> Price | None:
        if model is None:
            return None
        found = self.prices.get(model)
        if found is None:
            base = _SNAPSHOT.sub("", model)
            found = self.prices.get(base) if base != model else None
        return found

    def cost(self, model: str | None, counts: Counts) -> Cost:
        """What ``counts`` of ``model`` cost; nothing used costs nothing, whatever the model."""
        if counts.empty:
            return Cost(0.0)
        price = self.price(model)
        if price is None:
            if model is None:
                return Cost(None, "the log does not say which model answered some calls "
                                  "(recorded before model.result named its model)")  # fmt: skip
            return Cost(None, f"no price for model {model!r}: add it to the price table "
                              "(DISPACH_PRICES_FILE or DISPACH_PRICES)")  # fmt: skip
        return _priced(model or "", price, counts)

    def total(self, parts: list[tuple[str | None, Counts]]) -> Cost:
        """The cost of several models' usage: None with every reason if any part has none."""
        usd = 0.0
        reasons: list[str] = []
        for model, counts in parts:
            cost = self.cost(model, counts)
            if cost.usd is None:
                if cost.reason and cost.reason not in reasons:
                    reasons.append(cost.reason)
            else:
                usd += cost.usd
        if reasons:
            return Cost(None, "; ".join(reasons))
        return Cost(round(usd, 6))


def _priced(model: str, price: Price, counts: Counts) -> Cost:
    cache_read = price.input if price.cache_read is None else price.cache_read
    cache_write = price.input if price.cache_write is None else price.cache_write
    uncached = max(0, counts.prompt - counts.cache_read - counts.cache_write)
    per_million = (uncached * price.input + counts.output * price.output
                   + counts.cache_read * cache_read + counts.cache_write * cache_write)  # fmt: skip
    usd = per_million / 1_000_000
    for kind, n in counts.server_tools.items():
        if not n:
            continue
        each = price.server_tools.get(_snake(kind))
        if each is None:
            return Cost(None, f"no price for server tool {kind!r} of model {model!r}: add it "
                              "to the model's server_tools in the price table")  # fmt: skip
        usd += n * each
    return Cost(round(usd, 6))


def _snake(name: str) -> str:
    """``webSearchRequests`` as ``web_search_requests`` (the table's keys are the provider's)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


_DECODE_JSON = msgspec.json.Decoder(dict[str, Price])


def load(env: Mapping[str, str]) -> PriceTable:
    """The defaults, with the operator's entries (``DISPACH_PRICES_FILE``, then
    ``DISPACH_PRICES``) replacing or adding whole models."""
    prices = dict(DEFAULT_PRICES)
    path = env.get("DISPACH_PRICES_FILE")
    if path:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise PriceError(f"DISPACH_PRICES_FILE {path!r} cannot be read: {e.strerror}",
                             "point it at a readable YAML or JSON file") from e  # fmt: skip
        prices.update(_decode(raw, f"DISPACH_PRICES_FILE {path!r}", yaml=True))
    inline = env.get("DISPACH_PRICES")
    if inline:
        prices.update(_decode(inline.encode(), "DISPACH_PRICES", yaml=False))
    return PriceTable(prices)


def _decode(raw: bytes, where: str, *, yaml: bool) -> dict[str, Price]:
    try:
        if yaml:
            return msgspec.yaml.decode(raw, type=dict[str, Price])
        return _DECODE_JSON.decode(raw)
    except msgspec.DecodeError as e:  # ValidationError is one
        raise PriceError(
            f"{where}: {e}",
            "write model ids to prices: {my-model: {input: 3, output: 15, cache_read: 0.3, "
            "cache_write: 3.75}} (USD per million tokens)",
        ) from e
