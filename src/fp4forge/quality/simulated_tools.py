"""Deterministic, stateful simulated tools for multi-step scenarios.

A scenario's ``world`` holds a ``state`` (plain JSON: files, calendar events, orders, accounts,
flights...) and optional ``fixtures`` (canned results per tool). A call is answered, in order, by:

1. the argument check every real API makes: unknown tool, arguments that are not a JSON object,
   missing required or wrongly typed arguments -> an ``{"error": ...}`` result;
2. the first matching fixture rule (``when``: argument values compared like the scorer compares
   them; ``times``: the rule fires only that many times, e.g. one transient 503);
3. the tool's stateful handler below, when the state has what it needs;
4. otherwise ``{"error": "<tool> is not available in this simulation"}``.

Everything is a pure function of the world spec and the sequence of calls, so replaying a saved
transcript's calls reproduces the state and every result (re-scoring relies on it). Generated ids
are sequential (``evt-4``, ``BK-1001``), never random.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fp4forge.quality.suite import Scenario
from fp4forge.quality.scorer import ParsedCall, check_type, normalize_text, parse_iso, values_equal

Result = dict[str, Any]
Handler = Callable[["SimulatedWorld", dict[str, Any]], Result]


class ToolFailure(Exception):
    """A handler's error result: what the simulated API answers instead of data."""


@dataclass
class ExecutedCall:
    name: str
    arguments_raw: str
    result: Result


@dataclass
class SimulatedWorld:
    tools: dict[str, dict[str, Any]]  # offered tools: name -> function definition
    state: dict[str, Any]
    fixtures: dict[str, list[dict[str, Any]]]
    fixture_uses: dict[tuple[str, int], int] = field(default_factory=dict)
    log: list[ExecutedCall] = field(default_factory=list)
    id_counters: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_scenario(cls, scenario: Scenario) -> SimulatedWorld:
        world = copy.deepcopy(scenario.world)
        return cls(
            tools={tool["name"]: tool for tool in scenario.tools},
            state=world.get("state", {}),
            fixtures=world.get("fixtures", {}),
        )

    def call(self, call: ParsedCall) -> Result:
        result = self._answer(call)
        self.log.append(ExecutedCall(call.name, call.arguments_raw, copy.deepcopy(result)))
        return result

    def _answer(self, call: ParsedCall) -> Result:
        tool = self.tools.get(call.name)
        if tool is None:
            return {"error": f"unknown tool '{call.name}'"}
        if call.arguments is None:
            return {"error": f"arguments must be a JSON object ({call.parse_error})"}
        problem = argument_problem(call.arguments, tool.get("parameters", {}))
        if problem is not None:
            return {"error": problem}
        fixture = self._fixture_result(call.name, call.arguments)
        if fixture is not None:
            return copy.deepcopy(fixture)
        handler = HANDLERS.get(call.name)
        if handler is None:
            return {"error": f"{call.name} is not available in this simulation"}
        try:
            return handler(self, call.arguments)
        except ToolFailure as failure:
            return {"error": str(failure)}

    def _fixture_result(self, name: str, arguments: dict[str, Any]) -> Result | None:
        for index, rule in enumerate(self.fixtures.get(name, [])):
            if not all(key in arguments and values_equal(arguments[key], value) for key, value in rule.get("when", {}).items()):
                continue
            if "times" in rule:
                used = self.fixture_uses.get((name, index), 0)
                if used >= rule["times"]:
                    continue
                self.fixture_uses[(name, index)] = used + 1
            return rule["result"]
        return None

    def new_id(self, existing: dict[str, Any], prefix: str, start: int = 1) -> str:
        """Sequential ids that never repeat within a conversation, even after a deletion."""
        number = self.id_counters.get(prefix, start + len(existing))
        while f"{prefix}{number}" in existing:
            number += 1
        self.id_counters[prefix] = number + 1
        return f"{prefix}{number}"

    def need(self, key: str, tool: str) -> Any:
        if key not in self.state:
            raise ToolFailure(f"{tool} is not available in this simulation")
        return self.state[key]


