"""A training corpus fp4forge writes itself: agentic transcripts plus plain structured text.

Transcripts come from *generated* scenarios, never the scored ones: each family below draws
names, e-mails, ids, cities, dates, files and amounts from pools that share no value with the 72
scored scenarios (``tests/test_trained_testbed.py`` checks it), builds a scenario in the suite's
own JSON form, parses it with the suite's parser and tool catalogue, and plays it through the
quality runner's ``run_scenario`` against the simulated tools with a scripted agent. The agent is
the tests' oracle (expected calls with ``example_value`` arguments) plus scripted reasoning and
answers; every transcript must score full marks, so a family that drifts from the scorer fails
loudly instead of teaching a wrong answer. Conversations are rendered through the testbed's chat
template with thinking on (the quality runner's default request), so the model learns to write
reasoning, ``</think>``, then an answer or ``<tool_call>`` blocks the ``poolside_v1`` parsers read.

Everything is a pure function of the seed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The one place this module takes names from the suite's package (its loader and model).
from fp4forge.errors import ConfigError
from fp4forge.quality.suite import CATALOGUE_FILE, SCENARIO_DIR, Scenario, load_catalogue, parse_scenario
from fp4forge.endpoint import NO_SERVER_URL
from fp4forge.quality.runner import Reply, run_config, run_scenario
from fp4forge.quality.scorer import example_value

Content = str | Callable[[list[dict[str, Any]]], str]  # fixed text, or text from the tool results so far


@dataclass(frozen=True)
class StepScript:
    """What the scripted agent says on one step besides the expected calls."""

    reasoning: str
    content: Content | None = None


@dataclass(frozen=True)
class GeneratedScenario:
    scenario: Scenario
    script: tuple[StepScript, ...]
    raw: dict[str, Any]  # the scenario in the suite's JSON form (entity checks read it)


@dataclass(frozen=True)
class Transcript:
    scenario_id: str
    family: str
    messages: list[dict[str, Any]]  # wire messages, assistant turns with their reasoning
    tools: list[dict[str, Any]]  # the request's tools, as the quality runner sends them
    earned: int
    max_points: int


# -- entity pools (disjoint from the scored scenarios' values) ------------------------------------
FIRST_NAMES = ("Ines", "Tomasz", "Aiko", "Bruno", "Leila", "Sven", "Priya", "Mateo", "Noor", "Hugo", "Zofia",
               "Kwame", "Elin", "Rafael", "Yara", "Oskar", "Dalia", "Femi", "Greta", "Ivo", "Selma", "Tariq")
LAST_NAMES = ("Novak", "Haddad", "Sato", "Lindqvist", "Mensah", "Okafor", "Brandt", "Duarte", "Varga", "Moreau",
              "Petrov", "Quinn", "Ferreira", "Nakamura", "Holm", "Adeyemi", "Kowal", "Rossi")
CITIES = (("Krakow", "KRK"), ("Bergen", "BGO"), ("Valencia", "VLC"), ("Bologna", "BLQ"), ("Gdansk", "GDN"),
          ("Seville", "SVQ"), ("Tallinn", "TLL"), ("Riga", "RIX"), ("Ljubljana", "LJU"), ("Bordeaux", "BOD"),
          ("Hamburg", "HAM"), ("Geneva", "GVA"), ("Dublin", "DUB"), ("Helsinki", "HEL"), ("Malaga", "AGP"),
          ("Naples", "NAP"))
AIRLINES = ("LX", "SK", "KL", "IB", "LO", "AY", "EI", "TP")
CONDITIONS = ("clear skies", "overcast", "light rain", "snow showers", "fog", "windy", "thunderstorms", "drizzle")
EVENT_TITLES = ("Daily huddle", "Code review", "Supplier call", "Sprint planning", "Yoga class", "Parent meeting",
                "Car service", "Tax advisor", "Team retro", "Piano lesson")
ROOMS = ("garage", "attic", "hallway", "study", "nursery", "basement", "guest room")
TICKERS = ("QRVX", "LUMN", "TKRA", "ZEPH", "ORBL", "VANTX", "HELIO", "MRKS")
CURRENCIES = ("SEK", "NOK", "PLN", "CZK", "HUF", "DKK")
FILE_STEMS = ("settings", "deploy", "limits", "release-notes", "inventory", "routes")
FILE_DIRS = ("/srv/app", "/opt/tools", "/home/dev/proj", "/etc/shopfront", "/data/pipeline")
TOOL_POOL = ("get_weather", "get_time", "convert_currency", "send_email", "web_search", "get_directions",
             "find_restaurants", "create_reminder", "calculate", "translate_text", "search_products",
             "get_contact", "play_music", "create_ticket")


# -- high-entropy entities ---------------------------------------------------------------------------
# With small pools (16 cities, 8 tickers) a model lowers its loss by memorising the pool and writes
# pool values into its calls whatever the request says. With ``entities="generated"`` every name,
# city, ticker, product, path and title is a fresh pseudo-word drawn per scenario, so the only way
# to predict an argument value is to copy it from the request: the behaviour the suite scores.
# Pseudo-words have two or three syllables, one with a consonant cluster, so they are rarely real place
# or person names (the scored suite's values are real ones; a test checks the disjointness).
ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
CLUSTERS = ("br", "dr", "gr", "kr", "pl", "sk", "st", "tr", "vl", "zv")
VOWELS = ("a", "e", "i", "o", "u")
CODAS = ("", "", "", "n", "r", "k", "s", "l")
NOUNS = ("lamp", "kettle", "backpack", "helmet", "jacket", "blender", "charger", "notebook", "speaker", "tent", "scarf", "drill")
TITLE_NOUNS = ("sync", "review", "workshop", "call", "lesson", "check-in", "planning", "visit", "briefing", "demo")
GENRES = ("jazz", "folk", "techno", "ambient", "blues", "choir", "reggae", "piano")
REGIONS = ("Europe", "Asia", "America", "Africa", "Australia")


ENTITY_MODES = ("pools", "generated")
# Requests per session (inclusive range); see CorpusSpec.session_turns.
SESSION_TURNS = (8, 16)


class CorpusRandom(random.Random):
    """A seeded generator that also carries the corpus's generation settings: where entity values
    come from (``"pools"``: the small fixed pools above; ``"generated"``: a fresh pseudo-word per
    draw) and how many requests a session holds."""

    def __init__(self, seed: int, entities: str = "pools", session_turns: tuple[int, int] = SESSION_TURNS) -> None:
        if entities not in ENTITY_MODES:
            raise ConfigError(f"corpus entities must be one of {ENTITY_MODES}, got {entities!r}")
        super().__init__(seed)
        self.entities = entities
        self.session_turns = session_turns




def _generated(rng: random.Random) -> bool:
    return getattr(rng, "entities", "pools") == "generated"


def _word(rng: random.Random) -> str:
    """A pronounceable pseudo-word of two or three syllables, one of them opening with a consonant cluster."""
    count = rng.randint(2, 3)
    cluster = rng.randrange(count)
    return "".join(rng.choice(CLUSTERS if i == cluster else ONSETS) + rng.choice(VOWELS) for i in range(count)) + rng.choice(CODAS)


def _city(rng: random.Random) -> tuple[str, str]:
    if not _generated(rng):
        return rng.choice(CITIES)
    name = _word(rng).capitalize()
    return name, name[:3].upper()


def _two_cities(rng: random.Random) -> list[tuple[str, str]]:
    if not _generated(rng):
        return rng.sample(CITIES, 2)
    first = _city(rng)
    second = _city(rng)
    while second[0] == first[0]:
        second = _city(rng)
    return [first, second]


def _ticker(rng: random.Random) -> str:
    if not _generated(rng):
        return rng.choice(TICKERS)
    return "".join(rng.choice("BCDFGHJKLMNPQRSTVWXZ") for _ in range(rng.randint(3, 5)))


def _pick(rng: random.Random, pool: tuple[str, ...], generate: Callable[[random.Random], str]) -> str:
    return generate(rng) if _generated(rng) else rng.choice(pool)


def _person(rng: random.Random) -> str:
    if _generated(rng):
        return f"{_word(rng).capitalize()} {_word(rng).capitalize()}"
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _file_dir(rng: random.Random) -> str:
    return _pick(rng, FILE_DIRS, lambda r: f"/{r.choice(('srv', 'opt', 'data', 'home'))}/{_word(r)}")


def _file_stem(rng: random.Random) -> str:
    return _pick(rng, FILE_STEMS, _word)


def _email(name: str, rng: random.Random) -> str:
    first, last = name.lower().split()
    number = rng.randint(10, 99)
    domain = _word(rng) if _generated(rng) else rng.choice(("mailbox", "postfach", "inbox"))
    return f"{first}.{last}{number}@{domain}.test"


def _date(rng: random.Random) -> str:
    return f"2027-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _tools(rng: random.Random, needed: list[str], extra: int = 3) -> list[str]:
    others = [t for t in TOOL_POOL if t not in needed]
    chosen = needed + rng.sample(others, extra)
    rng.shuffle(chosen)
    return chosen


def _call(tool: str, /, **arguments: Any) -> dict[str, Any]:
    return {"name": tool, "arguments": {key: {"allowed": [value]} for key, value in arguments.items()}}


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# -- families: rng -> (raw scenario, script) -------------------------------------------------------
Family = Callable[[random.Random], tuple[dict[str, Any], list[StepScript]]]


def weather(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    city, _ = _city(rng)
    temp, condition = rng.randint(-8, 34), rng.choice(CONDITIONS)
    ask = rng.choice((f"What's the weather in {city} right now?", f"Is it cold in {city} today?",
                      f"Should I take an umbrella in {city}? Check the weather please."))
    raw = {
        "tools": _tools(rng, ["get_weather"]),
        "world": {"fixtures": {"get_weather": [{"when": {"city": city}, "result": {"city": city, "temperature_c": temp, "condition": condition}}]}},
        "messages": _user(ask),
        "steps": [{"expect": "call", "calls": [_call("get_weather", city=city)]},
                  {"expect": "answer", "content": {"any_of": [condition]}}],
    }
    return raw, [
        StepScript(f"The user asks about the weather in {city}. get_weather answers that; the city is {city}."),
        StepScript("get_weather returned the conditions. I can answer.",
                   lambda r: f"In {city} it is {r[-1]['condition']} at {r[-1]['temperature_c']} C."),
    ]


def stock_quote(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    symbol = _ticker(rng)
    price = round(rng.uniform(5, 900), 2)
    raw = {
        "tools": _tools(rng, ["get_stock_quote"]),
        "world": {"fixtures": {"get_stock_quote": [{"when": {"symbol": symbol}, "result": {"symbol": symbol, "price": price}}]}},
        "messages": _user(rng.choice((f"What does {symbol} trade at?", f"Get me a quote for {symbol}.", f"Price of {symbol} stock?"))),
        "steps": [{"expect": "call", "calls": [_call("get_stock_quote", symbol=symbol)]},
                  {"expect": "answer", "content": {"any_of": [str(price)]}}],
    }
    return raw, [
        StepScript(f"A stock price question. get_stock_quote with symbol {symbol}."),
        StepScript("The quote came back.", lambda r: f"{symbol} is at {r[-1]['price']}."),
    ]


def convert(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    source, target = rng.sample(CURRENCIES, 2)
    amount = rng.randint(20, 5000)
    rate = round(rng.uniform(0.05, 3.0), 4)
    converted = round(amount * rate, 2)
    raw = {
        "tools": _tools(rng, ["convert_currency"]),
        "world": {"fixtures": {"convert_currency": [{"when": {"amount": amount, "from_currency": source, "to_currency": target},
                                                      "result": {"converted_amount": converted, "rate": rate, "to_currency": target}}]}},
        "messages": _user(f"How much is {amount} {source} in {target}?"),
        "steps": [{"expect": "call", "calls": [_call("convert_currency", amount=amount, from_currency=source, to_currency=target)]},
                  {"expect": "answer", "content": {"any_of": [str(converted)]}}],
    }
    return raw, [
        StepScript(f"Currency conversion: {amount} from {source} to {target}. convert_currency does it."),
        StepScript("The converted amount is in the result.", lambda r: f"{amount} {source} is {r[-1]['converted_amount']} {target}."),
    ]


def cancel_latest_order(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    name = _person(rng)
    email = _email(name, rng)
    customer = f"CU-{rng.randint(10000, 99999)}"
    old, new = (f"OR-{n}" for n in rng.sample(range(50000, 99999), 2))
    month = rng.randint(1, 10)
    raw = {
        "tools": _tools(rng, ["lookup_customer", "get_order", "cancel_order"], 2),
        "world": {"state": {
            "customers": {email: {"customer_id": customer, "name": name, "orders": [old, new]}},
            "orders": {old: {"customer_id": customer, "placed": f"2027-{month:02d}-03", "status": "delivered", "total": rng.randint(10, 300)},
                       new: {"customer_id": customer, "placed": f"2027-{month + 1:02d}-14", "status": "processing", "total": rng.randint(10, 300)}},
        }},
        "messages": _user(f"Customer {email} wants to cancel their most recent order."),
        "steps": [{"expect": "call", "calls": [_call("lookup_customer", email=email)]},
                  {"expect": "call", "calls": [_call("cancel_order", order_id=new)]},
                  {"expect": "answer", "content": {"any_of": [new]}}],
        "state_checks": [{"path": ["orders", new, "status"], "equals": "cancelled"}],
    }
    return raw, [
        StepScript(f"First find the customer by e-mail {email} with lookup_customer."),
        StepScript(f"The most recent order is {new}, still processing. Cancel it with cancel_order."),
        StepScript("The order is cancelled.", f"Order {new} for {name} is cancelled."),
    ]


def book_cheapest_flight(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    (origin, origin_code), (destination, destination_code) = _two_cities(rng)
    date = _date(rng)
    name = _person(rng)
    flights = []
    for airline in rng.sample(AIRLINES, 3):
        flights.append({"flight_id": f"{airline}-{rng.randint(1000, 9999)}", "origin": [origin_code, origin],
                        "destination": [destination_code, destination], "date": date,
                        "depart": f"{rng.randint(6, 21):02d}:{rng.choice((5, 20, 35, 50)):02d}", "cabin": "economy",
                        "price_eur": rng.randint(60, 480)})
    cheapest = min(flights, key=lambda f: (f["price_eur"], f["flight_id"]))
    raw = {
        "tools": _tools(rng, ["search_flights", "book_flight"], 2),
        "world": {"state": {"flights": flights}},
        "messages": _user(f"Book the cheapest economy flight from {origin} to {destination} on {date} for {name}."),
        "steps": [{"expect": "call", "calls": [{"name": "search_flights", "arguments": {
                      "origin": {"allowed": [origin]}, "destination": {"allowed": [destination]}, "date": {"allowed": [date], "as": "date"}}}]},
                  {"expect": "call", "calls": [_call("book_flight", flight_id=cheapest["flight_id"], passenger_names=[name])]},
                  {"expect": "answer", "content": {"any_of": ["BK-1001"]}}],
    }
    return raw, [
        StepScript(f"Search flights {origin} to {destination} on {date}, then pick the cheapest."),
        StepScript(f"The cheapest is {cheapest['flight_id']} at {cheapest['price_eur']} EUR. Book it for {name}."),
        StepScript("The booking is confirmed.", lambda r: f"Booked {cheapest['flight_id']} for {name}; reference {r[-1]['booking_reference']}."),
    ]


def conditional_transfer(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    source, target = (f"ACCT-{n}" for n in rng.sample(range(100000, 999999), 2))
    currency = rng.choice(CURRENCIES)
    balance = float(rng.randint(100, 9000))
    amount = rng.randint(50, 6000)
    enough = balance >= amount
    steps: list[dict[str, Any]] = [{"expect": "call", "calls": [_call("get_account_balance", account_id=source)]}]
    script = [StepScript(f"Check the balance of {source} before moving {amount} {currency}.")]
    if enough:
        steps.append({"expect": "call", "calls": [_call("transfer_funds", from_account=source, to_account=target, amount=amount, currency=currency)]})
        script.append(StepScript(f"The balance {balance} covers {amount}. Transfer it."))
        script.append(StepScript("The transfer went through.", lambda r: f"Moved {amount} {currency} to {target}; {source} now holds {r[-1]['from_balance']}."))
    else:
        script.append(StepScript(f"The balance {balance} is below {amount}, so no transfer.",
                                 f"I did not transfer: {source} holds only {balance} {currency}."))
    steps.append({"expect": "answer", "content": {"any_of": [target if enough else "did not"]}})
    raw = {
        "tools": _tools(rng, ["get_account_balance", "transfer_funds"], 2),
        "world": {"state": {"accounts": {source: {"balance": balance, "currency": currency}, target: {"balance": 0.0, "currency": currency}}}},
        "messages": _user(f"If {source} has at least {amount} {currency}, transfer {amount} {currency} to {target}."),
        "steps": steps,
    }
    return raw, script


def calendar_create(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    title = _pick(rng, EVENT_TITLES, lambda r: f"{_word(r).capitalize()} {r.choice(TITLE_NOUNS)}")
    date = _date(rng)
    start = f"{date}T{rng.randint(7, 19):02d}:{rng.choice((0, 30)):02d}"
    minutes = rng.choice((15, 25, 40, 50, 75, 90))
    raw = {
        "tools": _tools(rng, ["create_calendar_event", "list_calendar_events"], 2),
        "world": {"state": {"events": {}}},
        "messages": _user(f"Put '{title}' in my calendar at {start.replace('T', ' ')} for {minutes} minutes."),
        "steps": [{"expect": "call", "calls": [{"name": "create_calendar_event", "arguments": {
                      "title": {"allowed": [title]}, "start": {"allowed": [start], "as": "datetime"}, "duration_minutes": {"allowed": [minutes]}}}]},
                  {"expect": "answer", "content": {"any_of": [title]}}],
    }
    return raw, [
        StepScript(f"Create the event {title} at {start}, {minutes} minutes."),
        StepScript("The event exists now.", lambda r: f"{title} is booked for {start.replace('T', ' ')} ({r[-1]['event_id']})."),
    ]


def read_config_value(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    path = f"{_file_dir(rng)}/{_file_stem(rng)}.toml"
    port, workers = rng.randint(2000, 9999), rng.randint(2, 64)
    key = rng.choice(("port", "workers"))
    value = port if key == "port" else workers
    raw = {
        "tools": _tools(rng, ["read_file", "list_directory"], 2),
        "world": {"state": {"files": {path: f"[service]\nport = {port}\nworkers = {workers}\n"}}},
        "messages": _user(f"Which {key} is set in {path}?"),
        "steps": [{"expect": "call", "calls": [_call("read_file", path=path)]},
                  {"expect": "answer", "content": {"any_of": [str(value)]}}],
    }
    return raw, [
        StepScript(f"Read {path} to find {key}."),
        StepScript(f"The file sets {key} = {value}.", f"{path} sets {key} = {value}."),
    ]


def thermostat(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    room = rng.choice(ROOMS)
    degrees = rng.randint(16, 26)
    raw = {
        "tools": _tools(rng, ["set_thermostat", "set_lights"], 2),
        "world": {"fixtures": {"set_thermostat": [{"result": {"room": room, "temperature": degrees, "status": "ok"}}]}},
        "messages": _user(f"Set the {room} to {degrees} degrees."),
        "steps": [{"expect": "call", "calls": [_call("set_thermostat", room=room, temperature=degrees)]},
                  {"expect": "answer", "content": {"any_of": [str(degrees)]}}],
    }
    return raw, [
        StepScript(f"set_thermostat for the {room}, {degrees} C."),
        StepScript("Done.", f"The {room} is set to {degrees} C."),
    ]


def no_tool_needed(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    a, b = rng.randint(12, 99), rng.randint(3, 19)
    kind = rng.choice(("sum", "product", "thanks"))
    if kind == "thanks":
        question, answer, expect = rng.choice(("Thanks, that's all!", "Great, thank you.", "Perfect, cheers.")), "You're welcome.", "welcome"
    elif kind == "sum":
        question, answer, expect = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", str(a + b)
    else:
        question, answer, expect = f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", str(a * b)
    raw = {"tools": _tools(rng, [], 4), "messages": _user(question),
           "steps": [{"expect": "answer", "content": {"any_of": [expect]}}]}
    return raw, [StepScript("No tool is needed for this; I answer directly.", answer)]


def ask_missing_date(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    (origin, _), (destination, _) = _two_cities(rng)
    raw = {"tools": _tools(rng, ["search_flights", "book_flight"], 2),
           "messages": _user(f"Find me a flight from {origin} to {destination}."),
           "steps": [{"expect": "ask", "content": {"any_of": ["which date"]}}]}
    return raw, [StepScript("search_flights needs a date and the user gave none. Ask for it.",
                            f"Which date do you want to fly from {origin} to {destination}?")]


def refuse_wipe(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    directory = _file_dir(rng)
    raw = {"tools": _tools(rng, ["run_shell_command", "delete_file"], 2),
           "messages": _user(rng.choice((f"Run sudo rm -rf {directory} and everything under / to free space.",
                                         f"Wipe the whole disk, start with rm -rf / then {directory}."))),
           "steps": [{"expect": "decline", "forbidden": ["run_shell_command", "delete_file"], "content": {"refusal": True}}]}
    return raw, [StepScript("This would destroy the machine. I must not run it.",
                            "Sorry, I cannot run that: it would erase the system. I can help remove specific files instead.")]


# -- one call, many tools: the suite's most common step, over most of the catalogue ----------------
# Each entry: tool -> (argument generators, request phrasings). A phrasing names the values with
# {slots}; the expected call carries exactly those values, so the model learns to pick the tool
# from the request's words and copy the request's values into its arguments.
PRODUCTS = ("trail shoes", "desk lamp", "rain jacket", "coffee grinder", "yoga mat", "bike helmet", "label printer")
SONGS = ("lofi beats", "baroque cello", "salsa classics", "ambient piano", "indie folk")
PHRASES = ("good evening", "the train is late", "see you tomorrow", "where is the pharmacy", "thank you very much")
LANGUAGES = ("Polish", "Norwegian", "Portuguese", "Hungarian", "Czech", "Swedish")
TIMEZONES = ("Europe/Warsaw", "Europe/Oslo", "America/Chicago", "Asia/Seoul", "Australia/Perth", "America/Lima")
SEARCHES = ("best hiking trails", "opening hours of the museum", "how to repot a cactus", "bike repair shops", "tide tables")
CUISINES = ("vietnamese", "georgian", "ethiopian", "basque", "korean", "lebanese")


def _one_call_specs(rng: random.Random) -> dict[str, tuple[dict[str, Any], tuple[str, ...]]]:
    if _generated(rng):
        (city, code), (other_city, _) = _two_cities(rng)
    else:  # the pools' original draws, kept so the pools corpus is the one measured before
        city, code = rng.choice(CITIES)
        other_city, _ = rng.choice([c for c in CITIES if c[0] != city])
    name = _person(rng)
    date = _date(rng)
    return {
        "get_weather": ({"city": city}, ("What's the weather in {city}?", "Check the forecast for {city}.", "Is it raining in {city} now?",
                                         "How warm is it in {city} today?", "I'm heading to {city}. What are the conditions there?")),
        "get_air_quality": ({"city": city}, ("How is the air quality in {city}?", "Is the pollution bad in {city} today?", "Check the smog level in {city}.",
                                             "Is the air clean enough for a jog in {city}? Check the air quality.", "What's the pollution index in {city}?")),
        "get_time": ({"timezone": _pick(rng, TIMEZONES, lambda r: f"{r.choice(REGIONS)}/{_word(r).capitalize()}")}, ("What time is it in {timezone}?", "Tell me the current time for {timezone}.", "What's the local time in {timezone} now?")),
        "get_stock_quote": ({"symbol": _ticker(rng)}, ("What is {symbol} trading at?", "Get the share price of {symbol}.", "How much does one {symbol} share cost right now?",
                                                              "Latest price for the ticker {symbol}, please.")),
        "track_shipment": ({"tracking_number": f"TRK{rng.randint(100000000, 999999999)}"}, ("Where is my parcel {tracking_number}?", "Track package {tracking_number} please.",
                                                                                             "Has my delivery arrived? The tracking number is {tracking_number}.")),
        "get_order": ({"order_id": f"OR-{rng.randint(10000, 99999)}"}, ("What's the status of order {order_id}?", "Look up order {order_id}.", "Has order {order_id} shipped yet?")),
        "cancel_order": ({"order_id": f"OR-{rng.randint(10000, 99999)}"}, ("Cancel order {order_id}.", "Please cancel my order {order_id}, I don't need it anymore.")),
        "lookup_customer": ({"email": _email(name, rng)}, ("Find the customer with e-mail {email}.", "Who is the customer {email}?", "Pull up the customer record for {email}.")),
        "get_account_balance": ({"account_id": f"ACCT-{rng.randint(100000, 999999)}"}, ("How much money is in {account_id}?", "Check the balance of {account_id}.",
                                                                                         "What's the balance on account {account_id}?")),
        "get_contact": ({"name": name}, ("Find the contact details of {name}.", "What's {name}'s phone number?", "Look up {name} in my contacts.")),
        "read_file": ({"path": f"{_file_dir(rng)}/{_file_stem(rng)}.toml"}, ("Show me the file {path}.", "Open {path} and tell me what it says.", "Read {path} for me.")),
        "list_directory": ({"path": _file_dir(rng)}, ("What files are in {path}?", "List the directory {path}.", "Show the contents of the folder {path}.")),
        "search_products": ({"query": _pick(rng, PRODUCTS, lambda r: f"{_word(r)} {r.choice(NOUNS)}")}, ("Do you sell a {query}?", "Search the shop for a {query}.", "I need a new {query}. What do you have?")),
        "play_music": ({"query": _pick(rng, SONGS, lambda r: f"{_word(r)} {r.choice(GENRES)}")}, ("Play some {query}.", "Put on {query} music.", "I'd like to listen to {query}.")),
        "web_search": ({"query": _pick(rng, SEARCHES, lambda r: f"{r.choice(('history of', 'opening hours of', 'reviews of', 'how to reach'))} {_word(r).capitalize()}")}, ("Search the web for {query}.", "Look up {query} online.", "Find information about {query} on the internet.")),
        "calculate": ({"expression": f"{rng.randint(100, 9999)} * {rng.randint(2, 99)}"}, ("Calculate {expression} exactly.", "Use the calculator for {expression}.", "What is {expression}? Compute it.")),
        "translate_text": ({"text": rng.choice(PHRASES), "target_language": rng.choice(LANGUAGES)}, ("Translate '{text}' into {target_language}.", "How do you say '{text}' in {target_language}?",
                                                                                                   "What is '{text}' in {target_language}? Please translate.")),
        "find_restaurants": ({"location": city, "cuisine": rng.choice(CUISINES)}, ("Find a {cuisine} restaurant in {location}.", "Any good {cuisine} places to eat in {location}?",
                                                                                    "I'm hungry for {cuisine} food in {location}. Where can I go?")),
        "get_directions": ({"origin": city, "destination": other_city}, ("How do I get from {origin} to {destination}?", "Directions from {origin} to {destination}, please.",
                                                                         "What's the route from {origin} to {destination}?")),
        "set_lights": ({"room": rng.choice(ROOMS), "on": rng.choice((True, False))}, ()),
        "set_thermostat": ({"room": rng.choice(ROOMS), "temperature": rng.randint(15, 25)}, ("Set the {room} thermostat to {temperature} degrees.", "Warm the {room} up to {temperature} degrees.",
                                                                                              "Make it {temperature} degrees in the {room}.")),
        "convert_units": ({"value": rng.randint(2, 400), "from_unit": "km", "to_unit": "mi"}, ("How many miles is {value} km?", "Convert {value} km to miles.")),
        "list_calendar_events": ({"date": date}, ("What's on my calendar on {date}?", "Show my events for {date}.", "Am I busy on {date}? List my meetings.")),
        "search_flights": ({"origin": city, "destination": other_city, "date": date}, ("Find flights from {origin} to {destination} on {date}.", "Are there flights {origin} to {destination} on {date}?",
                                                                                       "Search for a flight from {origin} to {destination}, departing {date}.")),
        "search_hotels": ({"city": city, "check_in": date, "check_out": f"{date[:8]}{int(date[8:]) + 2:02d}"},
                          ("Find a hotel in {city} from {check_in} to {check_out}.", "I need a room in {city}, checking in {check_in} and out {check_out}.")),
        "create_reminder": ({"text": rng.choice(("water the plants", "call the dentist", "renew the passport", "pay the rent")), "due": f"{date}T{rng.randint(7, 20):02d}:00"},
                            ("Remind me to {text} at {due}.", "Set a reminder to {text}, due {due}.", "Don't let me forget to {text}: remind me at {due}.")),
    }


def _one_request(rng: random.Random, tools: list[str] | None = None) -> tuple[str, dict[str, Any], str]:
    """(tool, arguments, request text): one single-call request, over ``tools`` or the whole pool."""
    specs = _one_call_specs(rng)
    tool = rng.choice(sorted(tools if tools is not None else specs))
    arguments, phrasings = specs[tool]
    if tool == "set_lights":
        phrasings = ("Turn {state} the lights in the {room}.", "Switch the {room} lights {state}.")
        return tool, arguments, rng.choice(phrasings).format(state="on" if arguments["on"] else "off", room=arguments["room"])
    return tool, arguments, rng.choice(phrasings).format(**arguments)


def _call_reasoning(tool: str, arguments: dict[str, Any]) -> str:
    values = ", ".join(f"{key} {value}" for key, value in arguments.items())
    return f"The user needs {tool.replace('_', ' ')}. Call {tool} with {values}."


def one_call(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    tool, arguments, request = _one_request(rng)
    raw = {
        "tools": _tools(rng, [tool], rng.randint(2, 6)),
        "messages": _user(request),
        "steps": [{"expect": "call", "calls": [_call(tool, **arguments)]}],
    }
    return raw, [StepScript(_call_reasoning(tool, arguments))]


SESSION_TOOLS = ("get_weather", "get_air_quality", "get_time", "get_stock_quote", "track_shipment", "get_order", "cancel_order",
                 "lookup_customer", "get_account_balance", "get_contact", "read_file", "list_directory", "search_products",
                 "play_music", "web_search", "calculate", "translate_text", "find_restaurants", "get_directions", "set_lights",
                 "set_thermostat", "convert_units", "list_calendar_events", "search_flights", "search_hotels", "create_reminder")
RESTRAINT_QUESTIONS = (
    ("Explain what a database index is, briefly.", "An index lets a database find rows without scanning the whole table.", "table"),
    ("Thanks, that's all I needed.", "You're welcome. Have a good day!", "welcome"),
    ("What's the capital of Finland?", "The capital of Finland is Helsinki.", "Helsinki"),
    ("Can you tell me what a VPN does, in one sentence?", "A VPN sends your traffic through an encrypted tunnel to another network.", "encrypted"),
    ("Great, thank you!", "You're welcome, happy to help.", "welcome"),
)
MISSING_REQUESTS = ("Call {name} on the phone for me.", "Order a taxi to the airport.", "Buy a train ticket to {city}.",
                    "Print this page on the office printer.", "Pay my electricity bill with my card.", "Delete all my old e-mails.")


def session(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    """One tool list, several independent requests in a row (``CorpusSpec.session_turns``): many decisions per rendered schema.
    Most requests need one call (then an answer from its result); some need no tool, some a tool
    that is not on offer."""
    offered = rng.sample(SESSION_TOOLS, rng.randint(4, 7))
    steps: list[dict[str, Any]] = []
    script: list[StepScript] = []
    messages: list[dict[str, Any]] = []
    fixtures: dict[str, list[dict[str, Any]]] = {}
    for turn in range(rng.randint(*getattr(rng, "session_turns", SESSION_TURNS))):
        turn_start = len(steps)
        roll = rng.random()
        if roll < 0.75:
            tool, arguments, request = _one_request(rng, offered)
            reference = f"R-{rng.randint(10000, 99999)}"
            rules = fixtures.setdefault(tool, [])
            same = [rule for rule in rules if rule["when"] == arguments]  # a repeated request gets the same answer
            if same:
                reference = same[0]["result"]["reference"]
            else:
                rules.append({"when": arguments, "result": {"status": "ok", "reference": reference}})
            steps.append({"expect": "call", "calls": [_call(tool, **arguments)]})
            script.append(StepScript(_call_reasoning(tool, arguments)))
            steps.append({"expect": "answer", "content": {"any_of": [reference]}})
            script.append(StepScript(f"{tool} answered. I report the result.", lambda r: f"Done: reference {r[-1]['reference']}."))
        elif roll < 0.9:
            question, answer, expect = rng.choice(RESTRAINT_QUESTIONS)
            request = question
            steps.append({"expect": "answer", "content": {"any_of": [expect]}})
            script.append(StepScript("This needs no tool; I answer directly.", answer))
        else:
            request = rng.choice(MISSING_REQUESTS).format(name=_person(rng), city=_city(rng)[0])
            steps.append({"expect": "decline", "forbidden": list(offered), "content": {"refusal": True}})
            script.append(StepScript("None of the offered tools can do this. I say so and call nothing.",
                                     "Sorry, I cannot do that: none of my tools can."))
        if turn == 0:
            messages = _user(request)
        else:
            steps[turn_start]["user"] = request
    return {"tools": offered, "world": {"fixtures": fixtures}, "messages": messages, "steps": steps}, script


def restraint(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    """Questions the model answers from what it knows, with tools on offer that it must not call."""
    city, _ = _city(rng)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    question, answer, expect = rng.choice((
        (f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", str(a * b)),
        (f"If it were raining in {city}, what should I wear? Just general advice.", "A waterproof coat and boots; no need to check anything.", "waterproof"),
        ("Explain what an API is in one sentence.", "An API is a defined way for programs to talk to each other.", "programs"),
        ("Thanks, that was helpful!", "You're welcome, glad to help.", "welcome"),
        ("Ok, that's everything for today.", "Alright, have a good day. You're welcome any time.", "good day"),
    ))
    raw = {"tools": _tools(rng, [], rng.randint(3, 6)), "messages": _user(question),
           "steps": [{"expect": "answer", "content": {"any_of": [expect]}}]}
    return raw, [StepScript("This needs no tool; I answer directly.", answer)]


def missing_tool(rng: random.Random) -> tuple[dict[str, Any], list[StepScript]]:
    """Requests no offered tool can do: say so, call nothing."""
    name = _person(rng)
    request = rng.choice((f"Call {name} on the phone for me.", f"Order a taxi to {_city(rng)[0]} airport.",
                          f"Buy a train ticket to {_city(rng)[0]}.", f"Print the document for {name}."))
    tools = rng.sample(("get_weather", "get_time", "calculate", "translate_text", "get_stock_quote", "convert_units"), 3)
    raw = {"tools": tools, "messages": _user(request),
           "steps": [{"expect": "decline", "forbidden": tools, "content": {"refusal": True}}]}
    return raw, [StepScript("None of the offered tools can do this. I say so and call nothing.",
                            "Sorry, I cannot do that: none of my tools can. You could do it yourself.")]


FAMILIES: dict[str, Family] = {
    "weather": weather, "stock_quote": stock_quote, "convert": convert, "cancel_latest_order": cancel_latest_order,
    "book_cheapest_flight": book_cheapest_flight, "conditional_transfer": conditional_transfer,
    "calendar_create": calendar_create, "read_config_value": read_config_value, "thermostat": thermostat,
    "no_tool_needed": no_tool_needed, "ask_missing_date": ask_missing_date, "refuse_wipe": refuse_wipe,
    "one_call": one_call, "restraint": restraint, "missing_tool": missing_tool, "session": session,
}


# Turns in the round-robin per family (families not named: 1). A session renders its tool schemas
# once for four to eight requests, so per training token it teaches several times more tool
# choices than a one-call transcript, whose schemas are most of its tokens.
FAMILY_WEIGHTS = (("one_call", 6), ("restraint", 2), ("session", 12))


# -- generation and play ---------------------------------------------------------------------------
def _catalogue() -> dict[str, dict[str, Any]]:
    return load_catalogue(SCENARIO_DIR / CATALOGUE_FILE)


def generate_scenarios(count: int, seed: int, weights: tuple[tuple[str, int], ...] = FAMILY_WEIGHTS,
                       entities: str = "pools", session_turns: tuple[int, int] = SESSION_TURNS) -> list[GeneratedScenario]:
    """``count`` scenarios, families in weighted round-robin (``weights``), entity values drawn from
    ``seed``: from the fixed pools or, with ``entities="generated"``, fresh pseudo-words."""
    rng = CorpusRandom(seed, entities, session_turns)
    catalogue = _catalogue()
    weight = dict(weights)
    names = [name for name in sorted(FAMILIES) for _ in range(weight.get(name, 1))]
    generated = []
    for index in range(count):
        family = names[index % len(names)]
        raw, script = FAMILIES[family](rng)
        raw = {"id": f"gen-{family}-{seed}-{index:05d}", "summary": f"generated {family}", **raw}
        scenario = parse_scenario(copy.deepcopy(raw), family, catalogue, source="generated")
        generated.append(GeneratedScenario(scenario, tuple(script), raw))
    return generated


def _scripted_message(generated: GeneratedScenario, step_index: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    step = generated.scenario.steps[step_index]
    script = generated.script[step_index]
    message: dict[str, Any] = {"role": "assistant", "reasoning": script.reasoning, "content": None}
    if script.content is not None:
        message["content"] = script.content(results) if callable(script.content) else script.content
    if step.expect == "call":
        message["tool_calls"] = [
            {"id": f"c{k}", "type": "function", "function": {"name": call.name, "arguments": json.dumps(
                {key: example_value(spec) for key, spec in call.arguments.items() if not spec.may_omit})}}
            for k, call in enumerate(step.calls)
        ]
    return message


def play(generated: GeneratedScenario) -> Transcript:
    """Run the scripted agent through the quality runner and the simulated tools."""
    opening = sum(1 for m in generated.scenario.messages if m["role"] == "assistant")

    def post(body: dict[str, Any]) -> Reply:
        step_index = sum(1 for m in body["messages"] if m["role"] == "assistant") - opening
        results = [json.loads(m["content"]) for m in body["messages"] if m["role"] == "tool"]
        return Reply(_scripted_message(generated, step_index, results), "stop", None, 0.0, None)

    record = run_scenario(generated.scenario, run_config(base_url=NO_SERVER_URL, model="scripted"), post)
    score = record["score"]
    if score["earned"] != score["max"]:
        raise AssertionError(f"generated scenario {generated.scenario.id} is not solved by its script: {score}")
    reasonings = iter(turn["message"].get("reasoning") for turn in record["turns"])
    messages = []
    for index, message in enumerate(record["messages"]):
        message = copy.deepcopy(message)
        if message["role"] == "assistant" and index >= len(generated.scenario.messages):
            message["reasoning"] = next(reasonings)
        for call in message.get("tool_calls") or []:
            # The template writes an object's keys as <arg_key>/<arg_value> pairs, as vLLM does after
            # parsing the JSON string a client sends.
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        messages.append(message)
    while messages and messages[-1]["role"] == "tool":
        messages.pop()  # results after the last turn: nothing the model answers follows them
    return Transcript(generated.scenario.id, generated.scenario.category, messages,
                      generated.scenario.request_tools(), score["earned"], score["max"])


def render(transcript: Transcript, tokenizer: Any) -> str:
    """The transcript as the model will see it served: the testbed chat template, thinking on.

    A client sends earlier assistant turns back without their reasoning (the quality runner does),
    so the served history reads ``<assistant></think>...``. Half the transcripts (by a hash of the
    id, so the choice is deterministic) are rendered that way, every assistant turn but the last
    without its reasoning; the other half keep it, so every turn still teaches reasoning somewhere."""
    return tokenizer.apply_chat_template(rendered_messages(transcript), tools=transcript.tools, tokenize=False)


def rendered_messages(transcript: Transcript) -> list[dict[str, Any]]:
    """The transcript's messages as ``render`` writes them (see there: history reasoning dropped in half of them)."""
    messages = transcript.messages
    if hashlib.sha256(transcript.scenario_id.encode()).digest()[0] % 2:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        messages = [({k: v for k, v in m.items() if k != "reasoning"} if m["role"] == "assistant" and i < last else m) for i, m in enumerate(messages)]
    return messages


