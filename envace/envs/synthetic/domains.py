"""The nine domain templates, the abstract operations and task shapes they share, and the observation/state
helpers every module of the generator uses."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: abstract operations, in the order tools are listed
OPS: tuple[str, ...] = ("find", "get", "list", "set", "add", "setnum", "move", "create", "delete")
#: task shapes (``TaskSpec.category``), in the order environments cycle through them
SHAPES: tuple[str, ...] = (
    "act",
    "query",
    "lookup_act",
    "lookup_query",
    "copy_value",
    "transfer_chain",
    "create_verify",
    "filter_update",
    "multiturn",
)
WRITES = ("set", "add", "setnum", "delete")  # single-entity writes


@dataclass(frozen=True)
class Domain:
    """A domain template; environments instantiate it with their own entities and renamings."""

    name: str
    noun: str
    plural: str
    namef: str  # field holding the entity's unique name
    numf: str  # the numeric field
    statf: str  # the categorical field
    statuses: tuple[str, ...]  # statuses[0]: status of new entities
    lo: int
    hi: int
    names: tuple[str, ...]
    letters: str  # id prefix candidates
    tools: Mapping[str, tuple[str, ...]]  # op -> tool-name variants (ops the domain supports)
    idp: tuple[str, ...]  # id parameter name variants
    amtp: tuple[str, ...] = ("amount",)  # amount parameter name variants


_PEOPLE = (
    "Ana Ruiz", "Li Wei", "Omar Haddad", "Priya Nair", "Jon Berg", "Sara Kim", "Tom Lutz",
    "Ines Vidal", "Marta Fong", "Carl Ode", "Eva Lind", "Raj Patel", "Nora Diaz", "Ivan Petrov",
)  # fmt: skip

# fmt: off
DOMAINS: tuple[Domain, ...] = (
    Domain(
        "bank", "account", "accounts", "owner", "balance", "status", ("open", "frozen"), 20, 900, _PEOPLE, "ABK",
        {
            "find": ("find_account", "lookup_account", "account_by_owner"),
            "get": ("get_account", "account_info", "show_account"),
            "list": ("list_accounts", "accounts_by_status"),
            "set": ("set_account_status", "set_status"),
            "add": ("deposit", "credit_account"),
            "move": ("transfer", "move_funds"),
            "create": ("open_account", "create_account"),
            "delete": ("close_account", "delete_account"),
        },
        ("account_id", "acct", "id"),
    ),
    Domain(
        "shop", "item", "items", "product", "stock", "status", ("listed", "hidden"), 5, 300,
        ("lamp", "kettle", "mug", "desk", "chair", "sofa", "fan", "rug", "clock", "vase", "towel", "stool",
         "pillow", "mirror"),
        "IPS",
        {
            "find": ("find_item", "item_by_product", "search_item"),
            "get": ("get_item", "item_info"),
            "list": ("list_items", "items_by_status"),
            "set": ("set_item_status", "set_listing"),
            "add": ("restock", "add_stock"),
            "setnum": ("set_stock", "update_stock"),
            "create": ("add_item", "create_item"),
            "delete": ("remove_item", "delete_item"),
        },
        ("item_id", "sku", "id"),
        ("qty", "amount"),
    ),
    Domain(
        "calendar", "event", "events", "title", "hour", "status", ("confirmed", "tentative", "cancelled"), 7, 20,
        ("standup", "review", "lunch", "retro", "demo", "sync", "training", "interview", "planning", "offsite",
         "onboarding", "budget", "workshop", "party"),
        "ECM",
        {
            "find": ("find_event", "event_by_title"),
            "get": ("get_event", "event_info", "show_event"),
            "list": ("list_events", "events_by_status"),
            "set": ("set_event_status", "mark_event"),
            "setnum": ("reschedule", "set_event_hour"),
            "create": ("create_event", "add_event", "schedule_event"),
            "delete": ("delete_event", "remove_event"),
        },
        ("event_id", "id"),
    ),
    Domain(
        "files", "file", "files", "path", "size", "status", ("private", "shared"), 1, 999,
        ("notes.txt", "todo.md", "report.pdf", "data.csv", "logo.png", "main.py", "budget.xls", "readme.md",
         "plan.doc", "log.txt", "app.js", "index.html", "photo.jpg", "song.mp3"),
        "FD",
        {
            "find": ("find_file", "file_by_path", "locate_file"),
            "get": ("stat_file", "get_file", "file_info"),
            "list": ("list_files", "files_by_status"),
            "set": ("set_visibility", "set_file_status"),
            "add": ("append", "grow_file"),
            "setnum": ("truncate", "resize_file"),
            "create": ("create_file", "touch"),
            "delete": ("delete_file", "rm_file"),
        },
        ("file_id", "fid", "id"),
        ("bytes", "amount"),
    ),
    Domain(
        "kv", "entry", "entries", "key", "value", "status", ("live", "locked"), 1, 500,
        ("cache_ttl", "max_users", "retries", "timeout", "port", "workers", "batch", "quota", "limit", "depth",
         "threads", "backlog", "window", "shards"),
        "KV",
        {
            "find": ("find_key", "lookup_key"),
            "get": ("get_entry", "read_entry"),
            "list": ("list_entries", "entries_by_status"),
            "set": ("set_entry_status", "lock_state"),
            "add": ("incr", "increment"),
            "setnum": ("put", "set_value"),
            "move": ("shift_value", "move_value"),
            "create": ("create_entry", "insert"),
            "delete": ("delete_entry", "drop_entry"),
        },
        ("entry_id", "eid", "id"),
        ("by", "amount"),
    ),
    Domain(
        "tickets", "ticket", "tickets", "subject", "priority", "status", ("open", "pending", "closed"), 1, 9,
        ("login error", "slow page", "refund", "broken link", "crash", "typo", "timeout", "billing", "password",
         "upload fail", "sync issue", "dark mode", "export bug", "spam"),
        "TQ",
        {
            "find": ("find_ticket", "ticket_by_subject", "search_tickets"),
            "get": ("get_ticket", "ticket_info"),
            "list": ("list_tickets", "tickets_by_status"),
            "set": ("set_ticket_status", "update_ticket"),
            "setnum": ("set_priority", "reprioritize"),
            "create": ("create_ticket", "file_ticket", "new_ticket"),
            "delete": ("delete_ticket", "purge_ticket"),
        },
        ("ticket_id", "tid", "id"),
    ),
    Domain(
        "library", "book", "books", "title", "copies", "status", ("available", "reserved"), 1, 60,
        ("dune", "emma", "ulysses", "hamlet", "odyssey", "walden", "beloved", "rebecca", "matilda", "heidi",
         "ivanhoe", "carrie", "lolita", "persuasion"),
        "BL",
        {
            "find": ("find_book", "search_title"),
            "get": ("get_book", "book_info"),
            "list": ("list_books", "books_by_status"),
            "set": ("set_book_status", "mark_book"),
            "add": ("add_copies", "acquire"),
            "setnum": ("set_copies", "recount"),
            "create": ("add_book", "catalog_book"),
            "delete": ("withdraw_book", "remove_book"),
        },
        ("book_id", "isbn", "id"),
        ("count", "amount"),
    ),
    Domain(
        "loyalty", "member", "members", "name", "points", "tier", ("basic", "silver", "gold"), 10, 999, _PEOPLE, "MR",
        {
            "find": ("find_member", "member_by_name"),
            "get": ("get_member", "member_info"),
            "list": ("list_members", "members_by_tier"),
            "set": ("set_tier", "change_tier"),
            "add": ("award_points", "add_points"),
            "move": ("transfer_points", "gift_points"),
            "create": ("enroll", "add_member"),
            "delete": ("remove_member", "unenroll"),
        },
        ("member_id", "mid", "id"),
        ("points", "amount"),
    ),
    Domain(
        "warehouse", "bin", "bins", "label", "qty", "state", ("active", "sealed"), 5, 500,
        ("north", "south", "east", "west", "dock", "yard", "loft", "annex", "cellar", "depot", "bay", "attic",
         "shed", "vault"),
        "WB",
        {
            "find": ("find_bin", "bin_by_label"),
            "get": ("get_bin", "bin_info", "inspect_bin"),
            "list": ("list_bins", "bins_by_state"),
            "set": ("set_bin_state", "seal_state"),
            "add": ("receive", "add_qty"),
            "setnum": ("set_qty", "count_bin"),
            "move": ("move_stock", "transfer_qty"),
            "create": ("create_bin", "open_bin"),
            "delete": ("delete_bin", "retire_bin"),
        },
        ("bin_id", "bin", "id"),
        ("qty", "amount"),
    ),
)
# fmt: on

SRC_DST = (("from_id", "to_id"), ("source", "target"), ("src", "dst"))


def dump_obs(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False)


def error_obs(msg: str) -> str:
    return dump_obs({"error": msg})


def copy_state(state: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: dict(v) for k, v in state.items()}