def argument_problem(arguments: dict[str, Any], parameters: dict[str, Any]) -> str | None:
    properties = parameters.get("properties", {})
    for key in parameters.get("required", []):
        if key not in arguments:
            return f"missing required argument '{key}'"
    for key, value in arguments.items():
        if key not in properties:
            return f"unknown argument '{key}'"
        kind = check_type(value, properties[key])
        if kind is not None:
            return f"invalid value for '{key}': {json.dumps(value)[:60]}"
    return None


def replay(scenario: Scenario, turns_calls: list[list[ParsedCall]]) -> tuple[dict[str, Any], list[list[Result]]]:
    """Run the recorded calls of each turn through a fresh world: (final state, results per turn)."""
    world = SimulatedWorld.for_scenario(scenario)
    results = [[world.call(call) for call in calls] for calls in turns_calls]
    return world.state, results


# -- handlers -----------------------------------------------------------------------------------
def _same(a: Any, b: Any) -> bool:
    return isinstance(a, str) and isinstance(b, str) and normalize_text(a) == normalize_text(b)


# files: state["files"] = {path: text}
def read_file(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    files = world.need("files", "read_file")
    if args["path"] not in files:
        raise ToolFailure(f"no such file: {args['path']}")
    return {"path": args["path"], "content": files[args["path"]]}


def write_file(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    files = world.need("files", "write_file")
    if args["path"] in files and args.get("overwrite") is not True:
        raise ToolFailure(f"{args['path']} exists; pass overwrite=true to replace it")
    files[args["path"]] = args["content"]
    return {"path": args["path"], "bytes_written": len(args["content"].encode())}


def list_directory(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    files = world.need("files", "list_directory")
    prefix = args["path"].rstrip("/") + "/"
    return {"path": args["path"], "files": sorted(p for p in files if p.startswith(prefix))}


def delete_file(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    files = world.need("files", "delete_file")
    if args["path"] not in files:
        raise ToolFailure(f"no such file: {args['path']}")
    del files[args["path"]]
    return {"deleted": args["path"]}


# calendar: state["events"] = {event_id: {title, start, duration_minutes, ...}}
def list_calendar_events(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    events = world.need("events", "list_calendar_events")
    day = parse_iso(args["date"], "date")
    if day is None:
        raise ToolFailure(f"invalid date '{args['date']}': expected YYYY-MM-DD")
    listed = []
    for event_id, event in sorted(events.items(), key=lambda item: item[1]["start"]):
        start = parse_iso(event["start"], "datetime")
        if start is not None and start.date() == day:
            listed.append({"event_id": event_id, **event})
    return {"date": args["date"], "events": listed}


def create_calendar_event(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    events = world.need("events", "create_calendar_event")
    if parse_iso(args["start"], "datetime") is None:
        raise ToolFailure(f"invalid start '{args['start']}': expected YYYY-MM-DDTHH:MM")
    event_id = world.new_id(events, "evt-")
    events[event_id] = {key: copy.deepcopy(value) for key, value in args.items()}
    return {"event_id": event_id, "created": True}


def delete_calendar_event(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    events = world.need("events", "delete_calendar_event")
    if args["event_id"] not in events:
        raise ToolFailure(f"no event {args['event_id']}")
    del events[args["event_id"]]
    return {"deleted": args["event_id"]}


# shop: state["customers"] = {email: {...}}, state["orders"] = {order_id: {...}}
def lookup_customer(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    customers = world.need("customers", "lookup_customer")
    orders = world.state.get("orders", {})
    for email, customer in customers.items():
        if _same(email, args["email"]):
            recent = [{"order_id": o, "placed": orders.get(o, {}).get("placed"), "status": orders.get(o, {}).get("status")}
                      for o in customer.get("orders", [])]
            return {"customer_id": customer["customer_id"], "name": customer.get("name"), "recent_orders": recent}
    raise ToolFailure(f"no customer with email {args['email']}")


def get_order(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    orders = world.need("orders", "get_order")
    if args["order_id"] not in orders:
        raise ToolFailure(f"no order {args['order_id']}")
    return {"order_id": args["order_id"], **orders[args["order_id"]]}


def cancel_order(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    orders = world.need("orders", "cancel_order")
    order = orders.get(args["order_id"])
    if order is None:
        raise ToolFailure(f"no order {args['order_id']}")
    if order["status"] not in ("placed", "processing"):
        raise ToolFailure(f"order {args['order_id']} is {order['status']} and can no longer be cancelled")
    order["status"] = "cancelled"
    return {"order_id": args["order_id"], "status": "cancelled"}


# bank: state["accounts"] = {account_id: {balance, currency}}
def get_account_balance(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    accounts = world.need("accounts", "get_account_balance")
    account = accounts.get(args["account_id"])
    if account is None:
        raise ToolFailure(f"no account {args['account_id']}")
    return {"account_id": args["account_id"], "balance": account["balance"], "currency": account["currency"]}


def transfer_funds(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    accounts = world.need("accounts", "transfer_funds")
    source, target = accounts.get(args["from_account"]), accounts.get(args["to_account"])
    if source is None or target is None:
        raise ToolFailure(f"no account {args['from_account'] if source is None else args['to_account']}")
    if not _same(args["currency"], source["currency"]):
        raise ToolFailure(f"{args['from_account']} holds {source['currency']}, not {args['currency']}")
    amount = float(args["amount"])
    if amount <= 0 or amount > source["balance"]:
        raise ToolFailure(f"invalid amount {amount}: balance is {source['balance']}")
    source["balance"] = round(source["balance"] - amount, 2)
    target["balance"] = round(target["balance"] + amount, 2)
    transfers = world.state.setdefault("transfers", [])
    transfers.append({"from": args["from_account"], "to": args["to_account"], "amount": amount})
    return {"transfer_id": f"TR-{len(transfers):04d}", "from_balance": source["balance"]}


# travel: state["flights"] = [{flight_id, origin: [names], destination: [names], date, cabin, ...}]
def search_flights(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    flights = world.need("flights", "search_flights")
    if parse_iso(args["date"], "date") is None:
        raise ToolFailure(f"invalid date '{args['date']}': expected YYYY-MM-DD")
    cabin = args.get("cabin", "economy")
    found = [
        {"flight_id": f["flight_id"], "origin": f["origin"][0], "destination": f["destination"][0], "date": f["date"],
         "depart": f["depart"], "cabin": f["cabin"], "price_eur": f["price_eur"]}
        for f in flights
        if any(_same(args["origin"], n) for n in f["origin"]) and any(_same(args["destination"], n) for n in f["destination"])
        and values_equal(args["date"], f["date"], value_format="date") and f["cabin"] == cabin
    ]
    return {"flights": found}


def book_flight(world: SimulatedWorld, args: dict[str, Any]) -> Result:
    flights = world.need("flights", "book_flight")
    if not any(f["flight_id"] == args["flight_id"] for f in flights):
        raise ToolFailure(f"no flight {args['flight_id']}")
    if not args["passenger_names"]:
        raise ToolFailure("passenger_names is empty")
    bookings = world.state.setdefault("bookings", {})
    reference = world.new_id(bookings, "BK-", start=1001)
    bookings[reference] = {"flight_id": args["flight_id"], "passenger_names": list(args["passenger_names"])}
    return {"booking_reference": reference, "flight_id": args["flight_id"], "status": "confirmed"}


HANDLERS: dict[str, Handler] = {
    "read_file": read_file,
    "write_file": write_file,
    "list_directory": list_directory,
    "delete_file": delete_file,
    "list_calendar_events": list_calendar_events,
    "create_calendar_event": create_calendar_event,
    "delete_calendar_event": delete_calendar_event,
    "lookup_customer": lookup_customer,
    "get_order": get_order,
    "cancel_order": cancel_order,
    "get_account_balance": get_account_balance,
    "transfer_funds": transfer_funds,
    "search_flights": search_flights,
    "book_flight": book_flight,
}