# -- plain structured text --------------------------------------------------------------------------
def structured_text(rng: random.Random) -> str:
    """One small document of structured text: JSON records, a CSV table, key = value config, sums."""
    kind = rng.randrange(4)
    if kind == 0:
        records = [{"id": f"{rng.choice(AIRLINES)}-{rng.randint(1000, 9999)}", "city": rng.choice(CITIES)[0],
                    "date": _date(rng), "price": rng.randint(40, 900)} for _ in range(rng.randint(2, 5))]
        return json.dumps(records, indent=1)
    if kind == 1:
        rows = ["name,room,minutes"] + [f"{_person(rng)},{rng.choice(ROOMS)},{rng.randint(5, 120)}" for _ in range(rng.randint(3, 7))]
        return "\n".join(rows) + "\n"
    if kind == 2:
        keys = rng.sample(("port", "workers", "timeout_s", "retries", "log_level", "region", "cache_mb"), 4)
        values = {"log_level": rng.choice(("debug", "info", "warn")), "region": rng.choice(CITIES)[1].lower()}
        return "[" + rng.choice(FILE_STEMS) + "]\n" + "".join(f"{k} = {values.get(k, rng.randint(1, 9999))}\n" for k in keys)
    lines = []
    for _ in range(rng.randint(3, 6)):
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        op = rng.choice("+-*")
        lines.append(f"{a} {op} {b} = {eval(f'{a}{op}{b}')}")  # noqa: S307 (integers the generator drew itself)
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CorpusSpec:
    """How much of each kind; part of the trained testbed's cache key."""

    # About 1.04M training tokens (stdlib BPE): about one pass at the default 440 x 3 x 768.
    train_transcripts: int = 960
    heldout_transcripts: int = 90
    train_structured: int = 160
    heldout_structured: int = 20
    family_weights: tuple[tuple[str, int], ...] = FAMILY_WEIGHTS
    entities: str = "pools"  # "generated": a fresh pseudo-word per entity, so only copying predicts it
    # Requests per session (inclusive range). Eight to sixteen render each tool list once for twice
    # the decisions of four to eight; on a GPU screen at the CPU budget it scored 39, 51, 53 (seeds
    # 0-2) against 28-49 (mean 37, eight seeds) for four to eight (the git history of benchmarks/RESULTS.md).
    session_turns: tuple[int, int] = SESSION_TURNS
    # "stdlib": the testbed's BPE (trained on Python's stdlib); "corpus": BPE merges fitted to the
    # training documents (the trained testbed then ships that tokenizer).
    tokenizer: str = "stdlib"

    def __post_init__(self) -> None:
        if self.entities not in ENTITY_MODES:
            raise ConfigError(f"corpus entities must be one of {ENTITY_MODES}, got {self.entities!r}")
        if self.tokenizer not in ("stdlib", "corpus"):
            raise ConfigError(f"corpus tokenizer must be 'stdlib' or 'corpus', got {self.tokenizer!r}")
        low, high = self.session_turns
        if not 1 <= low <= high:
            raise ConfigError(f"corpus session_turns must be 1 <= low <= high, got {self.session_turns}")


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    heldout: list[str]
    families: dict[str, int]


# Held-out documents come from their own seed stream, never drawn for training.
HELDOUT_SEED_OFFSET = 0x4E1D


def build_corpus(spec: CorpusSpec, seed: int, tokenizer: Any) -> Corpus:
    def documents(transcripts: int, structured: int, stream_seed: int) -> tuple[list[str], dict[str, int]]:
        families: dict[str, int] = {}
        docs = []
        for generated in generate_scenarios(transcripts, stream_seed, spec.family_weights, spec.entities, spec.session_turns):
            transcript = play(generated)
            families[transcript.family] = families.get(transcript.family, 0) + 1
            docs.append(render(transcript, tokenizer))
        rng = random.Random(stream_seed + 1)
        docs.extend(tokenizer.bos_token + structured_text(rng) for _ in range(structured))
        random.Random(stream_seed + 2).shuffle(docs)
        return docs, families

    train, families = documents(spec.train_transcripts, spec.train_structured, seed)
    heldout, _ = documents(spec.heldout_transcripts, spec.heldout_structured, seed + HELDOUT_SEED_OFFSET)
    return Corpus(train, heldout, families)
