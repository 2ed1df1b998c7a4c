"""Stored Responses: what `previous_response_id`, `background` runs and the retrieve, delete,
cancel and input-items routes of OpenAI's Responses API read.

A response whose request has `store` true (OpenAI's default) is kept once it is finished (a
background one from the moment it is accepted), with its input items and the conversation
before them, so that a later request's `previous_response_id` continues it. The store holds at
most `capacity` responses (`--max-stored-responses`) and forgets the least recently used
finished one beyond that; with capacity 0 nothing is kept, and `previous_response_id` and
`background` are a 400. A background run goes on whatever its client does, until it ends or is
cancelled; the events of a streamed one are kept for readers that join later
(`starting_after`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from quantspec.serve.jobs import BadRequest
from quantspec.serve.responses import ResponseItems, ResponsesRequest, response_events

__all__ = ["ResponseStore", "Stored"]

RUNNING = ("queued", "in_progress")


class Stored:
    """One response: its `items` (the Response, live while it runs), the input `items` it answered
    (each with an id) and the conversation `earlier` than them (input and output items)."""

    def __init__(self, items: ResponseItems, inputs: list[dict], earlier: list[dict]):
        self.items, self.inputs, self.earlier = items, inputs, earlier
        self.task: asyncio.Task | None = None  # a background run
        self.events: list[str] | None = None  # a streamed background run's events, as sent
        self._more = asyncio.Event()  # set when `events` grows or the run ends

    @property
    def id(self) -> str:
        return self.items.id

    def conversation(self) -> list[dict]:
        """The items a response continuing this one goes on from: earlier ones, its input, its output."""
        return [*self.earlier, *self.inputs, *self.items.items]

    async def run(self, chunks) -> None:
        """Build the Response from a chat answer's `chunks`, keeping the events where `events` is a list."""
        try:
            async for event in response_events(self.items, chunks):
                if self.events is not None:
                    self.events.append(event)
                    self._more.set()
        finally:
            self._more.set()

    async def replay(self, starting_after: int | None = None):
        """The events after sequence number `starting_after`, then the rest as they come."""
        at = 0 if starting_after is None else starting_after + 1
        while True:
            self._more.clear()
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.task is None or self.task.done():
                return
            await self._more.wait()


class ResponseStore:
    """At most `capacity` stored responses by id, least recently used first out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, items: ResponseItems, inputs: list[dict], earlier: list[dict]) -> Stored:
        """A response to answer (`Stored`), marked as kept where its request asks to be stored and
        the store holds any."""
        items.stored = items.body.store and self.capacity > 0
        return Stored(items, inputs, earlier)

    def keep(self, entry: Stored) -> None:
        """Store `entry` where it is marked as kept."""
        if not entry.items.stored:
            return
        self._entries[entry.id] = entry
        self._entries.move_to_end(entry.id)
        for rid in [rid for rid, e in self._entries.items() if e.items.status not in RUNNING]:
            if len(self._entries) <= self.capacity:
                break
            del self._entries[rid]

    def get(self, rid: str) -> Stored:
        entry = self._entries.get(rid)
        if entry is None:
            raise BadRequest(f"Response with id {rid!r} not found.", param="response_id", code="not_found", status=404)
        self._entries.move_to_end(rid)
        return entry

    def earlier(self, asked: ResponsesRequest) -> list[dict]:
        """The conversation request `asked` continues ([] without `previous_response_id`); a 400
        where it asks for what the store cannot give."""
        if asked.background and not (asked.store and self.capacity > 0):
            raise BadRequest("background responses are stored responses; send store true (and start the server "
                             "with --max-stored-responses above 0)", param="background")
        rid = asked.previous_response_id
        if rid is None:
            return []
        if self.capacity == 0:
            raise BadRequest("responses are not stored by this server (--max-stored-responses 0); send the "
                             "conversation in input instead of previous_response_id", param="previous_response_id")
        entry = self._entries.get(rid)
        if entry is None:
            raise BadRequest(f"Previous response with id {rid!r} not found.", param="previous_response_id",
                             code="previous_response_not_found", status=404)
        if entry.items.status in RUNNING:
            raise BadRequest(f"response {rid!r} is still {entry.items.status}; continue it once it has finished",
                             param="previous_response_id")
        self._entries.move_to_end(rid)
        return entry.conversation()

    def background(self, entry: Stored, chunks, *, stream: bool) -> None:
        """Store `entry` (its request checked by `earlier`) and run it on its own; `stream`: keep its
        events for readers."""
        entry.items.status = "queued"
        entry.events = [] if stream else None
        self.keep(entry)
        entry.task = asyncio.ensure_future(entry.run(chunks))

    async def cancel(self, rid: str) -> dict:
        """Stop a background response still running (its sequence aborted): it is "cancelled"."""
        entry = self.get(rid)
        if entry.task is None:
            raise BadRequest("only a background response can be cancelled", param="response_id")
        if entry.items.status in RUNNING:
            entry.items.status = "cancelled"
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
        return entry.items.response()

    def delete(self, rid: str) -> dict:
        entry = self.get(rid)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
        del self._entries[rid]
        return {"id": rid, "object": "response.deleted", "deleted": True}

    def input_items(self, rid: str, *, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        """A page of the input items response `rid` answered, in OpenAI's list shape."""
        items = list(self.get(rid).inputs)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise BadRequest(f"after {after!r} is not an input item of response {rid!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
