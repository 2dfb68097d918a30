"""The HTTP connection: uvicorn's h11 protocol, plus a limit on how long a request head may take.

uvicorn closes idle keep-alive connections, but a client that opens a connection and sends its
request head a byte at a time (slowloris) holds it forever. Here a connection whose head is not
complete `header_timeout_s` after its first byte (or after it opened) is closed."""
from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout_s = 10.0  # set per server by make_server (a subclass per server)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_head():
            self._cancel_head_timer()
        elif self._head_timer is None:  # a keep-alive connection began its next head
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_head_timer()  # idle now: uvicorn's keep-alive timeout applies

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": float(seconds)})
